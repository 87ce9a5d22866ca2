"""Background graph mode's compiler process: the cold compile of each graph the compiler thread is asked for runs in
a process of its own (its own copy of the rank: model, KV cache and runner, built as this one was), writing the
inductor cache both processes share; the thread then builds the graph here from that cache, in seconds. A cold
compile is mostly Python: in the serving process it would share the GIL with the steps (docs/history.md).

    serving process                                   compiler process (started at the first graph asked for)
    step 1 fused b1 q2: queued, eager
    compiler thread: ask (fused, 1, 2), wait     ->   build_rank(setup); graphs._build(fused, 1, 2)   (cold)
                                                 <-   None (built; else the error)
    compiler thread: graphs._build(fused, 1, 2)        (the cache's: seconds)
    step 80 fused b1 q2: graph
It ends once nothing more is queued (it holds a second copy of the model and KV cache) and starts again when a
graph is next asked for. It is `python -m` this module, not a multiprocessing child: nothing of the caller's
__main__ runs again in it. Requests and replies are pickles on its stdin and stdout.
"""
import atexit
import logging
import os
import pickle
import subprocess
import sys
import threading
import time

import torch

logger = logging.getLogger("mtpserve")


class CompileProcess:
    def __init__(self, setup):   # setup: the RankSetup this process's rank was built from (executor/worker.py)
        self.setup = setup
        self.process: subprocess.Popen | None = None
        self.pids: list[int] = []   # every compiler process started
        self.closed = False           # (shut down: no compiler process starts again)
        atexit.register(self.close)   # (an engine never shut down: its compiler process ends with this one)

    def __call__(self, key: tuple) -> bool:
        """Returns once the compiler process has built graph `key` (its compiled code is in the cache): True; or
        has been stopped meanwhile, or is closed (shutting down): False."""
        if self.closed:
            return False
        if self.process is None:
            # (this process's sys.path: it imports what this one does, wherever that was found)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            self.process = subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid())],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            self.pids.append(self.process.pid)
            logger.info("compiler process %d started", self.process.pid)
            # (its threads as here: inductor's code, and so the cache key, depends on the thread count)
            self._send((self.setup, torch.get_num_threads()))
        process = self.process   # (stop() may drop it meanwhile: shutting down)
        self._send(key)
        try:
            error = pickle.load(process.stdout)
        except EOFError:
            if self.process is not process:   # (stop())
                return False
            raise RuntimeError(f"the compiler process exited (code {process.wait()})") from None
        if error is not None:
            raise RuntimeError(error)
        return True

    def _send(self, obj) -> None:
        pickle.dump(obj, self.process.stdin)
        self.process.stdin.flush()

    def close(self, timeout: float = 30.0) -> None:
        """Ends the compiler process for good (shutdown, exit)."""
        self.closed = True
        self.stop(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the compiler process (its graph in progress is dropped); the next graph asked for starts another."""
        if self.process is not None:
            process, self.process = self.process, None
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _exit_with(parent: int) -> None:
    """Ends this process once the serving process is gone (killed, say; or before this one started), whatever
    graph it is compiling."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    threading.Thread(target=_exit_with, args=(int(sys.argv[1]),), daemon=True).start()
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)   # (stdout carries the replies only: anything printed goes to stderr)
    requests = sys.stdin.buffer
    setup, threads = pickle.load(requests)
    torch.set_num_threads(threads)
    from mtpserve.executor.worker import build_rank
    rank = build_rank(setup, 0, zeroed_kv=False)   # (background graph mode: builds no graph yet)
    while True:
        try:
            key = pickle.load(requests)
        except EOFError:   # (the serving process is gone)
            return
        try:
            rank.runner.graphs._build(*key)
            pickle.dump(None, replies)
        except Exception as e:
            logger.exception("compiler process: graph %s", key)
            pickle.dump(f"{type(e).__name__}: {e}", replies)
        replies.flush()


if __name__ == "__main__":
    main()
