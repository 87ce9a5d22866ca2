"""`mtpserve bench latency`: batch-size x k x scorer sweeps on one model, measured side by side.

Every configuration gets its own engine (same checkpoint, same prompts); the measured iterations are
interleaved round-robin over the configurations so that machine noise hits them all alike. Greedy
(temperature 0), ignore_eos, a fixed output length. Timestamps are taken around LLMEngine.step(): a
request's ITL is the gap between consecutive steps that gave it tokens.
"""
import gc
import time

from mtpserve.bench import common
from mtpserve.sampling_params import SamplingParams


def spec_dict(k: int, scorer: str, base: dict | None, synthetic: float | None, draft_vocab: int = 0) -> dict | None:
    if k == 0:
        return None
    d = dict(base or {"method": "mtp"})
    d.update(num_speculative_tokens=k, scorer=scorer)
    d.setdefault("adaptive", False)   # (a sweep over fixed k)
    if synthetic is not None:
        d.update(synthetic_acceptance=synthetic, allow_lossy_measurement=True)
    if draft_vocab:
        d["draft_vocab_size"] = draft_vocab
    return d


def config_name(k: int, scorer: str, mode: str | None = None, draft_vocab: int = 0, method: str = "mtp") -> str:
    """mode: None when the sweep runs one mode (names as before), else "eager"/"graph" appended."""
    name = "no_mtp" if k == 0 else f"{method}_k{k}_{scorer}" + (f"_dv{draft_vocab}" if draft_vocab else "")
    return name if mode is None else f"{name}_{mode}"


ENGINE_DEFAULTS: dict = {}   # engine keyword arguments every bench engine takes (the bench flags set them)


def build_engine(model: str, spec: dict | None, max_batch: int, max_len: int, enforce_eager: bool, dtype: str,
                 block_size: int = 16, graph_batch_sizes: list[int] | None = None, tensor_parallel_size: int = 1,
                 overlap: bool = False, **extra):
    """extra: more engine keyword arguments (quantization, ...)."""
    from mtpserve.engine.engine import LLMEngine
    k = spec["num_speculative_tokens"] if spec else 0
    blocks = max_batch * (-(-(max_len + k + 1) // block_size)) + 8
    # graph mode: one graph size, the batch (unless told)
    graphs = {} if enforce_eager is not False else {"graph_batch_sizes": graph_batch_sizes or [max_batch]}
    engine = LLMEngine.from_kwargs(model=model, speculative_config=spec, max_num_seqs=max_batch,
                                   max_num_batched_tokens=max(2048, max_batch * max_len), max_model_len=max_len + k + 8,
                                   num_kv_blocks=blocks, block_size=block_size, enforce_eager=enforce_eager, dtype=dtype,
                                   tensor_parallel_size=tensor_parallel_size, overlap=overlap, **graphs,
                                   **{**ENGINE_DEFAULTS, **extra})
    engine.calibrate()
    engine.wait_for_graphs()
    return engine


def run_batch(engine, prompts: list[list[int]], output_len: int, tag: str = "b", temperature: float = 0.0,
              fields: dict | None = None) -> dict:
    """Runs `prompts` as one batch to completion; -> per-request metrics, totals, spec counters, tokens.
    temperature > 0: sampling, request i seeded with i (the same tokens in every engine). fields: more
    SamplingParams fields for every request (logprobs, penalties, ...)."""
    from mtpserve.spec_decode.metrics import SpecDecodeMetrics
    if engine.spec_metrics is not None:
        engine.spec_metrics = SpecDecodeMetrics(engine.spec_metrics.num_speculative_tokens)
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for i, (rid, p) in enumerate(zip(ids, prompts)):
        fields = fields or {}   # (a grammar ends the output itself: no ignore_eos)
        params = SamplingParams(**{"temperature": temperature, "max_tokens": output_len,
                                   "seed": i if temperature > 0 else None,
                                   "ignore_eos": "structured_outputs" not in fields, **fields})
        engine.add_request(rid, None, p, params)
    emissions = {rid: [] for rid in ids}
    tokens, num_steps = {}, 0
    while len(tokens) < len(ids):
        outs = engine.step()
        now = time.perf_counter()
        num_steps += 1
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if not emissions[out.request_id] or emissions[out.request_id][-1][1] < n:
                emissions[out.request_id].append((now, n))
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    end = time.perf_counter()
    per_req = [common.request_metrics(start, emissions[rid]) for rid in ids]
    m = engine.get_metrics()
    return dict(per_request=per_req, duration=end - start, num_steps=num_steps,
                num_output_tokens=sum(r["num_tokens"] for r in per_req),
                spec=common.acceptance_stats(m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"],
                                             m["accepted_per_position"]),
                tokens=[tokens[rid] for rid in ids])


def run_interleaved(engines: dict, batch_sizes: list[int], input_len: int, output_len: int, num_iters: int,
                    temperature: float = 0.0, log=print) -> dict:
    """The same prompts on every engine (a dict name -> engine), after a short warm-up each, iterations
    interleaved round-robin over batch sizes and engines. -> {(batch size, name): [run_batch results]}."""
    first = next(iter(engines.values()))
    prompts = common.make_prompts(max(batch_sizes) * num_iters, input_len, first.model_config.vocab_size,
                                  first.tokenizer)
    for eng in engines.values():
        run_batch(eng, prompts[:2], min(8, output_len), tag="w")
        eng.wait_for_graphs()   # (graphs the warm-up asked for: none timed eagerly, no compiler beside another engine)
    runs = {(bs, name): [] for bs in batch_sizes for name in engines}
    for it in range(num_iters):
        for bs in batch_sizes:
            for name, eng in engines.items():
                r = run_batch(eng, prompts[it * bs:(it + 1) * bs], output_len, tag=f"i{it}b{bs}",
                              temperature=temperature)
                runs[(bs, name)].append(r)
                log(f"  iter {it} batch {bs:3d} {name:22s} {r['duration']:.3f}s")
    return runs


def aggregate(runs: list[dict]) -> dict:
    """Pools the iterations of one configuration."""
    reqs = [r for run in runs for r in run["per_request"]]
    itls = [x for r in reqs for x in r["itls"]]
    spec = [run["spec"] for run in runs]
    drafts = sum(s["num_drafts"] for s in spec)
    per_pos_counts = None
    if drafts:
        width = max(len(s["acceptance_per_position"]) for s in spec)
        per_pos_counts = [sum(s["acceptance_per_position"][i] * s["num_drafts"] for s in spec
                              if i < len(s["acceptance_per_position"])) for i in range(width)]
    acc = common.acceptance_stats(drafts, sum(s["num_draft_tokens"] for s in spec),
                                  sum(s["num_accepted_tokens"] for s in spec), per_pos_counts or [])
    duration = sum(run["duration"] for run in runs)
    out_tokens = sum(run["num_output_tokens"] for run in runs)
    tpot = common.mean(r["tpot"] for r in reqs)
    return dict(itl_ms=common.summarize(itls), tpot_ms=common.summarize([r["tpot"] for r in reqs]),
                ttft_ms=common.summarize([r["ttft"] for r in reqs]), e2e_ms=common.summarize([r["e2e"] for r in reqs]),
                output_tokens_per_s=out_tokens / duration if duration else None,
                decode_tokens_per_s_per_request=1.0 / tpot if tpot else None,
                mean_steps_per_run=common.mean(run["num_steps"] for run in runs), num_iters=len(runs), **acc)


def sweep(model: str, batch_sizes: list[int], ks: list[int], scorers: list[str], input_len: int, output_len: int,
          num_iters: int, enforce_eager: bool | None, dtype: str = "auto", spec_base: dict | None = None,
          synthetic: float | None = None, tokenizer_prompts: bool = True, log=print,
          modes: list[str] | None = None, draft_vocab_sizes: list[int] | None = None) -> dict:
    """-> {"configs": [...], "prompts": ..., "outputs_match_no_mtp": ...}. One engine per (mode, k, scorer,
    draft vocabulary size; 0 = the whole vocabulary); modes ("eager", "graph") given: both run side by side,
    else the one enforce_eager says."""
    from mtpserve.config import SpeculativeConfig
    from mtpserve.engine.engine import LLMEngine
    max_batch = max(batch_sizes)
    mode_list = modes or [None]
    vocabs = draft_vocab_sizes or [0]
    method = SpeculativeConfig.from_dict(spec_base or {}).method
    configs = [(m, k, s, v) for m in mode_list for k in ks for s in (scorers if k else scorers[:1])
               for v in (vocabs if k else [0])]
    engines = {}
    for m, k, s, v in configs:
        eager = enforce_eager if m is None else m == "eager"
        engines[(m, k, s, v)] = build_engine(model, spec_dict(k, s, spec_base, synthetic, v), max_batch,
                                             input_len + output_len, eager, dtype, graph_batch_sizes=batch_sizes)
    any_engine: LLMEngine = next(iter(engines.values()))
    # iteration i runs prompts[i*bs : (i+1)*bs]: small batches see several prompts, every config the same ones
    prompts = common.make_prompts(max_batch * num_iters, input_len, any_engine.model_config.vocab_size,
                                  any_engine.tokenizer if tokenizer_prompts else None)
    for eng in engines.values():   # warm-up: one short batch each
        run_batch(eng, prompts[:2], min(8, output_len), tag="w")
    runs = {(bs, *c): [] for bs in batch_sizes for c in configs}
    for it in range(num_iters):
        for bs in batch_sizes:
            for m, k, s, v in configs:
                r = run_batch(engines[(m, k, s, v)], prompts[it * bs:(it + 1) * bs], output_len, tag=f"i{it}b{bs}")
                runs[(bs, m, k, s, v)].append(r)
                log(f"  iter {it} batch {bs:3d} {config_name(k, s, m, v, method):30s} {r['duration']:.3f}s "
                    f"accept-len {r['spec']['mean_acceptance_length']:.2f}")

    def same_tokens(a, b):
        return all(x == y for r0, r1 in zip(a, b) for x, y in zip(r0["tokens"], r1["tokens"]))

    results = []
    for bs in batch_sizes:
        for m, k, s, v in configs:
            agg = aggregate(runs[(bs, m, k, s, v)])
            row = dict(batch_size=bs, k=k, scorer=s if k else None, name=config_name(k, s, m, v, method), mode=m,
                       method=method if k else None,
                       draft_vocab_size=v or None, graph_build_seconds=engines[(m, k, s, v)].graph_warmup_seconds,
                       **agg)
            if 0 in ks:   # against no MTP in the same mode (graphs may round differently from eager)
                row["greedy_tokens_equal_no_mtp"] = (same_tokens(runs[(bs, m, 0, scorers[0], 0)],
                                                                 runs[(bs, m, k, s, v)]) if synthetic is None else None)
            if m not in (None, mode_list[0]) and synthetic is None:
                row[f"greedy_tokens_equal_{mode_list[0]}"] = same_tokens(runs[(bs, mode_list[0], k, s, v)],
                                                                         runs[(bs, m, k, s, v)])
            results.append(row)
    add_ratios(results)
    first = next(iter(engines.values()))
    mc = first.model_config
    kv_bytes = (mc.num_hidden_layers + mc.num_nextn_predict_layers) * mc.kv_cache_dim * first.dtype.itemsize
    tokens = {bs: [t for r in runs[(bs, *configs[0])] for t in r["tokens"]] for bs in batch_sizes}
    del engines
    gc.collect()
    return dict(configs=results, kv_cache_bytes_per_token=kv_bytes, peak_rss_bytes=common.peak_rss_bytes(),
                prompt_token_ids=prompts, reference_tokens=tokens)


def add_ratios(results: list[dict]) -> None:
    """Speedups against the no-MTP row of the same batch size and mode (TPOT ratio, ITL ratio, tokens/s
    ratio); with two modes also graph over eager for the same configuration (TPOT ratio)."""
    base = {(r["batch_size"], r.get("mode")): r for r in results if r["k"] == 0}
    eager = {(r["batch_size"], r["k"], r["scorer"], r.get("draft_vocab_size")): r for r in results
             if r.get("mode") == "eager"}
    for r in results:
        b = base.get((r["batch_size"], r.get("mode")))
        if b is not None:
            r["tpot_speedup"] = b["tpot_ms"]["mean"] / r["tpot_ms"]["mean"] if r["tpot_ms"]["mean"] else None
            r["itl_ratio_vs_no_mtp"] = r["itl_ms"]["mean"] / b["itl_ms"]["mean"] if b["itl_ms"]["mean"] else None
            r["throughput_speedup"] = r["output_tokens_per_s"] / b["output_tokens_per_s"]
        e = eager.get((r["batch_size"], r["k"], r["scorer"], r.get("draft_vocab_size")))
        if r.get("mode") == "graph" and e is not None:
            r["graph_tpot_speedup_vs_eager"] = e["tpot_ms"]["mean"] / r["tpot_ms"]["mean"]
            e0 = base.get((r["batch_size"], "eager"))
            if r["k"] and e0 is not None:   # vllm-ascend's "acceleration": eager no-MTP TPOT over this TPOT
                r["tpot_speedup_vs_eager_no_mtp"] = e0["tpot_ms"]["mean"] / r["tpot_ms"]["mean"]


def print_table(results: list[dict]) -> None:
    print(f"{'batch':>5} {'config':24} {'ITL ms':>9} {'TPOT ms':>9} {'tok/s':>9} {'acc rate':>8} {'acc len':>7} "
          f"{'speedup':>7}  per-position")
    for r in results:
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        sp = f"{r.get('tpot_speedup'):.2f}x" if r.get("tpot_speedup") else "-"
        pos = ",".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        print(f"{r['batch_size']:5d} {r['name']:24} {r['itl_ms']['mean']:9.2f} {r['tpot_ms']['mean']:9.2f} "
              f"{r['output_tokens_per_s']:9.1f} {acc:>8} {r['mean_acceptance_length']:7.2f} {sp:>7}  {pos}")
