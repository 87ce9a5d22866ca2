"""One rank: its model shard, KV cache and ModelRunner, built the same way in the front process and in
worker processes; and the loop a worker process runs."""
import logging
import os
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtpserve.config import EngineConfig, ModelConfig
from mtpserve.distributed.launch import Launch, join, leave, rank_device
from mtpserve.executor.step_sync import (PASS_COUNTS, RequestMirror, gather_to_front, receive_step,
                                         without_draft_probs)
from mtpserve.model.loader import LoadStats, load_model, load_tokenizer
from mtpserve.model.parallel import parallel_layout
from mtpserve.runner.dp_runner import DataParallelRunner
from mtpserve.runner.dp_sync import DataParallelSync
from mtpserve.runner.background import compile_later_refusal
from mtpserve.runner.model_runner import ModelRunner, num_drafter_caches
from mtpserve.sampling.grammar import compiler_for
from mtpserve.spec_decode.draft_vocab import load_draft_vocab

logger = logging.getLogger("mtpserve")


@dataclass
class RankSetup:
    """Everything a rank needs to build its part of the engine (picklable: it is sent to spawned workers)."""
    config: EngineConfig
    path: str
    model_config: ModelConfig
    device_type: str
    dtype: torch.dtype
    max_model_len: int
    num_lookahead_slots: int        # KV slots the MTP draft passes write past the verified ones
    max_step_overshoot: int         # slots past the last token a step may need
    launch: Launch
    quantization: str | None        # "fp8", "int8" or None (weights in `dtype`)


@dataclass
class Rank:
    runner: ModelRunner
    num_blocks: int
    control: object            # the gloo group steps are handed over on (None with one rank)
    rank_stats: list[dict]     # every rank's memory and load figures (rank_summary), rank 0 first


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_summary(rank: int, runner: ModelRunner, stats: LoadStats, load_rss_rise: int, seconds: float) -> dict:
    """Weight and KV bytes this rank holds, what its load read, and how far its resident memory rose while
    loading (peak RSS after loading minus RSS before: valid when nothing earlier in the process peaked higher)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in runner.model.parameters()}
    return dict(rank=rank, weight_bytes=sum(storages.values()),
                kv_bytes=sum(c.numel() * c.element_size() for c in runner.kv_caches),
                checkpoint_bytes_read=stats.bytes_read, load_seconds=seconds,
                load_peak_rss_rise_bytes=load_rss_rise)


def kv_blocks_from_memory(setup: RankSetup, device: torch.device) -> int:
    """KV blocks that fit this rank's share of memory (the latent cache is whole on every rank), capped by
    what max_num_seqs requests of max_model_len can use."""
    mc, cfg = setup.model_config, setup.config
    layers = mc.num_hidden_layers + num_drafter_caches(mc, cfg.speculative)
    bytes_per_block = layers * cfg.block_size * mc.kv_cache_dim * torch.finfo(setup.dtype).bits // 8
    if device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] * cfg.kv_cache_memory_fraction
    else:   # the ranks of a node share its RAM
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = ram * cfg.kv_cache_memory_fraction / setup.launch.ranks_per_node
    per_seq = -(-(setup.max_model_len + setup.max_step_overshoot) // cfg.block_size)
    return max(per_seq, min(int(budget // bytes_per_block), per_seq * cfg.max_num_seqs))


def build_rank(setup: RankSetup, rank: int, zeroed_kv: bool = True) -> Rank:
    """Joins the process group (with more than one rank), agrees on the KV cache size (the smallest any rank
    can hold), loads this rank's shard and builds (and warms up) its runner. zeroed_kv: see ModelRunner."""
    cfg, launch = setup.config, setup.launch
    device = rank_device(setup.device_type, rank, launch)
    if device.type == "cpu" and (cfg.cpu_threads or launch.world_size > 1):
        torch.set_num_threads(cfg.cpu_threads or max(1, (os.cpu_count() or 1) // launch.ranks_per_node))
    group, control = (None, None) if launch.world_size == 1 else join(rank, launch, device)
    tp, ep = parallel_layout(cfg.tensor_parallel_size, cfg.data_parallel_size, cfg.enable_expert_parallel, rank, group)
    num_blocks = cfg.num_kv_blocks or kv_blocks_from_memory(setup, device)
    if control is not None:
        agreed = torch.tensor([num_blocks])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
        num_blocks = int(agreed)
    stats, rss_before, start = LoadStats(), rss_bytes(), time.perf_counter()
    model = load_model(setup.path, setup.dtype, device, setup.model_config, tp, stats,
                       setup.quantization, ep).eval().fuse_for_inference()
    load_seconds, load_rss_rise = time.perf_counter() - start, max(0, peak_rss_bytes() - rss_before)
    spec = cfg.speculative
    if spec is not None and spec.draft_vocab_size is not None:
        ids, coverage = load_draft_vocab(setup.path, spec.draft_vocab_size, setup.model_config.vocab_size)
        model.set_draft_vocab(ids.to(device))
        if rank == 0:
            logger.info("draft vocabulary: the %d most frequent of %d tokens (%.1f%% of the counted tokens)",
                        len(ids), setup.model_config.vocab_size, 100 * coverage)
    use_graphs = not cfg.enforce_eager   # (resolved by engine/setup.py's resolve_graph_mode)
    dp = None
    if ep is not None and ep.dispatch:   # agreement on a gloo group (CPU tensors) whatever the device
        dp = DataParallelSync(group if device.type == "cpu" else dist.new_group(backend="gloo"), launch.world_size)
    seed = cfg.seed + (rank if dp is not None else 0)   # (data-parallel ranks draw for different requests)
    runner_args = (model, num_blocks, cfg.block_size, spec, device, setup.dtype, seed,
                   cfg.graph_batch_sizes if use_graphs else None, setup.max_model_len + setup.max_step_overshoot)
    if dp is None:
        runner = ModelRunner(*runner_args, compile_in_background=cfg.compile_in_background, zeroed_kv=zeroed_kv)
    else:
        runner = DataParallelRunner(*runner_args, dp=dp)
    runner.warm_up_graphs(can_compile_later=compile_later_refusal(device.type, launch.world_size) is None)
    summary = rank_summary(rank, runner, stats, load_rss_rise, load_seconds)
    every = [summary]
    if control is not None:
        every = [None] * launch.world_size
        dist.all_gather_object(every, summary, group=control)
    return Rank(runner, num_blocks, control, every)


def worker_process(setup: RankSetup, rank: int, errors) -> None:
    """A spawned worker: builds its rank, then runs every step the front hands over until told to stop.
    Any failure is reported on `errors` (the front names it) before the process exits."""
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")   # compile in this process: no pool to orphan
    try:
        run_rank(setup, rank)
    except BaseException as e:
        try:
            errors.put((rank, f"{type(e).__name__}: {e}"))
            errors.close()
            errors.join_thread()
        finally:
            os._exit(1)


def run_rank(setup: RankSetup, rank: int) -> None:
    """A rank other than the front (a spawned worker, or a torchrun / other-node process): build, then serve
    steps until the front says stop."""
    built = build_rank(setup, rank)
    mirror = RequestMirror(built.runner.device, lambda: compiler_for(setup.model_config, load_tokenizer(setup.path)))
    data_parallel = setup.config.data_parallel_size > 1
    world = setup.launch.world_size
    while (message := receive_step(built.control)) is not None:
        if message == PASS_COUNTS:
            gather_to_front(built.control, world, dict(built.runner.pass_counts))
            continue
        scheduled = mirror.apply(message[rank] if data_parallel else message)
        results = built.runner.execute(scheduled)
        mirror.record(scheduled, results)
        if data_parallel:
            gather_to_front(built.control, world, without_draft_probs(results))
    leave()
