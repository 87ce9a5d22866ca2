"""The OpenAI-compatible server, end to end: a real server process (tiny random checkpoint with a tiny BPE
tokenizer, MTP speculation on) driven by the official `openai` client, checked against the offline engine
on the same checkpoint; plus the AsyncEngine's queue limit and error isolation on a scripted fake engine."""
import asyncio
import dataclasses
import json
import os
import re
import threading
import time

import httpx2 as httpx
import openai
import pytest

from mtpserve.engine.async_engine import AsyncEngine, EngineError, QueueFullError
from mtpserve.request import CompletionOutput, RequestMetrics, RequestOutput
from mtpserve.sampling_params import SamplingParams
from mtpserve.distributed.launch import free_port
from mtpserve.serve.protocol import APIError
from server_processes import server_process

SPEC = {"method": "deepseek_mtp", "num_speculative_tokens": 1, "adaptive": False}
API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 512
PROMPTS = ["hello world", "def fib(n):", "The quick brown fox", "this is a tiny test"]


def write_checkpoint(path: str) -> str:
    """A random tiny checkpoint plus a byte-level BPE tokenizer (vocab = the model's) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from mtpserve.model.checkpoint import write_random_checkpoint
    texts = ["hello world, this is a tiny test tokenizer for the mtpserve server tests."] * 4 + [
        "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)", "The quick brown fox jumps over the lazy dog."]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=320, min_frequency=1, special_tokens=["<bos>", "<eos>"],   # ids 0, 1 as in the config
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    write_random_checkpoint(path, seed=0, vocab_size=tok.get_vocab_size())
    tok.save(os.path.join(path, "tokenizer.json"))
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "clean_up_tokenization_spaces": False, "model_max_length": 512, "chat_template": template}, f)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("server_ckpt")))


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    port = free_port()
    args = ["mtpserve.serve.openai_api", "--model", ckpt, "--port", str(port),
            "--served-model-name", "tiny", "--speculative-config", json.dumps(SPEC), "--max-num-seqs", "4",
            "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "96", "--enforce-eager",
            "--api-key", API_KEY, "--overlap",   # (the engine without overlap: every other test)
            "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3"]
    url = f"http://127.0.0.1:{port}"
    with server_process(args, url, tmp_path_factory.mktemp("server_log") / "server.log"):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(ckpt):
    """Greedy token ids from the offline engine (same checkpoint and speculation) for each prompt."""
    import torch

    from mtpserve.engine.engine import LLMEngine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the server runs (OMP_NUM_THREADS=1); much faster on a busy machine
    try:
        engine = LLMEngine.from_kwargs(model=ckpt, speculative_config=SPEC, max_num_seqs=4,
                                       max_model_len=MAX_MODEL_LEN, num_kv_blocks=96, enforce_eager=True)
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, None, SamplingParams(temperature=0.0, max_tokens=12))
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                finals[out.request_id] = out
    finally:
        torch.set_num_threads(threads)
    return [finals[str(i)].outputs[0] for i in range(len(PROMPTS))]


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics", headers=AUTH).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_idle(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(url, "mtpserve:kv_cache_usage_perc") > 0 or metric(url, "mtpserve:num_requests_running") > 0:
        assert time.monotonic() < deadline, "KV cache not freed"
        time.sleep(0.1)


def test_models_health(server, client):
    assert httpx.get(server + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_concurrent_completions_match_offline_engine(client, offline):
    results = [None] * len(PROMPTS)

    def run(i):
        results[i] = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=12, temperature=0,
                                               extra_body={"return_token_ids": True})
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for res, want in zip(results, offline):
        choice = res.choices[0]
        assert choice.token_ids == want.token_ids
        assert choice.text == want.text and choice.finish_reason == want.finish_reason
        assert res.usage.completion_tokens == len(want.token_ids)
        assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens


def test_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", prompt="hello world", max_tokens=16, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    messages = [{"role": "user", "content": "hi there"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    # the chat template's rendering, sent as a plain completion, gives the same text
    plain = client.completions.create(model="tiny", prompt="<|user|>hi there\n<|assistant|>", max_tokens=10,
                                      temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    assert stream[-1].usage.prompt_tokens == chat.usage.prompt_tokens


def test_n_and_seed(client):
    res = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=1.0, n=3, seed=7)
    assert sorted(c.index for c in res.choices) == [0, 1, 2]
    again = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=1.0, n=3, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in res.choices]
    assert 3 <= res.usage.completion_tokens <= 24
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=5, temperature=0, n=2, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts[0] == texts[1]   # greedy


def test_stop_strings(client):
    full = client.completions.create(model="tiny", prompt="hello world", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    clean = [i for i in range(2, len(full) - 2) if "\ufffd" not in full[i:i + 2]]
    start = clean[len(clean) // 2]
    stop = full[start:start + 2]
    want = full[:full.index(stop)]
    res = client.completions.create(model="tiny", prompt="hello world", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert res.choices[0].text == want and res.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt="hello world", max_tokens=16, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want


def test_metrics_move(server, client):
    client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
    assert metric(server, "mtpserve:spec_decode_num_drafts_total") > 0
    assert metric(server, "mtpserve:spec_decode_num_draft_tokens_total") > 0
    assert metric(server, "mtpserve:spec_decode_num_accepted_tokens_total") >= 0
    text = httpx.get(server + "/metrics", headers=AUTH).text
    assert re.search(r'^mtpserve:spec_decode_num_accepted_tokens_per_pos_total\{.*position="0".*\} ', text, re.M)
    assert metric(server, "mtpserve:request_success_total", 'finished_reason="length"') > 0
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert metric(server, f"mtpserve:{name}_count") > 0
    wait_idle(server)
    assert "mtpserve:num_requests_running{" in text and "mtpserve:num_requests_waiting{" in text


def test_prefix_cache_over_http(server, client):
    """usage.prompt_tokens_details.cached_tokens (the openai client reads it), the Prometheus counters, cache_salt
    in the body, and POST /reset_prefix_cache behind the API key."""
    prompt = list(range(3, 3 + 70))   # 70 token ids: 4 blocks of 16 cached after one run
    kw = dict(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    first = client.completions.create(**kw)
    hits_before = metric(server, "mtpserve:prefix_cache_hits_total")
    again = client.completions.create(**kw)
    assert again.choices[0].text == first.choices[0].text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    assert metric(server, "mtpserve:prefix_cache_hits_total") - hits_before == 64
    assert metric(server, "mtpserve:prefix_cache_queries_total") >= 140
    salted = client.completions.create(**kw, extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert httpx.post(server + "/reset_prefix_cache").status_code == 401
    assert httpx.post(server + "/reset_prefix_cache", headers=AUTH).status_code == 200
    assert client.completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, extra_body={"cache_salt": ""})
    check_error(e, 400, "cache_salt")


def test_disconnect_frees_kv(server, client):
    aborted = metric(server, "mtpserve:request_success_total", 'finished_reason="abort"')
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": MAX_MODEL_LEN - 8, "temperature": 0, "ignore_eos": True,
            "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=headers, timeout=30) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert len(got) >= 2
        assert metric(server, "mtpserve:kv_cache_usage_perc") > 0
    wait_idle(server)
    assert metric(server, "mtpserve:request_success_total", 'finished_reason="abort"') == aborted + 1
    # a non-streaming client that gives up
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/completions", json=dict(body, stream=False), headers=headers, timeout=0.3)
    wait_idle(server)
    assert metric(server, "mtpserve:request_success_total", 'finished_reason="abort"') == aborted + 2
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason


def check_error(exc_info, status: int, param=None):
    err = exc_info.value
    assert err.status_code == status
    body = err.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    if param is not None:
        assert body["param"] == param, body


def test_bad_inputs(server, client):
    r = httpx.post(server + "/v1/completions", content=b'{"prompt": "x",', timeout=10,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    for raw, param in ((b'{"prompt": "x", "temperature": NaN}', None), (b'{"prompt": "x", "temperature": 1e999}',
                                                                         "temperature")):
        r = httpx.post(server + "/v1/completions", content=raw, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    check_error(e, 404, "model")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    check_error(e, 400, "temperature")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_p=2)
    check_error(e, 400, "top_p")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hello world " * 400, max_tokens=2)
    check_error(e, 400, "prompt")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello " * 800}])
    check_error(e, 400, "messages")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=MAX_MODEL_LEN)
    check_error(e, 400, "max_tokens")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[[5, 6, 100000]], max_tokens=2)
    check_error(e, 400, "prompt")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", logprobs=21)
    check_error(e, 400, "logprobs")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", suffix="y")
    check_error(e, 400, "suffix")
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="tiny", prompt="x", max_tokens=2)
    check_error(e, 401)
    r = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)   # no key
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server + "/health").status_code == 200   # no key needed outside /v1
    res = client.completions.create(model="tiny", prompt="still serving", max_tokens=3, temperature=0)
    assert res.usage.completion_tokens >= 1
    wait_idle(server)


# ---- AsyncEngine on a scripted engine: queue limit, 503, engine errors ----

class FakeEngine:
    """Emits token 7 per step per request; a request whose prompt is [666] makes step() raise once."""
    tokenizer = None
    max_model_len = 64
    max_num_seqs = 1

    def __init__(self):
        self.reqs, self.waiting, self.steps = {}, [], 0

    def add_request(self, rid, prompt, ids, params):
        if params.max_tokens > 50:
            raise ValueError(f"max_tokens = {params.max_tokens}: too many")
        self.reqs[rid] = (list(ids), params, [])

    def abort_request(self, rid):
        self.reqs.pop(rid, None)

    def check_health(self):
        pass

    def idle(self):
        pass

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        self.steps += 1
        time.sleep(0.002)
        if any(ids == [666] for ids, _, _ in self.reqs.values()):
            self.reqs = {k: v for k, v in self.reqs.items() if v[0] != [666]}
            raise RuntimeError("boom")
        outs = []
        for rid, (ids, params, toks) in list(self.reqs.items()):
            toks.append(7)
            done = len(toks) >= params.max_tokens
            outs.append(RequestOutput(rid, None, ids, [CompletionOutput(0, "", list(toks), "length" if done else None)],
                                      done, RequestMetrics(time.monotonic())))
            if done:
                del self.reqs[rid]
        return outs

    def get_stats(self):
        return dict(num_running=min(len(self.reqs), 1), num_waiting=max(len(self.reqs) - 1, 0), kv_usage=0.0,
                    num_free_blocks=1, num_total_blocks=1)

    def get_metrics(self):
        return {}


def test_async_engine_queue_limit_and_errors():
    async def main():
        ae = AsyncEngine(FakeEngine(), max_queue_len=1)
        try:
            long = SamplingParams(max_tokens=40)
            s1 = await ae.add_request("a", None, [1], long)
            await s1.__anext__()   # a is running
            s2 = await ae.add_request("b", None, [1], long)   # waits behind a
            with pytest.raises(QueueFullError):
                await ae.add_request("c", None, [1], long)
            s2.abort()
            outs = [o async for o in s1]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 40
            with pytest.raises(ValueError, match="max_tokens"):
                await ae.add_request("d", None, [1], SamplingParams(max_tokens=60))
            # a step error fails the requests in the engine; the loop keeps serving
            bad = await ae.add_request("e", None, [666], long)
            with pytest.raises(EngineError):
                async for _ in bad:
                    pass
            outs = [o async for o in ae.generate(None, [1], SamplingParams(max_tokens=3), "f")]
            assert outs[-1].finished and ae.num_step_errors == 1
        finally:
            ae.shutdown()
    asyncio.run(main())


class DyingEngine(FakeEngine):
    """A multi-process engine whose rank fails at the first step: the step raises and it stays unhealthy."""

    def __init__(self):
        super().__init__()
        self.dead = False

    def step(self):
        self.dead = True
        raise RuntimeError("worker rank 1 (pid 123) exited with code -9")

    def check_health(self):
        if self.dead:
            raise RuntimeError("worker rank 1 (pid 123) exited with code -9")


def test_dead_engine_fails_requests_then_answers_503_and_stops_the_server():
    from mtpserve.serve.openai_api import build_app
    fatal = []

    async def main():
        ae = AsyncEngine(DyingEngine(), on_fatal=lambda: fatal.append(True))
        app = build_app(ae, "fake", None, 64)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
                # the in-flight request gets a 500 naming no internal detail (that goes to the log)
                assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error" and "exited" not in r.text
                for _ in range(100):
                    if not ae.is_running:
                        break
                    await asyncio.sleep(0.02)
                assert fatal == [True] and not ae.is_running
                assert (await c.get("/health")).status_code == 503
                r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
                assert r.status_code == 503
        finally:
            ae.shutdown()
    asyncio.run(main())


def test_queue_full_is_503():
    from mtpserve.serve.openai_api import build_app

    async def main():
        ae = AsyncEngine(FakeEngine(), max_queue_len=0)
        app = build_app(ae, "fake", None, 64)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
                assert r.status_code == 503 and r.headers["retry-after"]
                assert r.json()["error"]["code"] == "queue_full"
        finally:
            ae.shutdown()
    asyncio.run(main())


def test_serve_leaves_a_core_to_the_http_server(monkeypatch):
    """`mtpserve serve` on the CPU: the model's threads per rank are the node's cores but one, over its ranks."""
    import argparse
    from mtpserve.serve.server import add_serve_args, check_serve_args
    for cores, argv, want in [(16, [], 15), (16, ["-tp", "2"], 7), (16, ["--cpu-threads", "3"], 3), (2, [], 1),
                              (1, [], 1), (2, ["-tp", "2"], 1)]:
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        args = add_serve_args(argparse.ArgumentParser()).parse_args(argv)
        check_serve_args(args)
        assert args.cpu_threads == want, (cores, argv)


def test_graph_mode_by_default_where_it_starts_at_once(monkeypatch):
    """Without --enforce-eager / --graph-mode: one CPU process whose threads leave a core free (`serve` leaves
    one) compiles its graphs in the background, for no speculation, a fixed k and adaptive k; on every core
    (`generate`, `LLM`), or with several CPU ranks, it runs eagerly; CUDA captures its graphs at start-up; a flag
    given is kept."""
    import argparse
    import torch
    from mtpserve.engine.setup import engine_config, resolve_graph_mode
    from mtpserve.engine_args import engine_kwargs
    from mtpserve.serve.server import add_serve_args, check_serve_args
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    fixed = '{"method": "mtp", "num_speculative_tokens": 2, "adaptive": false}'
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for argv, device, ranks, eager, background in [
            ([], cpu, 1, False, True), (["--speculative-config", fixed], cpu, 1, False, True),
            (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'], cpu, 1, False, True),
            (["--speculative-config", '{"method": "ngram"}'], cpu, 1, False, True),
            (["--cpu-threads", "4"], cpu, 1, True, False), (["-tp", "2"], cpu, 2, True, False),
            ([], cuda, 1, False, False), ([], cuda, 2, False, False), (["--enforce-eager"], cpu, 1, True, False),
            (["--graph-mode"], cpu, 1, False, False),
            (["--compile-in-background", "--cpu-threads", "4"], cpu, 1, False, True)]:
        args = add_serve_args(argparse.ArgumentParser()).parse_args(argv)
        check_serve_args(args)   # (serve's threads: the cores but one, divided among its ranks)
        cfg = resolve_graph_mode(engine_config(**engine_kwargs(args)), device, ranks)
        assert (cfg.enforce_eager, cfg.compile_in_background) == (eager, background), (argv, device, ranks)
    cfg = engine_config(model=None)   # (LLM's defaults: torch's threads, every core here)
    monkeypatch.setattr(os, "cpu_count", torch.get_num_threads)
    assert resolve_graph_mode(cfg, cpu, 1).enforce_eager is True
    assert resolve_graph_mode(dataclasses.replace(cfg, cpu_threads=1), cpu, 1).compile_in_background is (
        torch.get_num_threads() > 1)


# ---- logprobs, echo and every vLLM request field (the server runs MTP; the reference runs without) ----

def offline_scores(ckpt, prompt: str, max_tokens: int, n: int):
    """The offline engine's output without speculation."""
    from mtpserve import LLM
    llm = LLM(ckpt, max_model_len=MAX_MODEL_LEN, num_kv_blocks=96, enforce_eager=True)
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=n, ignore_eos=True,
                                                 prompt_logprobs=n), use_tqdm=False)[0]


def test_echo_logprobs_equal_the_engine_without_speculation(ckpt, server, client):
    ref = offline_scores(ckpt, PROMPTS[1], 6, 3)
    prompt_ids, output_ids, prompt_lps, output_lps = (ref.prompt_token_ids, ref.outputs[0].token_ids,
                                                      ref.prompt_logprobs, ref.outputs[0].logprobs)
    res = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3,
                                    echo=True, extra_body={"ignore_eos": True})
    lp = res.choices[0].logprobs
    tok = ckpt_tokenizer(ckpt)
    assert res.choices[0].text == PROMPTS[1] + ref.outputs[0].text
    assert lp.tokens == [tok.decode([t]) for t in prompt_ids + output_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [e[t].logprob for e, t in zip(prompt_lps[1:] + output_lps, prompt_ids[1:] + output_ids)]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], expected, strict=True)) < 1e-5
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(max(top.values()) >= lp.token_logprobs[i + 1] for i, top in   # (byte tokens may share a text)
               enumerate(lp.top_logprobs[1:]))
    # max_tokens 0 with echo scores the prompt (lm-evaluation-harness' loglikelihood requests)
    scored = client.completions.create(model="tiny", prompt=[prompt_ids], max_tokens=0, temperature=0, logprobs=1,
                                       echo=True)
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(prompt_ids)]
    assert scored.usage.completion_tokens == 0 and scored.choices[0].text == tok.decode(prompt_ids)
    # streamed: the same tokens and logprobs, chunk by chunk
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                            logprobs=3, echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks if c.choices[0].logprobs), []) == \
        lp.token_logprobs
    assert sum((c.choices[0].logprobs.text_offset for c in chunks if c.choices[0].logprobs), []) == lp.text_offset
    wait_idle(server)


def ckpt_tokenizer(ckpt):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(ckpt)


def test_chat_logprobs_and_processors(client):
    messages = [{"role": "user", "content": "hello"}]
    res = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True})
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens == 8
    assert "".join(c.token for c in content) == res.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode())
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob and c.logprob <= c.top_logprobs[0].logprob
    plain = client.completions.create(model="tiny", prompt="hello world", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = plain.choices[0].token_ids
    banned = client.completions.create(model="tiny", prompt="hello world", max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True,
                                                   "allowed_token_ids": sorted(set(ids[1:]))})
    assert banned.choices[0].token_ids[0] != ids[0] and set(banned.choices[0].token_ids) <= set(ids[1:])
    penalised = client.completions.create(model="tiny", prompt="hello world", max_tokens=12, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    got = penalised.choices[0].token_ids
    assert len(got) == 12 and (len(set(got)) > len(set(ids)) or len(set(ids)) == 12)
    biased = client.completions.create(model="tiny", prompt="hello world", max_tokens=4, temperature=0,
                                       logit_bias={"40": 100}, extra_body={"ignore_eos": True,
                                                                            "return_token_ids": True})
    assert biased.choices[0].token_ids == [40] * 4


# vLLM's completion and chat request fields (its protocol.py, 2026): each is honoured, or refused by name when
# it asks for something.
VLLM_FIELDS = {
    "model": None, "prompt": None, "messages": None, "best_of": None, "echo": None, "frequency_penalty": None,
    "logit_bias": None, "logprobs": None, "top_logprobs": None, "max_tokens": None, "max_completion_tokens": None,
    "n": None, "presence_penalty": None, "seed": None, "stop": None, "stream": None, "stream_options": None,
    "suffix": "def", "temperature": None, "top_p": None, "user": None, "use_beam_search": True, "top_k": None,
    "min_p": None, "repetition_penalty": None, "length_penalty": 0.5, "stop_token_ids": None,
    "include_stop_str_in_output": None, "ignore_eos": None, "min_tokens": None, "skip_special_tokens": None,
    "spaces_between_special_tokens": None, "truncate_prompt_tokens": None, "allowed_token_ids": None,
    "prompt_logprobs": None, "add_special_tokens": None, "response_format": None,
    "structured_outputs": None, "guided_json": None, "guided_regex": None,
    "guided_choice": None, "guided_grammar": None, "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ", "priority": 1, "request_id": "r1", "logits_processors": ["x"],
    "return_tokens_as_token_ids": None, "return_token_ids": None, "cache_salt": None, "kv_transfer_params": None,
    "vllm_xargs": {"a": 1}, "prompt_embeds": "AAAA", "bad_words": None, "tools": None,
    "tool_choice": None, "parallel_tool_calls": None, "functions": [{"name": "f"}], "function_call": "auto",
    "reasoning_effort": "low", "add_generation_prompt": None, "continue_final_message": None,
    "documents": [{"t": "x"}], "chat_template": None, "chat_template_kwargs": None, "mm_processor_kwargs": {"a": 1},
    "metadata": {"a": "b"}, "store": True, "modalities": ["audio"], "audio": {"voice": "x"},
    "prediction": {"type": "content"}, "web_search_options": {}, "service_tier": "flex",
}


def test_every_vllm_field_is_honoured_or_refused_by_name(server):
    from mtpserve.serve import protocol
    handled = set(protocol.SAMPLING_FIELDS) | protocol.OTHER_FIELDS
    for name, asking in VLLM_FIELDS.items():
        if asking is None:
            assert name in handled, name
            continue
        assert name in protocol.UNSUPPORTED_UNLESS, name
        chat = name in ("functions", "function_call", "documents")
        body = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
        r = httpx.post(server + ("/v1/chat/completions" if chat else "/v1/completions"), headers=AUTH, timeout=30,
                       json={**body, "max_tokens": 1, name: asking})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
    r = httpx.post(server + "/v1/completions", headers=AUTH, timeout=30,   # a field nobody defines
                   json={"prompt": "x", "max_tokens": 1, "temperatur": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperatur", r.text


LM_EVAL_TASK = """task: mtp_tiny_{kind}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{question}}}}"
doc_to_target: {target}
{extra}
metric_list:
  - metric: {metric}
"""


def test_lm_evaluation_harness_scores_through_the_server(ckpt, server, tmp_path, monkeypatch):
    """lm-evaluation-harness' local-completions client: a multiple-choice task (loglikelihoods from echoed
    prompt logprobs) and a generate_until task, defined here over local JSONL; its loglikelihoods equal the
    offline engine's own prompt logprobs without speculation."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    from mtpserve import LLM
    docs = [{"question": q, "choices": [" world", " there", " fox"], "answer": i % 3}
            for i, q in enumerate(["hello", "The quick brown", "def fib(n):", "this is a tiny"])]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    for kind, output_type, target, extra, metric in (
            ("mc", "multiple_choice", "answer", 'doc_to_choice: "{{choices}}"', "acc"),
            ("gen", "generate_until", '"{{choices[0]}}"', "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 4",
             "exact_match")):
        (tmp_path / f"{kind}.yaml").write_text(LM_EVAL_TASK.format(kind=kind, data=data, output_type=output_type,
                                                                   target=target, extra=extra, metric=metric))
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["mtp_tiny_mc", "mtp_tiny_gen"], log_samples=True,
        model_args=f"model=tiny,base_url={server}/v1/completions,tokenizer_backend=huggingface,tokenizer={ckpt},"
                   f"num_concurrent=1,max_retries=1",
        task_manager=TaskManager(include_path=str(tmp_path)), limit=len(docs))
    assert 0.0 <= results["results"]["mtp_tiny_mc"]["acc,none"] <= 1.0
    assert len(results["samples"]["mtp_tiny_gen"]) == len(docs)
    tok = ckpt_tokenizer(ckpt)
    llm = LLM(ckpt, max_model_len=MAX_MODEL_LEN, num_kv_blocks=96, enforce_eager=True)
    for sample in results["samples"]["mtp_tiny_mc"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ctx, cont = tok.encode(context), tok.encode(continuation)
            out = llm.generate(prompt_token_ids=[ctx + cont], sampling_params=SamplingParams(
                temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            expected = sum(out.prompt_logprobs[len(ctx) + j][t].logprob for j, t in enumerate(cont))
            assert resp[0][0] == pytest.approx(expected, abs=1e-4)
    wait_idle(server)


def test_structured_outputs_through_the_openai_client(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "enum": ["fib", "fox"]},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    res = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "answer in JSON"}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    import jsonschema
    jsonschema.validate(json.loads(res.choices[0].message.content), schema)
    assert res.choices[0].finish_reason == "stop"
    regex = client.completions.create(model="tiny", prompt="x", max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "(yes|no)[0-9]"}})
    assert re.fullmatch("(yes|no)[0-9]", regex.choices[0].text)
    choice = client.completions.create(model="tiny", prompt="x", max_tokens=20, temperature=0.9, n=3, seed=1,
                                       extra_body={"guided_choice": ["red", "green"]})
    assert {c.text for c in choice.choices} <= {"red", "green"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "no-such-type"}}})
    check_error(e, 400, "response_format")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"guided_regex": "(a"})
    check_error(e, 400, "guided_regex")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "enum": [1, 2, 3]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


def test_tool_calls_named_and_required(client):
    import jsonschema
    messages = [{"role": "user", "content": "weather in Paris?"}]
    named = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=60,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=80,
                                              temperature=0.8, seed=3, tool_choice="required",
                                              parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    schema = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)
    # the call goes back through the chat template as an assistant turn and a tool turn
    follow = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, tools=[WEATHER],
                                            tool_choice="none", messages=messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].message.tool_calls is None and follow.choices[0].finish_reason in ("stop", "length")
    stream = list(client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=60,
                                                 temperature=0, stream=True, tool_choice={
                                                     "type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2   # (the arguments in pieces)
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "tool_calls"
    auto = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=8,
                                          temperature=0)   # ("auto": this model writes no DeepSeek call tokens)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content
    assert auto.choices[0].finish_reason in ("stop", "length")
    from mtpserve.serve.tools import parse_tools
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):   # (a server without a parser)
        parse_tools({"tools": [WEATHER]}, None)
    for bad, param in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                       ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=4, **bad)
        check_error(e, 400, param)


def test_deepseek_v3_tool_call_parser():
    from mtpserve.serve.tools import ToolRequest, tool_calls
    text = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
            '```json\n{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')
    auto = ToolRequest([], "auto", parser="deepseek_v3")
    content, calls = tool_calls(auto, text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})]
    assert tool_calls(auto, "no calls here") == ("no calls here", [])
    with pytest.raises(ValueError):   # (cut mid-call by max_tokens: the caller keeps the text as content)
        tool_calls(auto, text[:60])


def test_langchain_structured_output_and_tools(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel
    from typing import Literal

    class Answer(BaseModel):
        city: Literal["Paris", "Oslo"]
        ok: bool

    llm = ChatOpenAI(base_url=server + "/v1", api_key=API_KEY, model="tiny", temperature=0, max_tokens=60,
                     max_retries=0)
    answer = llm.with_structured_output(Answer, method="json_schema").invoke("which city?")
    assert isinstance(answer, Answer)
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")
    msg = bound.invoke("weather?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert msg.tool_calls[0]["args"]["city"] in ("Paris", "Oslo")
