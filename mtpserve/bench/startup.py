"""`mtpserve bench startup`: how long `mtpserve serve --graph-mode` takes to answer, and how fast it decodes in the
minutes after, with its graphs compiled at start-up or in the background (--compile-in-background), from an
empty inductor cache (cold) and from the one the cold run left (warm).

Each run is a server process; one client then sends batch-1 greedy completions back to back for --duration
seconds. A row of the timeline: (seconds since the server was started, the request's output tokens/s).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from mtpserve.bench import common


def run_startup(path: str, spec: dict, output_len: int, duration: float, timeout: float,
                graph_batch_sizes: str | None, modes: list[str]) -> dict:
    from mtpserve.distributed.launch import free_port
    from mtpserve.model.loader import load_tokenizer
    caches = {mode: tempfile.mkdtemp(prefix=f"mtpserve-inductor-{mode}-") for mode in modes}
    tokenizer = load_tokenizer(path)   # (a checkpoint without one: token ids any vocabulary has)
    prompt = tokenizer.encode("def fibonacci(n):") if tokenizer is not None else list(range(10, 26))
    rows = []
    try:
        for mode, cache in [(mode, cache) for mode in modes for cache in ("cold", "warm")]:
            if cache == "warm" and not rows[-1]["ready_s"]:
                continue   # (the cold run never became ready: no warm cache to start from)
            port = free_port()
            cmd = [sys.executable, "-m", "mtpserve.cli", "serve", "--model", path, "--port", str(port),
                   "--graph-mode", "--speculative-config", json.dumps(spec)]
            cmd += ["--compile-in-background"] if mode == "background" else []
            cmd += ["--graph-batch-sizes", graph_batch_sizes] if graph_batch_sizes else []
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=caches[mode])
            rows.append(dict(mode=mode, cache=cache, **_time_server(cmd, env, port, prompt, output_len, duration,
                                                                    timeout)))
            print(_row_line(rows[-1]), flush=True)
    finally:
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
    return dict(speculative_config=spec, output_len=output_len, duration_s=duration, timeout_s=timeout,
                graph_batch_sizes=graph_batch_sizes or "default", rows=rows)


def _time_server(cmd, env, port: int, prompt: list[int], output_len: int, duration: float, timeout: float) -> dict:
    import httpx
    base = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = None
        while ready is None and time.monotonic() - start < timeout and server.poll() is None:
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    ready = time.monotonic() - start
            except httpx.HTTPError:
                time.sleep(0.5)
        timeline = []
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"] if ready is not None else None
        body = {"model": model, "prompt": prompt, "max_tokens": output_len,
                "temperature": 0.0, "ignore_eos": True}
        while ready is not None and time.monotonic() - start < ready + duration:
            sent = time.monotonic()
            out = httpx.post(base + "/v1/completions", json=body, timeout=600).json()
            if "usage" not in out:
                raise RuntimeError(f"the server answered {out}")
            timeline.append((round(time.monotonic() - start, 1),
                             round(out["usage"]["completion_tokens"] / (time.monotonic() - sent), 1)))
        return dict(ready_s=ready and round(ready, 1), timeline=timeline)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def summary(row: dict) -> dict:
    """Mean tokens/s over the first and the last 30 s of the timeline."""
    timeline = row["timeline"]
    if not timeline:
        return dict(first=None, last=None)
    t0, t1 = timeline[0][0], timeline[-1][0]
    first = [r for t, r in timeline if t <= t0 + 30]
    last = [r for t, r in timeline if t >= t1 - 30]
    return dict(first=sum(first) / len(first), last=sum(last) / len(last))


def whole_run_rate(row: dict, output_len: int) -> float | None:
    """Output tokens/s from ready to the last answer (every request gets output_len tokens: ignore_eos)."""
    timeline = row["timeline"]
    return len(timeline) * output_len / (timeline[-1][0] - row["ready_s"]) if timeline else None


def _row_line(row: dict) -> str:
    s = summary(row)
    ready = f"ready after {row['ready_s']} s" if row["ready_s"] else "not ready"
    speed = "" if s["first"] is None else f"; {s['first']:.0f} tok/s in the first 30 s, {s['last']:.0f} in the last 30"
    return f"{row['mode']:>10} {row['cache']}: {ready}{speed}"


def table(res: dict) -> list[str]:
    out = ["| graphs compiled | inductor cache | ready after, s | batch-1 tok/s, first 30 s | ... last 30 s "
           "| ... the whole run |", "|---|---|---|---|---|---|"]
    for row in res["rows"]:
        s, whole = summary(row), whole_run_rate(row, res["output_len"])
        fmt = lambda v: "-" if v is None else f"{v:.0f}"   # noqa: E731
        ready = f"{row['ready_s']}" if row["ready_s"] else f"not after {res['timeout_s']:.0f}"
        out.append(f"| {'in the background' if row['mode'] == 'background' else 'at start-up'} | {row['cache']} | "
                   f"{ready} | {fmt(s['first'])} | {fmt(s['last'])} | {fmt(whole)} |")
    return out


def from_args(args, path: str) -> dict:
    spec = args.speculative_config or {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    res = run_startup(path, spec, args.output_len, args.duration, args.timeout, args.graph_batch_sizes,
                      common.parse_list(args.modes, str))
    print("\n".join(table(res)))
    return res
