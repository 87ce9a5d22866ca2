"""`mtpserve bench serve`: concurrent streaming clients against a running OpenAI-compatible server
(`mtpserve serve`), Poisson or fixed-rate arrivals, plus the server's spec-decode counters from /metrics."""
import asyncio
import json
import random
import re
import time

from mtpserve.bench import common

SPEC_COUNTERS = ("mtpserve:spec_decode_num_drafts_total", "mtpserve:spec_decode_num_draft_tokens_total",
                 "mtpserve:spec_decode_num_accepted_tokens_total")


def parse_metrics(text: str) -> dict:
    """Prometheus text -> {"mtpserve:spec_decode_num_drafts_total": value, ..., "...per_pos": [by position]}."""
    out, per_pos = {}, {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in SPEC_COUNTERS:
            out[name] = out.get(name, 0.0) + value
        elif name == "mtpserve:spec_decode_num_accepted_tokens_per_pos_total":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
    out["mtpserve:spec_decode_num_accepted_tokens_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def spec_delta(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    key = "mtpserve:spec_decode_num_accepted_tokens_per_pos"
    a, b = after.get(key, []), before.get(key, [])
    per_pos = [x - (b[i] if i < len(b) else 0.0) for i, x in enumerate(a)]
    return dict(counters=d, **common.acceptance_stats(int(d[SPEC_COUNTERS[0]]), int(d[SPEC_COUNTERS[1]]),
                                                      int(d[SPEC_COUNTERS[2]]), per_pos))


async def one_request(client, url: str, model: str, prompt: list[int], output_len: int, api_key: str | None) -> dict:
    body = dict(model=model, prompt=prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True}, return_token_ids=True)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    emissions, chunks, usage, error = [], 0, None, None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                return dict(ok=False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    error = str(msg["error"])
                    break
                if msg.get("usage"):
                    usage = msg["usage"]
                choices = msg.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("token_ids")):
                    chunks += 1
                    emissions.append((time.perf_counter(), chunks))
    except Exception as e:  # connection errors etc. count as failed requests
        return dict(ok=False, error=f"{type(e).__name__}: {e}")
    if error or not emissions:
        return dict(ok=False, error=error or "no tokens streamed")
    n_out = usage["completion_tokens"] if usage else chunks
    emissions[-1] = (emissions[-1][0], n_out)   # TPOT divides by tokens, not chunks (MTP chunks hold several)
    return dict(ok=True, **common.request_metrics(start, emissions))


async def run_clients(base_url: str, model: str, prompts: list[list[int]], output_len: int, request_rate: float,
                      max_concurrency: int | None, burstiness_poisson: bool, api_key: str | None, seed: int) -> dict:
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency or len(prompts))
    url = base_url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        before = await scrape(client, base_url, api_key)

        async def limited(p):
            async with sem:
                return await one_request(client, url, model, p, output_len, api_key)

        tasks, start = [], time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate) if burstiness_poisson else 1.0 / request_rate)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await scrape(client, base_url, api_key)
    return summarize_serving(results, duration, before, after)


async def scrape(client, base_url: str, api_key: str | None = None) -> dict:
    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        r = await client.get(base_url.rstrip("/") + "/metrics", headers=headers)
        return parse_metrics(r.text) if r.status_code == 200 else {}
    except Exception:
        return {}


def summarize_serving(results: list[dict], duration: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if r["ok"]]
    n_out = sum(r["num_tokens"] for r in ok)
    itls = [x for r in ok for x in r["itls"]]
    return dict(successful_requests=len(ok), failed_requests=len(results) - len(ok),
                errors=sorted({r["error"] for r in results if not r["ok"]})[:5], duration_s=duration,
                request_throughput=len(ok) / duration, output_token_throughput=n_out / duration,
                total_output_tokens=n_out, ttft_ms=common.summarize([r["ttft"] for r in ok]),
                tpot_ms=common.summarize([r["tpot"] for r in ok]), itl_ms=common.summarize(itls),
                e2el_ms=common.summarize([r["e2e"] for r in ok]),
                spec_decode=spec_delta(before, after) if after else None)


def print_serving(s: dict) -> None:
    print(f"Successful requests: {s['successful_requests']}   Failed requests: {s['failed_requests']}")
    print(f"Benchmark duration (s): {s['duration_s']:.2f}")
    print(f"Request throughput (req/s): {s['request_throughput']:.2f}   "
          f"Output token throughput (tok/s): {s['output_token_throughput']:.1f}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        v = s[key]
        if v["mean"] is not None:
            print(f"{key[:-3].upper():5s} mean {v['mean']:.2f} ms  median {v['median']:.2f} ms  p99 {v['p99']:.2f} ms")
    sd = s.get("spec_decode")
    if sd and sd["num_drafts"]:
        print(f"spec decode: acceptance rate {sd['acceptance_rate']:.3f}, mean acceptance length "
              f"{sd['mean_acceptance_length']:.2f}, per position {[round(x, 3) for x in sd['acceptance_per_position']]}")


def from_args(args) -> dict:
    """`mtpserve bench serve`: the clients against --base-url (or --host/--port)."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    base = args.base_url or f"http://{args.host}:{args.port}"
    model = args.served_model_name
    if model is None:
        models = httpx.get(base + "/v1/models", timeout=30,
                           headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}).json()
        model = models["data"][0]["id"]
    vocab, tokenizer = _server_vocab(args)
    prompts = common.make_prompts(args.num_prompts, args.input_len, vocab, tokenizer, seed=args.seed)
    res = asyncio.run(run_clients(base, model, prompts, args.output_len, args.request_rate, args.max_concurrency,
                                  not args.fixed_rate, args.api_key, args.seed))
    res.update(base_url=base, served_model=model, request_rate=str(args.request_rate),
               arrivals="fixed" if args.fixed_rate else "poisson", max_concurrency=args.max_concurrency,
               server_command=args.server_command)
    print_serving(res)
    return res


def _server_vocab(args):
    """Prompts are token ids below the model's vocab: --model (the server's checkpoint) gives the vocab size
    and tokenizer (stdlib-source prompts); without it, random ids below 256 (safe for any checkpoint we make)."""
    if args.model:
        from mtpserve.model.loader import load_tokenizer
        with open(f"{args.model}/config.json") as f:
            return json.load(f)["vocab_size"], load_tokenizer(args.model)
    return 256, None
