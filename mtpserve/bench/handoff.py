"""`mtpserve bench handoff`: a decode engine taking requests in and running their first step, scheme 2 (the
import runs the MTP pass at the last prompt position; a first step of one token each, no drafts) against
scheme 1 (the import copies KV only; a first step verifying real drafts, the fused 1+k step). In-process engines
on the same weights (the transfer itself is timed by scripts/bench_disagg.sh)."""
import time

from mtpserve.bench import common
from mtpserve.bench.latency import ENGINE_DEFAULTS
from mtpserve.disagg.handoff import import_handoff
from mtpserve.disagg.offline import prefill
from mtpserve.engine.engine import LLMEngine
from mtpserve.sampling_params import SamplingParams


def run_handoff(path: str, k: int, batch: int, input_len: int, num_iters: int, dtype: str) -> dict:
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}
    prefill_engine = LLMEngine.from_kwargs(path, spec, dtype=dtype, enforce_eager=True, **ENGINE_DEFAULTS)
    decode = LLMEngine.from_kwargs(path, spec, dtype=dtype, enforce_eager=False, graph_batch_sizes=[batch],
                                   **ENGINE_DEFAULTS)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = common.make_prompts(batch, input_len, decode.model_config.vocab_size, decode.tokenizer, seed=1)
    handoffs = {scheme: [prefill(prefill_engine, f"{scheme}{i}", None, p, params, scheme)
                         for i, p in enumerate(prompts)] for scheme in ("drafts", "hidden")}
    cases = {"scheme 2, no drafts": "hidden", "scheme 1, real drafts": "drafts"}
    graphs = decode.runner.graphs
    run_graph, graph_runs = graphs.run, [0]

    def counting(*args, **kwargs):
        graph_runs[0] += 1
        return run_graph(*args, **kwargs)
    graphs.run = counting
    times = {name: [] for name in cases}
    import_times = {name: [] for name in cases}
    graph_calls = {}
    for it in range(num_iters + 1):   # the first round warms up
        for name, scheme in cases.items():   # interleaved
            ids = [f"{it}-{scheme}-{i}" for i in range(batch)]
            start = time.perf_counter()
            for rid, h in zip(ids, handoffs[scheme]):
                import_handoff(decode, h, rid, params)
            imported = time.perf_counter()
            graph_runs[0] = 0
            decode.step()
            if it:
                import_times[name].append(imported - start)
                times[name].append(time.perf_counter() - imported)
            graph_calls[name] = graph_runs[0]
            for rid in ids:
                decode.abort_request(rid)
    return dict(k=k, batch_size=batch, input_len=input_len,
                steps={name: dict(ms=common.summarize(times[name]), import_ms=common.summarize(import_times[name]),
                                  graph_calls=graph_calls[name]) for name in cases})


def print_handoff(res: dict) -> None:
    for name, s in res["steps"].items():
        print(f"{name}: imports {s['import_ms']['median']:.2f} ms, first step {s['ms']['median']:.2f} ms (medians), "
              f"{s['graph_calls']} graph calls")
