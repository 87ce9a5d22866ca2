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
        REFERENCES[key] = LLM(model=path, dtype="float32", **kw)
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
