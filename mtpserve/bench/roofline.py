"""`mtpserve bench roofline`: the memory-bandwidth floor of a batch-1 decode step (bytes of weights + KV read
per step / measured memory bandwidth) against the measured step time, on a random dense checkpoint."""
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


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Best-of-`repeats` read bandwidth (sum over a large fp32 tensor) and copy bandwidth (read + write)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    best_sum = best_copy = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best_sum = min(best_sum, time.perf_counter() - t)
        t = time.perf_counter()
        y.copy_(x)
        best_copy = min(best_copy, time.perf_counter() - t)
    return dict(bytes=num_bytes, read_gb_per_s=num_bytes / best_sum / 1e9, copy_gb_per_s=2 * num_bytes / best_copy / 1e9)


def bytes_per_decode_step(model, context_len: float, dtype_bytes: int) -> dict:
    """Weights a batch-1 decode step of the main model reads (the embedding table contributes one row; the
    MTP layers are not run without speculation) plus the KV cache read by attention."""
    cfg = model.config
    weights = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp_layers."):
            continue
        weights += cfg.hidden_size * p.element_size() if name.endswith("embed_tokens.weight") else p.numel() * p.element_size()
    kv = cfg.num_hidden_layers * cfg.kv_cache_dim * dtype_bytes * context_len
    return dict(weight_bytes=weights, kv_bytes=kv, total_bytes=weights + kv)


def run_roofline(model_path: str | None, input_len: int, output_len: int, num_iters: int, scratch: str,
                 max_create_s: float = 60.0, log=print) -> dict:
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
    log(f"  memory bandwidth: read {bw['read_gb_per_s']:.1f} GB/s, copy {bw['copy_gb_per_s']:.1f} GB/s")
    eng = latency.build_engine(model_path, None, 1, input_len + output_len, True, "float32")
    prompts = common.make_prompts(1, input_len, eng.model_config.vocab_size, None)
    latency.run_batch(eng, prompts, 4, tag="w")
    runs = [latency.run_batch(eng, prompts, output_len, tag=f"r{i}") for i in range(num_iters)]
    itls = sorted(x for r in runs for x in r["per_request"][0]["itls"])
    step_s = itls[len(itls) // 2]
    nbytes = bytes_per_decode_step(eng.model, input_len + output_len / 2, eng.dtype.itemsize)
    floor_s = nbytes["total_bytes"] / (bw["read_gb_per_s"] * 1e9)
    params = sum(p.numel() for n, p in eng.model.named_parameters() if not n.startswith("mtp_layers."))
    res = dict(model=common.model_info(model_path), main_model_params=params, dtype="float32", bandwidth=bw,
               bytes_per_step=nbytes, bandwidth_floor_step_ms=floor_s * 1e3, measured_step_ms_median=step_s * 1e3,
               measured_step_ms_min=itls[0] * 1e3, fraction_of_roofline=floor_s / step_s, notes=notes)
    log(f"  {params / 1e6:.0f}M params: floor {floor_s * 1e3:.1f} ms/step, measured {step_s * 1e3:.1f} ms/step "
        f"({100 * floor_s / step_s:.0f}% of the bandwidth roofline)")
    return res


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
    layers = 0
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            experts = (cfg.n_shared_experts or 0) + cfg.num_experts_per_tok
            layers += attention + cfg.n_routed_experts * cfg.hidden_size + 3 * cfg.hidden_size * cfg.moe_intermediate_size * experts
        else:
            layers += attention + 3 * cfg.hidden_size * cfg.intermediate_size
    return dict(layers=layers, head=cfg.vocab_size * cfg.hidden_size)


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
