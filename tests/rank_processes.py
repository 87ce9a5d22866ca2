"""What the multi-process tests share: every worker PID an engine started is recorded, ended when the module
finishes, and killed by a watchdog if a test runs too long (which turns a hang of the front, waiting in a
collective, into a failure of that test). Import the fixtures into a test module to use them."""
import os
import signal
import threading

import pytest

WATCHDOG_SECONDS = 240
STARTED: list[int] = []   # worker PIDs of every engine started


def kill_workers() -> None:
    for pid in STARTED:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


REFERENCES: dict = {}


def reference(path, **kw):
    """One single-process fp32 LLM per (checkpoint, configuration) for the session (its acceptance counts add up
    over uses)."""
    from mtpserve import LLM
    key = (path, repr(sorted(kw.items())))
    if key not in REFERENCES:
        REFERENCES[key] = LLM(model=path, dtype="float32", **(dict(enforce_eager=True) | kw))
    return REFERENCES[key]


def record_workers(llm):
    STARTED.extend(p.pid for _, p in llm.engine.executor.workers)
    return llm


@pytest.fixture(autouse=True)
def watchdog():
    timer = threading.Timer(WATCHDOG_SECONDS, kill_workers)
    timer.start()
    yield
    timer.cancel()


@pytest.fixture(scope="module", autouse=True)
def end_workers():
    yield
    kill_workers()


def count_graph_runs(llm):
    """Counts the graphs rank 0 runs (separate ones and fused steps)."""
    graphs, count = llm.engine.runner.graphs, [0]

    def counted(run_graph):
        def counting(*args, **kwargs):
            count[0] += 1
            return run_graph(*args, **kwargs)
        return counting
    graphs.run, graphs.run_fused = counted(graphs.run), counted(graphs.run_fused)
    return lambda: count[0]


# Requests that read the target's logits (logprobs, processors): the separate path on every rank; the front's
# results must equal one process's, prompt split included (a worker's copy of a request knows its prompt).
def scored_params():
    from mtpserve import SamplingParams
    return [SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, prompt_logprobs=2, repetition_penalty=1.3),
            SamplingParams(temperature=0.8, seed=3, max_tokens=20, logprobs=1, frequency_penalty=0.5, min_p=0.05),
            SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5, logit_bias={1: 5.0}),
            SamplingParams(temperature=0.7, seed=9, max_tokens=20, presence_penalty=0.4, prompt_logprobs=0)]


def scored_outputs(llm, prompts):
    """(tokens, logprobs, prompt logprobs) per prompt, logprobs as [(token, logprob, rank)] rows."""
    def rows(entries):
        return [None if e is None else [(t, lp.logprob, lp.rank) for t, lp in e.items()] for e in entries or []]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=scored_params(), use_tqdm=False)
    return [(o.outputs[0].token_ids, rows(o.outputs[0].logprobs), rows(o.prompt_logprobs)) for o in outs]


def assert_same_scores(a, b, tol=1e-5):
    for (tokens_a, lp_a, plp_a), (tokens_b, lp_b, plp_b) in zip(a, b, strict=True):
        assert tokens_a == tokens_b
        for x, y in zip(lp_a + plp_a, lp_b + plp_b, strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                assert [t for t, _, _ in x] == [t for t, _, _ in y]
                assert max(abs(p - q) for (_, p, _), (_, q, _) in zip(x, y)) < tol
