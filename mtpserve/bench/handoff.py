"""`mtpserve bench handoff`: a decode server's first step for requests handed over without drafts (scheme 2:
one token each, then the MTP pass from the last prompt position) against scheme 1's first step (real drafts,
the fused 1+k step). In-process engines on the same weights (the transfer itself is timed by
scripts/bench_disagg.sh)."""
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
    graph_calls = {}
    for it in range(num_iters + 1):   # the first round warms up
        for name, scheme in cases.items():   # interleaved
            ids = [f"{it}-{scheme}-{i}" for i in range(batch)]
            for rid, h in zip(ids, handoffs[scheme]):
                import_handoff(decode, h, rid, params)
            graph_runs[0] = 0
            start = time.perf_counter()
            decode.step()
            if it:
                times[name].append(time.perf_counter() - start)
            graph_calls[name] = graph_runs[0]
            for rid in ids:
                decode.abort_request(rid)
    return dict(k=k, batch_size=batch, input_len=input_len,
                steps={name: dict(ms=common.summarize(times[name]), graph_calls=graph_calls[name]) for name in cases})


def print_handoff(res: dict) -> None:
    for name, s in res["steps"].items():
        print(f"{name}: {s['ms']['median']:.2f} ms (median), {s['graph_calls']} graph calls")
