"""`mtpserve bench throughput` (many prompts offline: tokens/s, requests/s) and `mtpserve bench peers` (our
engine against transformers generate on the same checkpoint and prompts)."""
import time

from mtpserve.bench import common, latency, peers, roofline


def run_throughput(model: str, spec: dict | None, num_prompts: int, input_len: int, output_len: int,
                   max_num_seqs: int, enforce_eager: bool, dtype: str = "auto", tensor_parallel_size: int = 1) -> dict:
    eng = latency.build_engine(model, spec, max_num_seqs, input_len + output_len, enforce_eager, dtype,
                               tensor_parallel_size=tensor_parallel_size)
    try:
        prompts = common.make_prompts(num_prompts, input_len, eng.model_config.vocab_size, eng.tokenizer)
        latency.run_batch(eng, prompts[:2], min(8, output_len), tag="w")
        start = time.perf_counter()
        r = latency.run_batch(eng, prompts, output_len, tag="t")
        elapsed = time.perf_counter() - start
    finally:
        eng.shutdown()
    n_out = r["num_output_tokens"]
    mc = eng.model_config
    kv_per_token = (mc.num_hidden_layers + mc.num_nextn_predict_layers) * mc.kv_cache_dim * eng.dtype.itemsize
    kv_alloc = sum(t.numel() * t.element_size() for t in eng.runner.kv_caches)
    weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    return dict(tensor_parallel_size=tensor_parallel_size, kv_cache_bytes_per_token=kv_per_token, kv_cache_allocated_bytes=kv_alloc, weight_bytes=weights,
                num_prompts=num_prompts, elapsed_s=elapsed, requests_per_s=num_prompts / elapsed,
                output_tokens_per_s=n_out / elapsed, total_tokens_per_s=(n_out + num_prompts * input_len) / elapsed,
                num_output_tokens=n_out, spec=r["spec"], peak_rss_bytes=common.peak_rss_bytes())


def base_dtype(name: str):
    """Our --dtype name as a torch dtype for transformers (as ours resolves it on the CPU)."""
    from mtpserve.engine.setup import resolve_device_dtype
    return resolve_device_dtype("cpu", name)[1]


def run_peer_comparison(model: str, k: int, input_len: int, output_len: int, batch: int, num_single: int,
                        enforce_eager: bool, with_mtp: bool = True, log=print, dtype: str = "float32") -> dict:
    """Our engine (no MTP and MTP k) at batch 1, one prompt at a time, and at `batch` at once, then
    transformers on the same prompts; ratios and greedy-token equality."""
    sizes = sorted({1, batch})
    base = latency.build_engine(model, None, batch, input_len + output_len, enforce_eager, dtype, graph_batch_sizes=sizes)
    prompts = common.make_prompts(max(batch, num_single), input_len, base.model_config.vocab_size, base.tokenizer)
    ours = {}
    engines = {"ours_no_mtp": base}
    if k:
        engines[f"ours_mtp_k{k}"] = latency.build_engine(model, latency.spec_dict(k, "mqa", None, None), batch,
                                                         input_len + output_len, enforce_eager, dtype,
                                                         graph_batch_sizes=sizes)
    tokens = {}
    for name, eng in engines.items():
        latency.run_batch(eng, prompts[:2], min(8, output_len), tag="w")
        t1, toks1, drafts = 0.0, [], []
        for i, p in enumerate(prompts[:num_single]):
            r = latency.run_batch(eng, [p], output_len, tag=f"s{i}")
            t1 += r["duration"]
            toks1.append(r["tokens"][0])
            drafts.append(r["spec"]["mean_acceptance_length"])
        rb = latency.run_batch(eng, prompts[:batch], output_len, tag="b")
        n1 = sum(len(t) for t in toks1)
        ours[name] = {"batch1": dict(output_tokens=n1, seconds=t1, tokens_per_s=n1 / t1,
                                     mean_acceptance_length=common.mean(drafts)),
                      f"batch{batch}": dict(output_tokens=rb["num_output_tokens"], seconds=rb["duration"],
                                            tokens_per_s=rb["num_output_tokens"] / rb["duration"])}
        tokens[name] = (toks1, rb["tokens"])
        log(f"  {name}: batch 1 {n1 / t1:.1f} tok/s, batch {batch} {ours[name][f'batch{batch}']['tokens_per_s']:.1f}"
            " tok/s")
    model_config = base.model_config
    del engines, base
    ref1, refb = tokens["ours_no_mtp"]
    hf = peers.run_peers(model, prompts, output_len, batch, num_single, ref1, refb, with_mtp=with_mtp, log=log,
                         dtype=base_dtype(dtype))
    ratios = {}
    for name in ours:
        ratios[f"{name}_batch1_vs_hf_batch1"] = ours[name]["batch1"]["tokens_per_s"] / hf["hf_generate_batch1"][
            "tokens_per_s"]
        if f"hf_generate_batch{batch}" in hf:
            ratios[f"{name}_batch{batch}_vs_hf_batch{batch}"] = (ours[name][f"batch{batch}"]["tokens_per_s"]
                                                                 / hf[f"hf_generate_batch{batch}"]["tokens_per_s"])
        mtp_hf = hf.get("hf_generate_use_mtp_batch1", {})
        if "tokens_per_s" in mtp_hf:
            ratios[f"{name}_batch1_vs_hf_use_mtp_batch1"] = ours[name]["batch1"]["tokens_per_s"] / mtp_hf["tokens_per_s"]
    floor = None
    hf_batch = hf.get(f"hf_generate_batch{batch}")
    if hf_batch:   # how far from the compute floor both are at the big batch
        floor = roofline.compute_floor(model_config, batch, input_len, output_len,
                                       roofline.measure_gemm_flops()["gemm_gflops"])
        floor.update(max_ratio_vs_hf=floor["max_output_tokens_per_s"] / hf_batch["tokens_per_s"],
                     ours_no_mtp_fraction_of_floor=floor["floor_seconds"] / ours["ours_no_mtp"][f"batch{batch}"]["seconds"],
                     hf_fraction_of_floor=floor["floor_seconds"] / hf_batch["seconds"])
        log(f"  compute floor at batch {batch}: {floor['max_output_tokens_per_s']:.0f} tok/s at most "
            f"({floor['gemm_gflops']:.0f} GFLOP/s GEMMs) = {floor['max_ratio_vs_hf']:.2f}x transformers")
    equal_mtp = None
    if k:
        t1, tb = tokens[f"ours_mtp_k{k}"]
        equal_mtp = dict(batch1=t1 == ref1, batch=tb == refb)
    return dict(ours=ours, transformers=hf, ratios=ratios, ours_mtp_tokens_equal_ours_no_mtp=equal_mtp,
                compute_floor=floor, batch_size=batch, num_single=num_single, input_len=input_len, output_len=output_len,
                dtype=str(base_dtype(dtype)).removeprefix("torch."), peak_rss_bytes=common.peak_rss_bytes())
