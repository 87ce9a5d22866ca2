"""From an EngineConfig to what every rank needs (RankSetup): checks, device, dtype, quantization, where the
ranks run; and, in a process that is not the front (another node, a torchrun rank), running its ranks."""
import os
from dataclasses import replace

import torch

from mtpserve.config import EngineConfig, ModelConfig, SpeculativeConfig, check_int_in_range
from mtpserve.distributed.launch import Launch, check_devices, end_processes
from mtpserve.executor.worker import RankSetup, run_rank, worker_process
from mtpserve.model import cpu_kernels
from mtpserve.model.deepseek_v3 import DeepseekV3ForCausalLM
from mtpserve.model.parallel import parallel_layout
from mtpserve.runner.background import compile_later_refusal
from mtpserve.spec_decode.proposer import proposer_class


def resolve_device_dtype(device: str, dtype: str, checkpoint_dtype: str | None = None
                         ) -> tuple[torch.device, torch.dtype]:
    """dtype "auto": bf16 on CUDA; on the CPU the checkpoint's bf16 where our bf16 kernels run (they keep MTP
    lossless to the bit there: docs/speculative_decoding.md), else float32."""
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype == "auto":
        bf16 = dev.type == "cuda" or (checkpoint_dtype == "bfloat16" and cpu_kernels.load())
        return dev, torch.bfloat16 if bf16 else torch.float32
    if dtype not in names:
        raise ValueError(f"dtype = {dtype!r}: must be one of 'auto', {sorted(names)}")
    return dev, names[dtype]


def engine_setup(cfg: EngineConfig) -> RankSetup:
    """Checks the configuration and resolves what every rank needs (the front and every worker)."""
    from mtpserve import default_model_path
    path = cfg.model or default_model_path()
    model_config = ModelConfig.from_pretrained(path)
    spec = cfg.speculative
    drafter = proposer_class(spec)
    if drafter is not None:
        drafter.check(model_config, spec)
    device, dtype = resolve_device_dtype(cfg.device, cfg.dtype, model_config.torch_dtype)
    if cfg.quantization == "int8":
        dtype = int8_activation_dtype(cfg.dtype, dtype, device)
    limit = model_config.max_position_embeddings
    if cfg.max_model_len is not None and cfg.max_model_len > limit:
        raise ValueError(f"max_model_len = {cfg.max_model_len}: above the model's max_position_embeddings {limit}")
    k = spec.num_speculative_tokens if spec else 0
    if cfg.max_num_batched_tokens < 1 + k:
        raise ValueError(f"max_num_batched_tokens = {cfg.max_num_batched_tokens}: must be at least "
                         f"1 + num_speculative_tokens = {1 + k}")
    lookahead = drafter.lookahead_slots(spec) if drafter is not None else 0
    check_int_in_range("tensor_parallel_size", cfg.tensor_parallel_size, 1, None)
    check_int_in_range("data_parallel_size", cfg.data_parallel_size, 1, None)
    if cfg.cpu_threads is not None:
        check_int_in_range("cpu_threads", cfg.cpu_threads, 1, None)
    tp, ep = parallel_layout(cfg.tensor_parallel_size, cfg.data_parallel_size, cfg.enable_expert_parallel)
    launch = Launch.from_torchrun_env(tp.size * cfg.data_parallel_size) or Launch(
        tp.size * cfg.data_parallel_size, cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port)
    launch.validate()
    if cfg.overlap and launch.world_size > 1:
        raise ValueError(f"overlap: one process only ({launch.world_size} ranks asked for); turn it off for tensor "
                         "or data parallelism")
    cfg = resolve_graph_mode(cfg, device, launch.world_size)
    if launch.world_size > 1:
        check_devices(device.type, launch)
        with torch.device("meta"):   # a shard that does not divide is refused here, before any process starts
            DeepseekV3ForCausalLM(model_config, tp, ep)
    # slots past the last token a step may need: the pending token, k drafts and the lookahead
    return RankSetup(cfg, path, model_config, device.type, dtype, min(cfg.max_model_len or limit, limit),
                     lookahead, k + 1 + lookahead, launch, resolve_quantization(cfg.quantization, model_config))


def resolve_graph_mode(cfg: EngineConfig, device: torch.device, world_size: int) -> EngineConfig:
    """enforce_eager = None (the default) is graph mode wherever it starts at once:

        CUDA                                     graphs captured at start-up       enforce_eager False
        CPU, one process, threads < cores       graphs compiled in the background  + compile_in_background
        CPU, one process on every core; ranks   eager                              enforce_eager True

    The background compiles cold in a compiler process (executor/compile_process.py) that needs a core the steps
    leave free: `serve` leaves one (serving_cpu_threads); `LLM` and `generate` use every core unless cpu_threads
    says otherwise. A compiler process beside steps on every core made them 3-10x slower (docs/history.md)."""
    later_refusal = compile_later_refusal(device.type, world_size)
    if cfg.compile_in_background and (cfg.enforce_eager or later_refusal):
        raise ValueError("compile_in_background: " + (later_refusal or "graph mode only, not with enforce_eager"))
    if cfg.compile_in_background or cfg.enforce_eager is not None:
        return replace(cfg, enforce_eager=not cfg.compile_in_background and cfg.enforce_eager)
    if device.type == "cuda":
        return replace(cfg, enforce_eager=False)
    spare_core = (cfg.cpu_threads or torch.get_num_threads()) < (os.cpu_count() or 1)
    background = later_refusal is None and spare_core
    return replace(cfg, enforce_eager=not background, compile_in_background=background)


def int8_activation_dtype(asked: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Weight-only int8 runs bf16/fp16 activations ("auto": bf16); its kernel is the CPU's (model/int8.py)."""
    if device.type != "cpu":
        raise ValueError(f"quantization = 'int8': CPU only (device = {device.type!r}); use 'fp8' on CUDA")
    if asked == "auto":
        return torch.bfloat16
    if dtype == torch.float32:
        raise ValueError("quantization = 'int8': dtype must be bfloat16 or float16 (PyTorch's int8 weight-only "
                         "kernel has no fast float32 path on the CPU)")
    return dtype


def resolve_quantization(asked: str | None, model_config: ModelConfig) -> str | None:
    """None follows the checkpoint (an FP8 checkpoint stays FP8 in memory, as in vLLM); "none" dequantizes it;
    "fp8" also quantizes an unquantized checkpoint's linear weights as it loads; "int8": weight-only int8."""
    if asked not in (None, "fp8", "int8", "none"):
        raise ValueError(f"quantization = {asked!r}: must be 'fp8', 'int8', 'none' or None (the checkpoint's)")
    if asked is None:
        return "fp8" if model_config.quantization_config else None
    return None if asked == "none" else asked


def engine_config(model: str | None = None, speculative_config: dict | None = None, **kwargs) -> EngineConfig:
    return EngineConfig(model=model, speculative=SpeculativeConfig.from_dict(speculative_config), **kwargs)


def is_front(launch: Launch) -> bool:
    """The process that holds rank 0 (scheduler, server); under torchrun, the one torchrun made rank 0."""
    return int(os.environ.get("RANK", 0)) == 0 if launch.external else launch.node_rank == 0


def run_non_front_ranks(cfg: EngineConfig) -> bool:
    """In a process other than the front (a node after the first, or a torchrun process other than rank 0),
    runs this process's ranks until the front stops them and returns True; in the front, returns False."""
    setup = engine_setup(cfg)
    launch = setup.launch
    if is_front(launch):
        return False
    if launch.external:
        run_rank(setup, int(os.environ["RANK"]))
        return True
    ctx = torch.multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    others = [ctx.Process(target=worker_process, args=(setup, rank, errors)) for rank in launch.local_ranks()[1:]]
    for p in others:
        p.start()
    try:
        run_rank(setup, launch.local_ranks()[0])
    finally:
        end_processes(others, timeout=30)
    return True
