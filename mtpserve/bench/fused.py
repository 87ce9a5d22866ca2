"""`mtpserve bench fused`: the fused speculative step (spec_decode/fused.py) against the separate path and against
no speculation, side by side, in graph mode (or eagerly, --enforce-eager: the same function uncompiled against
the eager separate path): the engines run the same prompts, iterations interleaved round-robin.

Per batch size and configuration: TPOT (ms per output token, decode only), ms per engine step, tokens per step
(1 + accepted drafts), speedup over no MTP, and whether the tokens equal no MTP's (greedy, or sampling with a seed
per request: the same tokens with and without speculation)."""
from mtpserve.bench import common
from mtpserve.bench.latency import build_engine, run_interleaved


def run_fused(model: str, ks: list[int], batch_sizes: list[int], input_len: int, output_len: int, num_iters: int,
              dtype: str = "auto", temperature: float = 0.0, base_spec: dict | None = None, log=print,
              enforce_eager: bool = False) -> dict:
    """base_spec: further speculative_config fields for every MTP engine (e.g. a draft vocabulary)."""
    specs = {"no_mtp": None}
    for k in ks:
        spec = {"adaptive": False, **(base_spec or {}), "method": "mtp", "num_speculative_tokens": k}
        specs[f"k{k}_separate"] = {**spec, "fused_graph_step": False}
        specs[f"k{k}_fused"] = spec
    max_batch = max(batch_sizes)
    engines = {name: build_engine(model, spec, max_batch, input_len + output_len, enforce_eager, dtype,
                                  graph_batch_sizes=batch_sizes) for name, spec in specs.items()}
    runs = run_interleaved(engines, batch_sizes, input_len, output_len, num_iters, temperature, log)
    rows = []
    for bs in batch_sizes:
        base = None
        for name in engines:
            rs = runs[(bs, name)]
            tpots = [x["tpot"] for r in rs for x in r["per_request"] if x["tpot"] is not None]
            decode_steps = sum(r["num_steps"] for r in rs) - len(rs)    # less each run's prefill step
            decode_tokens = sum(r["num_output_tokens"] for r in rs) - bs * len(rs)
            decode_s = sum(r["duration"] for r in rs) - sum(x["ttft"] for r in rs for x in r["per_request"]) / bs
            row = dict(batch_size=bs, name=name, tpot_ms=1e3 * common.mean(tpots), step_ms=1e3 * decode_s / decode_steps,
                       tokens_per_step=decode_tokens / decode_steps / bs,
                       same_tokens_as_no_mtp=[r["tokens"] for r in rs] == [r["tokens"] for r in runs[(bs, "no_mtp")]],
                       graph_build_seconds=engines[name].graph_warmup_seconds)
            base = base or row
            row["tpot_speedup"] = base["tpot_ms"] / row["tpot_ms"]
            rows.append(row)
    return dict(configs=list(engines), rows=rows, temperature=temperature)


def table(res: dict) -> list[str]:
    out = ["| batch | config | TPOT ms | ms per step | tokens per step | TPOT speedup vs no MTP | same tokens | "
           "graph build s |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['batch_size']} | {r['name']} | {r['tpot_ms']:.2f} | {r['step_ms']:.2f} | "
                   f"{r['tokens_per_step']:.2f} | {r['tpot_speedup']:.2f}x | {r['same_tokens_as_no_mtp']} | "
                   f"{r['graph_build_seconds']:.0f} |")
    return out
