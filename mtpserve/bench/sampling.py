"""`mtpserve bench sampling`: what sampling fields cost, with and without MTP, side by side: the same engines run
the same prompts with no fields, with logprobs (5 top), with penalties (repetition 1.1, frequency and
presence 0.2) and with a JSON schema (structured outputs; such requests stop where the grammar ends),
iterations interleaved round-robin. Per batch size, field set and engine: TPOT, its ratio to the
same engine with no fields, MTP's speedup over no MTP with the same fields, acceptance, and whether the tokens
equal no MTP's (greedy: they must)."""
import contextlib
import time

from mtpserve.bench import common
from mtpserve.bench.latency import build_engine, run_batch
from mtpserve.sampling.grammar import GrammarState

FUNCTION_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "args": {"type": "array", "items": {"type": "string"}}, "returns": {"type": "string"}},
    "required": ["name", "args", "returns"]}
FIELD_SETS = {"none": {}, "logprobs5": {"logprobs": 5},
              "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.2},
              "json_schema": {"structured_outputs": {"json": FUNCTION_SCHEMA}}}


def run_sampling(model: str, k: int, batch_sizes: list[int], input_len: int, output_len: int, num_iters: int,
                 enforce_eager: bool | None, dtype: str = "auto", log=print) -> dict:
    specs = {"no_mtp": None, f"mtp_k{k}": {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}}
    engines = {name: build_engine(model, spec, max(batch_sizes), input_len + output_len, enforce_eager, dtype,
                                  graph_batch_sizes=batch_sizes) for name, spec in specs.items()}
    first = next(iter(engines.values()))
    prompts = common.make_prompts(max(batch_sizes) * num_iters, input_len, first.model_config.vocab_size,
                                  first.tokenizer)
    field_sets = {name: f for name, f in FIELD_SETS.items() if "structured_outputs" not in f or first.tokenizer}
    if len(field_sets) < len(FIELD_SETS):
        log("  (no tokenizer: the json_schema set is left out)")
    for eng in engines.values():
        run_batch(eng, prompts[:2], min(8, output_len), tag="w")
    runs = {}
    with _timed_grammar() as grammar_seconds:
        for it in range(num_iters):
            for bs in batch_sizes:
                for fields_name, fields in field_sets.items():
                    for name, eng in engines.items():
                        before = grammar_seconds[0]
                        r = run_batch(eng, prompts[it * bs:(it + 1) * bs], output_len, f"i{it}b{bs}{fields_name}",
                                      fields=fields)
                        r["grammar_seconds"] = grammar_seconds[0] - before
                        runs.setdefault((bs, fields_name, name), []).append(r)
                        log(f"  iter {it} batch {bs:3d} {fields_name:10s} {name:8s} {r['duration']:.3f}s")
    rows = []
    for bs in batch_sizes:
        for fields_name in field_sets:
            for name in engines:
                rs = runs[(bs, fields_name, name)]
                tpot = common.mean(x["tpot"] for r in rs for x in r["per_request"])
                drafts = sum(r["spec"]["num_draft_tokens"] for r in rs)
                rows.append(dict(batch_size=bs, fields=fields_name, engine=name, tpot_ms=1e3 * tpot,
                                 acceptance_rate=sum(r["spec"]["num_accepted_tokens"] for r in rs) / drafts
                                 if drafts else None,
                                 grammar_ms_per_step=1e3 * sum(r["grammar_seconds"] for r in rs)
                                 / sum(r["num_steps"] for r in rs),
                                 same_tokens_as_no_mtp=[r["tokens"] for r in rs] ==
                                 [r["tokens"] for r in runs[(bs, fields_name, "no_mtp")]]))
    by_key = {(r["batch_size"], r["fields"], r["engine"]): r for r in rows}
    for r in rows:
        r["vs_no_fields"] = r["tpot_ms"] / by_key[(r["batch_size"], "none", r["engine"])]["tpot_ms"]
        r["mtp_speedup"] = by_key[(r["batch_size"], r["fields"], "no_mtp")]["tpot_ms"] / r["tpot_ms"]
    return dict(k=k, fields=field_sets, rows=rows, enforce_eager=enforce_eager)


@contextlib.contextmanager
def _timed_grammar():
    """GrammarState.allowed_after (the host's grammar work: matcher moves and bitmasks) timed while inside; yields
    the running total of its seconds."""
    total, allowed_after = [0.0], GrammarState.allowed_after

    def timed(self, generated):
        start = time.perf_counter()
        try:
            return allowed_after(self, generated)
        finally:
            total[0] += time.perf_counter() - start
    GrammarState.allowed_after = timed
    try:
        yield total
    finally:
        GrammarState.allowed_after = allowed_after


def table(res: dict) -> list[str]:
    out = ["| batch | fields | engine | TPOT ms | TPOT vs no fields | speedup vs no MTP | acceptance | grammar ms/step "
           "| same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        acc = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        out.append(f"| {r['batch_size']} | {r['fields']} | {r['engine']} | {r['tpot_ms']:.2f} | "
                   f"{r['vs_no_fields']:.2f}x | {r['mtp_speedup']:.2f}x | {acc} | {r['grammar_ms_per_step']:.2f} | "
                   f"{r['same_tokens_as_no_mtp']} |")
    return out
