"""Disaggregated serving with real processes on 127.0.0.1: prefill servers, decode servers and proxies.

Through the proxy, greedy output equals one engine's (the reference: the in-process engine, itself equal to a
single server elsewhere) in both hand-off schemes, with MTP k=1 (graph-mode decode server) and k=2 (eager decode
server); every KV block comes back on both sides;
faults end in clear errors, not hangs or leaks.
"""
import json
import time

import httpx
import pytest

from mtpserve import LLM, SamplingParams
from mtpserve.distributed.launch import free_port
from server_processes import server_process
from tiny_models import trained_checkpoint

PROMPTS = [[5, 7, 9, 11, 13, 15, 17, 19, 21], [20, 21, 22], [3, 6, 9, 12, 15, 18, 21, 24, 27, 30], [40, 38, 36, 34]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("pd") / "m", num_mtp_layers=1)


def spec(k: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k, "adaptive": False})


def kv_config(role: str, port: int, **extra) -> str:
    return json.dumps(dict(kv_role=role, kv_port=port, **extra))


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


class Deployment:
    """A prefill server, a decode server and one proxy per hand-off scheme, for one k."""

    def __init__(self, stack, ckpt, k, decode_flags, logs):
        self.prefill, self.decode = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        def serve(spec_json):
            return ["mtpserve.serve.openai_api", "--model", ckpt, "--speculative-config", spec_json, "--max-num-seqs",
                    "8", "--num-kv-blocks", "64", "--dtype", "float32"]
        # the prefill server gets the default (adaptive): as a kv_producer it drafts a fixed k
        self.prefill_log = logs / f"p{k}.log"
        stack.enter_context(server_process(
            serve(json.dumps({"method": "mtp", "num_speculative_tokens": k})) + [
                "--port", self.prefill.rsplit(":", 1)[1], "--enforce-eager", "--kv-transfer-config",
                kv_config("kv_producer", free_port(), kv_transfer_timeout=3)], self.prefill, self.prefill_log))
        stack.enter_context(server_process(
            serve(spec(k)) + ["--port", self.decode.rsplit(":", 1)[1], *decode_flags, "--kv-transfer-config",
                     kv_config("kv_consumer", free_port(), kv_pull_timeout=5)], self.decode, logs / f"d{k}.log",
            timeout=300))
        self.proxies = {}
        for scheme in ("drafts", "hidden"):
            url = f"http://127.0.0.1:{free_port()}"
            stack.enter_context(server_process(
                ["mtpserve.cli", "proxy", "--prefill", self.prefill, "--decode", self.decode, "--port",
                 url.rsplit(":", 1)[1], "--mtp-handoff", scheme], url, logs / f"proxy{k}{scheme}.log"))
            self.proxies[scheme] = url


@pytest.fixture(scope="module")
def deployments(ckpt, tmp_path_factory):
    from contextlib import ExitStack
    logs = tmp_path_factory.mktemp("pd_logs")
    with ExitStack() as stack:
        yield {1: Deployment(stack, ckpt, 1, ["--graph-mode", "--graph-batch-sizes", "4"], logs),
               2: Deployment(stack, ckpt, 2, ["--enforce-eager"], logs)}


def complete(url, prompt, stream=False, **sampling) -> list[int]:
    body = dict(dict(prompt=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, return_token_ids=True, stream=stream,
                     temperature=0.0), **sampling)
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    ids = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
    return ids


def reference(ckpt, k, params) -> list[list[int]]:
    llm = LLM(model=ckpt, dtype="float32", speculative_config=json.loads(spec(k)), enforce_eager=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params,
                                                         use_tqdm=False)]


def wait_all_free(url: str, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if metric(url, "mtpserve:kv_cache_free_blocks") == metric(url, "mtpserve:kv_cache_total_blocks"):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("k", [1, 2], ids=["k1-graph-decode", "k2-eager-decode"])
@pytest.mark.parametrize("scheme", ["drafts", "hidden"])
def test_greedy_through_the_proxy_equals_one_engine(ckpt, deployments, k, scheme):
    d = deployments[k]
    want = reference(ckpt, k, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    got = [complete(d.proxies[scheme], p, stream=(i == 0)) for i, p in enumerate(PROMPTS)]
    assert got == want
    assert metric(d.decode, "mtpserve:spec_decode_num_accepted_tokens_total") > 0
    assert wait_all_free(d.prefill) and wait_all_free(d.decode)


def test_prefill_server_drafts_a_fixed_k_without_calibrating(deployments):
    log = deployments[2].prefill_log.read_text()
    assert "kv_producer: MTP drafts a fixed 2 tokens" in log
    assert "step costs calibrated" not in log


@pytest.mark.parametrize("role, given, adaptive", [
    ("kv_producer", {}, False), ("kv_producer", {"adaptive": True}, True), ("kv_consumer", {}, None),
    ("kv_both", {}, None)])
def test_only_a_prefill_server_fixes_k_and_only_when_not_told(role, given, adaptive):
    from mtpserve.serve.server import prefill_server_speculation
    mtp = {"method": "mtp", "num_speculative_tokens": 2, **given}
    assert prefill_server_speculation(mtp, role).get("adaptive") == adaptive
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert prefill_server_speculation(ngram, role) == ngram and prefill_server_speculation(None, role) is None
    without_method = prefill_server_speculation({"num_speculative_tokens": 2}, role)   # (mtp is the default)
    assert without_method.get("adaptive") == (False if role == "kv_producer" else None)


def test_seeded_sampling_through_the_proxy(ckpt, deployments):
    d = deployments[1]
    params = dict(temperature=0.9, seed=7)
    want = reference(ckpt, 1, SamplingParams(temperature=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True))
    # scheme 1 continues the request's random stream exactly where a single engine would
    assert [complete(d.proxies["drafts"], p, **params) for p in PROMPTS] == want
    # scheme 2 draws as many numbers, but its first decode step samples without drafts: the same distribution,
    # other tokens; reproducible
    hidden = [complete(d.proxies["hidden"], p, **params) for p in PROMPTS]
    assert hidden == [complete(d.proxies["hidden"], p, **params) for p in PROMPTS]
    assert [t[:1] for t in hidden] == [t[:1] for t in want]   # the first token is the prefill server's


def prefill_only(url: str, prompt) -> dict:
    r = httpx.post(url + "/v1/completions", json=dict(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                                      kv_transfer_params={"do_remote_decode": True}), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_a_hand_off_never_pulled_is_freed_after_the_timeout(deployments):
    p = deployments[1].prefill
    params = prefill_only(p, PROMPTS[0])
    assert params["do_remote_prefill"] and metric(p, "mtpserve:kv_held_requests") == 1
    assert metric(p, "mtpserve:kv_cache_free_blocks") < metric(p, "mtpserve:kv_cache_total_blocks")
    assert wait_all_free(p, 8.0) and metric(p, "mtpserve:kv_held_requests") == 0   # kv_transfer_timeout = 3 s
    r = httpx.post(deployments[1].decode + "/v1/completions", json=dict(prompt=PROMPTS[0], kv_transfer_params=params))
    assert r.status_code == 502 and "unknown or expired transfer id" in r.json()["error"]["message"]


def test_a_hand_off_from_another_k_is_refused(deployments):
    params = prefill_only(deployments[1].prefill, PROMPTS[1])
    r = httpx.post(deployments[2].decode + "/v1/completions", json=dict(prompt=PROMPTS[1], kv_transfer_params=params),
                   timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "num_speculative_tokens = 1 on the prefill side, 2 here" in err["message"]
    assert err["param"] == "kv_transfer_params"
    assert wait_all_free(deployments[2].decode)


def test_prefill_server_dies_before_the_pull(ckpt, tmp_path):
    url, kv_port = f"http://127.0.0.1:{free_port()}", free_port()
    args = ["mtpserve.serve.openai_api", "--model", ckpt, "--speculative-config", spec(1), "--port", url.rsplit(":", 1)[1],
            "--num-kv-blocks", "64", "--dtype", "float32", "--enforce-eager",
            "--kv-transfer-config", kv_config("kv_producer", kv_port)]
    with server_process(args, url, tmp_path / "p.log") as proc:
        params = prefill_only(url, PROMPTS[2])
        proc.kill()
        proc.wait()
    decode_url = f"http://127.0.0.1:{free_port()}"
    args = ["mtpserve.serve.openai_api", "--model", ckpt, "--speculative-config", spec(1), "--port",
            decode_url.rsplit(":", 1)[1], "--num-kv-blocks", "64", "--dtype", "float32", "--enforce-eager",
            "--kv-transfer-config", kv_config("kv_consumer", free_port(), kv_pull_timeout=2)]
    with server_process(args, decode_url, tmp_path / "d.log"):
        start = time.monotonic()
        r = httpx.post(decode_url + "/v1/completions", json=dict(prompt=PROMPTS[2], kv_transfer_params=params),
                       timeout=60)
        assert r.status_code == 502 and time.monotonic() - start < 10
        assert f"KV endpoint 127.0.0.1:{kv_port} did not answer within 2 s" in r.json()["error"]["message"]
        assert wait_all_free(decode_url)
        assert complete(decode_url, PROMPTS[0])   # and it goes on serving


def test_proxy_answers_502_when_a_side_is_down(deployments, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    dead = f"http://127.0.0.1:{free_port()}"
    args = ["mtpserve.cli", "proxy", "--prefill", deployments[1].prefill, "--decode", dead, "--port",
            url.rsplit(":", 1)[1]]
    with server_process(args, url, tmp_path / "proxy.log", up=(503,)):   # (its /health: a side is down)
        r = httpx.post(url + "/v1/completions", json=dict(prompt=PROMPTS[0], max_tokens=4), timeout=30)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "decode_unreachable"
    assert wait_all_free(deployments[1].prefill, 8.0)   # the prefilled request is freed after its timeout
