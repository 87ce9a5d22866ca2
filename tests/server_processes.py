"""Server processes for tests: started with one thread each, waited for until healthy, always ended."""
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextmanager
def server_process(args: list[str], url: str, log_path, timeout: float = 120.0, up: tuple = (200,)):
    """Runs `python -m <args>` until url + /health answers a status in `up`; yields the Popen; terminates it
    afterwards."""
    log = open(log_path, "w+")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"{args[0]} exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code in up:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{args[0]} did not become healthy in {timeout:.0f} s")
            time.sleep(0.25)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
