"""`mtpserve bench overlap`: the engine with overlap (each step on a model thread while the engine finishes the
step before: detokenisation, stop checks, outputs) against the same engine without it, side by side: one engine
per (mode, k, overlap), the same prompts, iterations interleaved round-robin.

Per batch size and configuration: TPOT, output tokens/s, and the ratio of overlap on to off (TPOT off / on:
above 1 means overlap pays); the tokens must equal those without overlap."""
from mtpserve.bench import common
from mtpserve.bench.latency import build_engine, run_interleaved


def run_overlap(model: str, ks: list[int], batch_sizes: list[int], modes: list[str], input_len: int,
                output_len: int, num_iters: int, dtype: str = "auto", log=print) -> dict:
    configs = [(m, k, o) for m in modes for k in ks for o in (False, True)]
    max_batch = max(batch_sizes)
    engines = {c: build_engine(model, {"method": "mtp", "num_speculative_tokens": c[1], "adaptive": False}
                               if c[1] else None, max_batch,
                               input_len + output_len, c[0] == "eager", dtype, graph_batch_sizes=batch_sizes,
                               overlap=c[2]) for c in configs}
    by_name = run_interleaved({name(c): eng for c, eng in engines.items()}, batch_sizes, input_len, output_len,
                              num_iters, log=log)
    runs = {(bs, c): by_name[(bs, name(c))] for bs in batch_sizes for c in configs}
    rows = []
    for bs in batch_sizes:
        for c in configs:
            rs = runs[(bs, c)]
            tpots = [x["tpot"] for r in rs for x in r["per_request"] if x["tpot"] is not None]
            off = runs[(bs, (c[0], c[1], False))]
            tokens_per_s = sum(r["num_output_tokens"] for r in rs) / sum(r["duration"] for r in rs)
            rows.append(dict(batch_size=bs, name=name(c), mode=c[0], k=c[1], overlap=c[2],
                             tpot_ms=1e3 * common.mean(tpots), output_tokens_per_s=tokens_per_s,
                             same_tokens_as_without_overlap=[r["tokens"] for r in rs] == [r["tokens"] for r in off]))
    by_config = {(r["batch_size"], r["mode"], r["k"], r["overlap"]): r for r in rows}
    for r in rows:
        off = by_config[(r["batch_size"], r["mode"], r["k"], False)]
        r["tpot_ratio_off_over_on"] = off["tpot_ms"] / r["tpot_ms"]
    for eng in engines.values():
        eng.shutdown()
    return dict(rows=rows)


def name(config) -> str:
    mode, k, overlap = config
    return f"{mode}_{'no_mtp' if k == 0 else f'mtp_k{k}'}_{'overlap' if overlap else 'serial'}"


def table(res: dict) -> list[str]:
    out = ["| batch | config | TPOT ms | output tok/s | TPOT without overlap / with | same tokens |",
           "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['batch_size']} | {r['name']} | {r['tpot_ms']:.2f} | {r['output_tokens_per_s']:.1f} | "
                   f"{r['tpot_ratio_off_over_on']:.3f} | {r['same_tokens_as_without_overlap']} |")
    return out
