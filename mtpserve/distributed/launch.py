"""Process groups on torch.distributed: where the ranks are, how each one joins, and what it runs on.

Ranks are numbered node by node (node n holds ranks n * per_node .. (n + 1) * per_node - 1); rank 0 is the
front (scheduler, server) and also runs its own shard. Every rank joins through `env://`: torchrun sets
MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE itself, and the engine sets them for the processes it spawns.
Collectives use NCCL on CUDA and gloo on the CPU; the step hand-off from the front goes over a gloo group of
its own whose timeout is long, since workers wait on it for as long as the server is idle.
"""
import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


# A collective that waits longer than this means a rank is stuck (a dead rank is noticed at once: gloo and
# NCCL see its sockets close). Start-up compiles graphs on every rank, so it is generous.
def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("MTPSERVE_COLLECTIVE_TIMEOUT", 600)))


CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class Launch:
    """Where the ranks of one engine run. world_size = tensor_parallel_size x data_parallel_size."""
    world_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None     # None: a free port, chosen by the front (single node only)
    external: bool = False             # every rank was started by torchrun: spawn nothing

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def local_ranks(self) -> list[int]:
        first = self.node_rank * self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))

    def validate(self) -> None:
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"nnodes = {self.nnodes}: must divide the {self.world_size} ranks "
                             "(tensor_parallel_size x data_parallel_size)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank = {self.node_rank}: must be in [0, nnodes = {self.nnodes})")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("master_port: needed when nnodes > 1 (every node must name the same port)")

    @classmethod
    def from_torchrun_env(cls, world_size: int) -> "Launch | None":
        """The launch torchrun describes in the environment, or None when not under torchrun."""
        if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_WORLD_SIZE" not in os.environ:
            return None
        world = int(os.environ["WORLD_SIZE"])
        if world != world_size:
            raise ValueError(f"tensor_parallel_size x data_parallel_size = {world_size}: torchrun started "
                             f"WORLD_SIZE = {world} processes")
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        return cls(world, world // per_node, int(os.environ["RANK"]) // per_node, os.environ["MASTER_ADDR"],
                   int(os.environ["MASTER_PORT"]), external=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device_type: str, rank: int, launch: Launch) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", rank % launch.ranks_per_node)
    return torch.device(device_type)


def check_devices(device_type: str, launch: Launch) -> None:
    """More ranks on a node than it has devices (CUDA) or cores (CPU) is refused, naming the limit."""
    per_node = launch.ranks_per_node
    have = torch.cuda.device_count() if device_type == "cuda" else os.cpu_count() or 1
    what = "CUDA devices" if device_type == "cuda" else "CPU cores"
    if per_node > have:
        raise ValueError(f"tensor_parallel_size x data_parallel_size = {launch.world_size}: {per_node} ranks on "
                         f"this node, but it has {have} {what}")


def join(rank: int, launch: Launch, device: torch.device) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Joins the process group as `rank` (env:// rendezvous); returns the group of all ranks (the model's
    collectives) and the control group (gloo) the front hands each step over."""
    os.environ.update(MASTER_ADDR=launch.master_addr, MASTER_PORT=str(launch.master_port),
                      RANK=str(rank), WORLD_SIZE=str(launch.world_size))
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine is already running in this process: shut it down first "
                           "(engine.shutdown()); torch.distributed has one default process group per process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=launch.world_size,
                            timeout=collective_timeout())
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return dist.group.WORLD, control


def end_processes(processes, timeout: float) -> None:
    """Waits up to `timeout` seconds for each process to exit, then kills it."""
    for p in processes:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
