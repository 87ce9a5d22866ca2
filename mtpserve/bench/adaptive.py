"""`mtpserve bench adaptive`: adaptive speculation length against every fixed k (and no speculation), batch
size by batch size, side by side: the engines run the same prompts, their iterations interleaved round-robin
(--lockstep: their steps, run_lockstep).

For each batch size: output tokens/s of no_mtp, mtp k=1..K, adaptive(max K); the ratios adaptive / no_mtp and
adaptive / best fixed configuration; the k the adaptive engine drafted, step by step (a histogram)."""
import statistics
import time

from mtpserve.bench import common
from mtpserve.bench.latency import build_engine, run_batch


def run_lockstep(engines: dict, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    """The same batch on every engine, the engines stepping in turns (one step each, round-robin) until all are
    done; each engine's duration is the sum of its own steps (and request adds). A slow second of a shared machine
    then hits every engine alike: whole runs back to back differed by up to 30% for the same work here.
    -> {name: dict(duration, num_output_tokens, spec, tokens)}, greedy, ignore_eos."""
    from mtpserve.sampling_params import SamplingParams
    from mtpserve.spec_decode.metrics import SpecDecodeMetrics
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    seconds, tokens = {}, {name: {} for name in engines}
    for name, eng in engines.items():
        if eng.spec_metrics is not None:
            eng.spec_metrics = SpecDecodeMetrics(eng.spec_metrics.num_speculative_tokens)
        start = time.perf_counter()
        for rid, prompt in zip(ids, prompts):
            eng.add_request(rid, None, prompt, params)
        seconds[name] = time.perf_counter() - start
    running = list(engines)
    while running:
        for name in list(running):
            start = time.perf_counter()
            outs = engines[name].step()
            seconds[name] += time.perf_counter() - start
            tokens[name].update((o.request_id, list(o.outputs[0].token_ids)) for o in outs if o.finished)
            if not engines[name].has_unfinished_requests():
                running.remove(name)
    out = {}
    for name, eng in engines.items():
        m = eng.get_metrics()
        out[name] = dict(duration=seconds[name], tokens=[tokens[name][rid] for rid in ids],
                         num_output_tokens=sum(len(tokens[name][rid]) for rid in ids),
                         spec=common.acceptance_stats(m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"],
                                                      m["accepted_per_position"]))
    return out


def run_adaptive(model: str, max_k: int, batch_sizes: list[int], input_len: int, output_len: int, num_iters: int,
                 enforce_eager: bool | None, dtype: str = "auto", log=print, lockstep: bool = False) -> dict:
    """lockstep: the engines step in turns over each batch (run_lockstep); else each runs it whole, back to back."""
    max_batch = max(batch_sizes)
    specs = {"no_mtp": None}
    specs.update({f"mtp_k{k}": {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}
                  for k in range(1, max_k + 1)})
    specs[f"adaptive_k{max_k}"] = {"method": "mtp", "num_speculative_tokens": max_k, "adaptive": True}
    engines = {name: build_engine(model, spec, max_batch, input_len + output_len, enforce_eager, dtype,
                                  graph_batch_sizes=batch_sizes) for name, spec in specs.items()}
    adaptive = engines[f"adaptive_k{max_k}"]
    any_engine = engines["no_mtp"]
    prompts = common.make_prompts(max_batch * num_iters, input_len, any_engine.model_config.vocab_size,
                                  any_engine.tokenizer)
    for eng in engines.values():
        run_batch(eng, prompts[:2], min(8, output_len), tag="w")
    rates = {(bs, name): [] for bs in batch_sizes for name in engines}
    tokens = {(bs, name): [] for bs in batch_sizes for name in engines}
    lengths = {(bs, name): [] for bs in batch_sizes for name in engines}   # mean acceptance length per run
    chosen = {bs: [0] * (max_k + 1) for bs in batch_sizes}
    for it in range(num_iters):
        for bs in batch_sizes:
            batch, tag = prompts[it * bs:(it + 1) * bs], f"i{it}b{bs}"
            before = list(adaptive.policy.choices)
            runs = run_lockstep(engines, batch, output_len, tag) if lockstep else {
                name: run_batch(eng, batch, output_len, tag=tag) for name, eng in engines.items()}
            chosen[bs] = [c + n - b for c, n, b in zip(chosen[bs], adaptive.policy.choices, before)]
            for name, r in runs.items():
                rates[(bs, name)].append((r["num_output_tokens"], r["duration"]))
                tokens[(bs, name)].append(r["tokens"])
                lengths[(bs, name)].append(r["spec"]["mean_acceptance_length"])
                log(f"  iter {it} batch {bs:3d} {name:14s} {r['duration']:.3f}s")
    rows = []
    for bs in batch_sizes:
        tps = {name: sum(n for n, _ in rates[(bs, name)]) / sum(d for _, d in rates[(bs, name)]) for name in engines}
        fixed = {name: v for name, v in tps.items() if not name.startswith("adaptive")}
        best = max(fixed, key=fixed.get)
        ada = tps[f"adaptive_k{max_k}"]
        # per iteration (the engines ran it back to back): robust to a slow minute of a shared machine
        per_iter = {name: [n / d for n, d in rates[(bs, name)]] for name in engines}

        def ratio(a, b):
            return statistics.median(x / y for x, y in zip(per_iter[a], per_iter[b]))
        rows.append(dict(batch_size=bs, tokens_per_s=tps, best_fixed=best, adaptive_vs_no_mtp=ada / tps["no_mtp"],
                         adaptive_vs_best_fixed=ada / fixed[best], adaptive_k_steps=chosen[bs],
                         median_iteration_ratio_vs_no_mtp=ratio(f"adaptive_k{max_k}", "no_mtp"),
                         median_iteration_ratio_vs_best_fixed=ratio(f"adaptive_k{max_k}", best),
                         mean_acceptance_length={n: common.mean(lengths[(bs, n)]) for n in engines},
                         outputs_match_no_mtp=all(tokens[(bs, n)] == tokens[(bs, "no_mtp")] for n in engines)))
    return dict(configs=list(engines), rows=rows, final_acceptance_by_position=adaptive.policy.acceptance(),
                calibrated_step_ms={k: {b: round(s * 1e3, 3) for b, s in sorted(t.items())}
                                    for k, t in sorted(adaptive.policy.table.items())})


def table(res: dict) -> list[str]:
    names = res["configs"]
    out = ["| batch | " + " | ".join(names) + " | adaptive / no_mtp | adaptive / best fixed | median of iterations' "
           "ratios: vs no_mtp, vs best fixed | adaptive: steps per k | same tokens |", "|" + "---|" * (len(names) + 6)]
    for r in res["rows"]:
        out.append(f"| {r['batch_size']} | " + " | ".join(f"{r['tokens_per_s'][n]:.1f}" for n in names) +
                   f" | {r['adaptive_vs_no_mtp']:.2f}x | {r['adaptive_vs_best_fixed']:.2f}x ({r['best_fixed']}) | "
                   f"{r['median_iteration_ratio_vs_no_mtp']:.2f}x, {r['median_iteration_ratio_vs_best_fixed']:.2f}x | "
                   f"{r['adaptive_k_steps']} | {r['outputs_match_no_mtp']} |")
    return out
