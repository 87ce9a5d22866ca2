"""`mtpserve bench roofline`: the memory-bandwidth floor of a batch-1 decode step (bytes of weights + KV read
per step / measured memory bandwidth) against the measured step time, plain and verifying k drafts."""
import os
import time

import torch

from mtpserve.bench import common, latency

# ~300M parameters, dense (every weight is read every decode step), one MTP layer
ROOFLINE_SIZES = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16, q_lora_rank=512, kv_lora_rank=256,
                      qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=None,
                      n_shared_experts=None, num_experts_per_tok=None, first_k_dense_replace=16,
                      max_position_embeddings=1024, num_nextn_predict_layers=1)


BUFFER_MB = (4, 16, 64, 256, 1024)


def measure_bandwidth(sizes_mb: tuple = BUFFER_MB, repeats: int = 7) -> dict:
    """Read bandwidth per buffer size (best of `repeats` sums over one fp32 buffer, read again and again as
    decode steps read their weights) and the best of them, the peak a roofline's floor assumes: a buffer that
    fits the CPU's cache reads faster than one from memory."""
    by_size = {}
    for mb in sizes_mb:
        x = torch.ones(mb << 18, dtype=torch.float32)
        x.sum()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        by_size[mb] = x.numel() * 4 / best / 1e9
    return dict(read_gb_per_s_by_mb=by_size, read_gb_per_s=max(by_size.values()))


def floor_bandwidth(bw: dict, nbytes: int) -> float:
    """The read bandwidth a step of `nbytes` gets at best: that of the smallest buffer holding them (the largest
    buffer's if none does). 23 MB a step, buffers of 4, 16, 64 MB -> the 64 MB read's: a step's weights are read
    once each, so the cache holds them only as far as it is larger than they are."""
    by_mb = {int(mb): gbps for mb, gbps in bw["read_gb_per_s_by_mb"].items()}
    holding = [mb for mb in by_mb if mb << 20 >= nbytes]
    return by_mb[min(holding) if holding else max(by_mb)]


def by_size(bw: dict) -> str:
    """measure_bandwidth's figures as text: '29.8 GB/s at 4 MB, ..., 16.6 GB/s at 1024 MB'."""
    return ", ".join(f"{v:.1f} GB/s at {mb} MB" for mb, v in bw["read_gb_per_s_by_mb"].items())


def step_weight_params(cfg, k: int) -> int:
    """Weights a batch-1 decode step reads: the main model over 1+k tokens (a MoE layer's routed experts for
    1+k tokens counted as min(n_routed, (1+k) * top_k), an upper bound), the head once, and with k drafts the
    MTP passes that draft them: the first over the 1+k positions, k-1 more over one token each, each pass one
    MTP layer (its input projection and decoder layer) and the head again. Embedding rows are left out.
        k = 1, top-2 of 8 experts: main 12 layers with <= 4 experts each + head; MTP layer with <= 4 + head"""
    w = active_weights_per_token(cfg)
    expert = 3 * cfg.hidden_size * (cfg.moe_intermediate_size or 0)
    def extra(tokens: int) -> int:   # the routed experts `tokens` tokens read beyond one token's
        return 0 if not cfg.n_routed_experts else expert * (
            min(cfg.n_routed_experts, tokens * cfg.num_experts_per_tok) - cfg.num_experts_per_tok)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    total = w["layers"] + moe_layers * extra(1 + k) + w["head"]
    if k:
        mtp_layer = w["layers"] // cfg.num_hidden_layers if not cfg.n_routed_experts else \
            w["moe_layer"] + 2 * cfg.hidden_size * cfg.hidden_size
        total += k * (mtp_layer + w["head"]) + extra(1 + k)
    return total


def step_bytes(cfg, k: int, bytes_per_weight: float, bytes_per_kv_value: int, context_len: float) -> dict:
    weights = step_weight_params(cfg, k) * bytes_per_weight
    kv = (cfg.num_hidden_layers + (1 if k else 0)) * cfg.kv_cache_dim * bytes_per_kv_value * context_len
    return dict(weight_bytes=weights, kv_bytes=kv, total_bytes=weights + kv)


def run_roofline(model_path: str | None, input_len: int, output_len: int, num_iters: int, scratch: str,
                 enforce_eager: bool = True, dtype: str = "float32", quantization: str | None = None,
                 ks: tuple = (0, 1), max_create_s: float = 60.0, log=print) -> dict:
    """Per k: the bytes a batch-1 step reads over the measured read bandwidth (the floor) against the measured
    step (the median gap between steps), engines side by side. model_path None: a random ~300M dense model."""
    notes = []
    if model_path is None:
        model_path = os.path.join(scratch, "roofline_model")
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            from mtpserve.model.checkpoint import write_random_checkpoint
            t = time.perf_counter()
            write_random_checkpoint(model_path, seed=0, **ROOFLINE_SIZES)
            took = time.perf_counter() - t
            notes.append(f"random checkpoint written in {took:.1f}s")
            if took > max_create_s:
                notes.append(f"creation took over {max_create_s:.0f}s")
    bw = measure_bandwidth()
    log(f"  read bandwidth: {bw['read_gb_per_s']:.1f} GB/s at best ({by_size(bw)})")
    extra = {"quantization": quantization} if quantization else {}
    engines = {f"k={k}": latency.build_engine(model_path, latency.spec_dict(k, "mqa", None, None), 1,
                                              input_len + output_len, enforce_eager, dtype, **extra) for k in ks}
    runs = latency.run_interleaved(engines, [1], input_len, output_len, num_iters, log=log)
    first = next(iter(engines.values()))
    bytes_per_weight = 1 if quantization == "int8" else first.dtype.itemsize
    rows = []
    for k, (name, eng) in zip(ks, engines.items()):
        agg = latency.aggregate(runs[(1, name)])
        step_s = agg["itl_ms"]["median"] / 1e3
        nbytes = step_bytes(eng.model.config, k, bytes_per_weight, eng.dtype.itemsize, input_len + output_len / 2)
        read_gb_per_s = floor_bandwidth(bw, nbytes["total_bytes"])
        floor_s = nbytes["total_bytes"] / (read_gb_per_s * 1e9)
        rows.append(dict(k=k, bytes_per_step=nbytes, floor_read_gb_per_s=read_gb_per_s,
                         bandwidth_floor_step_ms=floor_s * 1e3,
                         measured_step_ms_median=step_s * 1e3, fraction_of_roofline=floor_s / step_s,
                         tokens_per_step=agg["mean_acceptance_length"]))
        log(f"  k={k}: floor {floor_s * 1e3:.2f} ms/step, measured {step_s * 1e3:.2f} ms/step "
            f"({100 * floor_s / step_s:.0f}% of the bandwidth roofline)")
        eng.shutdown()
    return dict(model=common.model_info(model_path), dtype=str(first.dtype).removeprefix("torch."),
                quantization=quantization, mode="eager" if enforce_eager else "graph",
                bandwidth=bw, rows=rows, notes=notes)


def table(res: dict) -> list[str]:
    lines = [f"Batch 1, {res['mode']}, {res['quantization'] or res['dtype']} weights. Read bandwidth, the best of 7 "
             f"sums over one buffer read again and again: {by_size(res['bandwidth'])}. The floor reads a step's bytes "
             "at the bandwidth of the smallest buffer holding them (runs before 2026-12-07: the best of all).", "",
             "| k | MB read per step (weights + KV) | floor GB/s | floor ms | measured ms (median step) "
             "| share of the floor reached | tokens per step |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        b = r["bytes_per_step"]
        read = r.get("floor_read_gb_per_s", res["bandwidth"]["read_gb_per_s"])
        lines.append(f"| {r['k']} | {b['weight_bytes'] / 1e6:.1f} + {b['kv_bytes'] / 1e6:.2f} | {read:.1f} | "
                     f"{r['bandwidth_floor_step_ms']:.2f} | {r['measured_step_ms_median']:.2f} | "
                     f"{100 * r['fraction_of_roofline']:.0f}% | {r['tokens_per_step']:.2f} |")
    return lines


def measure_gemm_flops(repeats: int = 5) -> dict:
    """Best fp32 GEMM rate of this machine at the current thread count: the best of a few large products
    (one a prefill-sized projection of a small model, one square), best of `repeats` each."""
    best = 0.0
    for m, k, n in ((2048, 256, 1536), (1024, 1024, 1024)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        for _ in range(repeats):
            t = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * m * k * n / (time.perf_counter() - t))
    return dict(gemm_gflops=best / 1e9, threads=torch.get_num_threads())


def active_weights_per_token(cfg) -> dict:
    """Weights one token multiplies through the main model (each layer's attention projections; a dense MLP,
    or a MoE layer's gate, shared experts and top-k routed experts), and the output head, which multiplies
    only the tokens that are sampled."""
    heads = cfg.num_attention_heads
    if cfg.q_lora_rank:
        q = cfg.hidden_size * cfg.q_lora_rank + cfg.q_lora_rank * heads * cfg.qk_head_dim
    else:
        q = cfg.hidden_size * heads * cfg.qk_head_dim
    attention = (q + cfg.hidden_size * cfg.kv_cache_dim
                 + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                 + heads * cfg.v_head_dim * cfg.hidden_size)
    moe_layer = attention
    if cfg.n_routed_experts:
        experts = (cfg.n_shared_experts or 0) + cfg.num_experts_per_tok
        moe_layer += cfg.n_routed_experts * cfg.hidden_size + 3 * cfg.hidden_size * cfg.moe_intermediate_size * experts
    layers = sum(moe_layer if cfg.is_moe_layer(i) else attention + 3 * cfg.hidden_size * cfg.intermediate_size
                 for i in range(cfg.num_hidden_layers))
    return dict(layers=layers, head=cfg.vocab_size * cfg.hidden_size, moe_layer=moe_layer)


def compute_floor(cfg, batch: int, input_len: int, output_len: int, gemm_gflops: float) -> dict:
    """A lower bound on the time of a batched greedy generate without speculation: the weight GEMM FLOPs of
    every prompt and generated token (2 per multiply-add; the last generated token is never fed back), the
    head only for sampled tokens, at the machine's best GEMM rate. Attention scores, norms, routing and all
    per-op costs are left out, so no implementation can beat it."""
    w = active_weights_per_token(cfg)
    fed = batch * (input_len + output_len - 1)
    flops = 2 * (fed * w["layers"] + batch * output_len * w["head"])
    seconds = flops / (gemm_gflops * 1e9)
    return dict(batch_size=batch, tokens_through_layers=fed, weight_flops=flops, gemm_gflops=gemm_gflops,
                floor_seconds=seconds, max_output_tokens_per_s=batch * output_len / seconds)
