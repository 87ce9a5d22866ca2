"""Tensor parallelism: 2 ranks (gloo, one thread each, 127.0.0.1) against one process on the same checkpoint.

The reference is the single-process engine (itself checked against transformers elsewhere): TP=2 must give the
same greedy tokens, the same acceptance counts, the same seeded samples, with chunked prefill, preemption, both
scorers and graph mode. Every engine's worker processes are ended by PID when the module finishes, and a
watchdog kills them if a test runs too long, which turns a hang of rank 0 (waiting in a collective) into a
failure of that test.
"""
import os
import signal
import subprocess
import sys
import threading
import time

os.environ.setdefault("MTPSERVE_COLLECTIVE_TIMEOUT", "120")   # a stuck rendezvous fails instead of waiting 10 min

import pytest
import torch

from conftest import make_config, read_safetensors
from mtpserve import LLM, SamplingParams
from mtpserve.executor.multiproc import WorkerFailedError
from mtpserve.model.checkpoint import write_random_checkpoint
from mtpserve.model.loader import LoadStats, load_model, quantize_fp8_blockwise
from mtpserve.model.parallel import TensorParallel, shard_kind, shard_slices
from mtpserve.spec_decode import adaptive
from rank_processes import (STARTED, assert_same_scores, scored_outputs,  # noqa: F401
                             count_graph_runs, end_workers, record_workers, reference,
                             watchdog)
from test_adaptive import forcing
from tiny_models import trained_checkpoint


def tensor_parallel(path, **kw) -> LLM:
    """A TP=2 LLM (one per process at a time: torch.distributed has one default group); the caller shuts it
    down. Its worker's PID is recorded for the watchdog."""
    return record_workers(LLM(model=path, dtype="float32", tensor_parallel_size=2, **kw))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("tp") / "m", num_mtp_layers=2)


PROMPTS = [[5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25], [20, 21, 22], [3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 36],
           [40, 38, 36, 34]]


def run(llm, params):
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics()


# greedy, two seeded samplers (their own generators), one unseeded sampler (the engine's generator, seeded alike
# on every rank)
MIXED = [SamplingParams(temperature=0.0, max_tokens=40), SamplingParams(temperature=0.8, seed=11, max_tokens=40),
         SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=40), SamplingParams(temperature=0.7, max_tokens=40)]


@pytest.mark.parametrize("kw", [
    # k=3 over a checkpoint with 2 MTP layers (chained drafting); chunked prefill (8-token budget) and
    # preemption (11 blocks of 4 slots cannot hold three requests of ~55 tokens)
    dict(speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}, max_num_batched_tokens=8,
         num_kv_blocks=24, block_size=4),
    dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False,
                             "scorer": "batch_expansion"}),
    dict(speculative_config=None),
    dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}, quantization="fp8"),
    # adaptive k, forced to switch between 0 and 3 (every rank runs the same MTP passes, KV-only ones too)
    dict(speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": True},
         max_num_batched_tokens=8, num_kv_blocks=24, block_size=4),
], ids=["mtp_k3_chunked_preempted", "mtp_k1_batch_expansion", "no_spec", "fp8_in_memory", "adaptive_k_forced"])
def test_tp2_matches_one_process(ckpt, kw, monkeypatch):
    def force_k():   # (the policy runs on the front only; the workers get each step's k with its batch)
        if (kw["speculative_config"] or {}).get("adaptive"):
            monkeypatch.setattr(adaptive.AdaptiveK, "choose_for", forcing([0, 0, 1, 0, 0, 3, 2]))
    force_k()
    one = reference(ckpt, **kw)
    tokens_one, metrics_one = run(one, MIXED)
    force_k()
    two = tensor_parallel(ckpt, **kw)
    try:
        preempted = count_preemptions(two)
        tokens_two, metrics_two = run(two, MIXED)
        if kw.get("num_kv_blocks") and not kw["speculative_config"].get("adaptive"):   # logprobs, processors
            assert_same_scores(scored_outputs(two, PROMPTS), scored_outputs(one, PROMPTS))
        if kw.get("num_kv_blocks") and not kw["speculative_config"].get("adaptive"):   # prefix-cache hits on
            hits = two.engine.block_manager.num_hits                                  # every rank alike
            again = run(two, MIXED)[0]   # (the unseeded sampler draws anew)
            assert again[:3] == tokens_two[:3] and two.engine.block_manager.num_hits > hits
    finally:
        two.engine.shutdown()
    assert tokens_two == tokens_one
    assert all(len(t) == 40 for t in tokens_two)
    assert metrics_two == metrics_one   # acceptance counts, position by position
    if kw.get("num_kv_blocks"):
        assert preempted() > 0, "the configuration was meant to preempt"
    if kw["speculative_config"]:
        assert metrics_two["num_accepted_tokens"] > 0


def count_preemptions(llm):
    scheduler, count = llm.engine.scheduler, [0]
    preempt = scheduler._preempt

    def counting(req):
        count[0] += 1
        preempt(req)
    scheduler._preempt = counting
    return lambda: count[0]


def test_tp2_graph_mode_matches_eager(ckpt):
    spec = {"method": "mtp", "num_speculative_tokens": 1, "adaptive": False}
    params = SamplingParams(temperature=0.0, max_tokens=30)
    outputs = {}
    for eager in (True, False):
        llm = tensor_parallel(ckpt, speculative_config=spec, enforce_eager=eager, graph_batch_sizes=[4])
        try:
            calls = None if eager else count_graph_runs(llm)
            outputs[eager] = run(llm, params)
        finally:
            llm.engine.shutdown()
    assert outputs[False] == outputs[True]   # tokens and acceptance
    assert calls() > 10   # decode and draft steps really ran as graphs


def test_killed_worker_fails_requests_within_seconds(ckpt):
    llm = tensor_parallel(ckpt)
    (rank, worker), = llm.engine.executor.workers
    try:
        threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match=f"worker rank {rank}.*exited"):
            llm.generate(prompt_token_ids=PROMPTS * 30, sampling_params=SamplingParams(max_tokens=200,
                                                                                          ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - start < 1.0 + 10.0
        assert not llm.engine.has_unfinished_requests()   # the failed call's requests left the engine
        with pytest.raises(WorkerFailedError):             # and the engine refuses further work
            llm.generate(prompt_token_ids=[[3, 4]], use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_a_failed_start_up_leaves_no_process_group_behind(ckpt, monkeypatch):
    """Rank 0 fails after the ranks joined: the front stops its worker and leaves the process group, so that
    the next tensor-parallel engine of this process starts and runs."""
    from mtpserve.runner.model_runner import ModelRunner

    def failing(*args, **kwargs):
        raise RuntimeError("warm-up failed here")
    with monkeypatch.context() as patched:
        patched.setattr(ModelRunner, "warm_up_graphs", failing)
        with pytest.raises(WorkerFailedError, match="warm-up failed here"):
            tensor_parallel(ckpt, enforce_eager=True)
    assert not torch.distributed.is_initialized()
    llm = tensor_parallel(ckpt, enforce_eager=True)
    try:
        out = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.shutdown()


def test_a_worker_that_fails_reports_why_then_exits(tmp_path):
    """What the front names when a worker raises: the worker's own report (here its checkpoint is gone)."""
    import torch.multiprocessing as mp
    from mtpserve.engine.setup import engine_config, engine_setup
    from mtpserve.executor.worker import worker_process
    path = write_random_checkpoint(str(tmp_path / "m"))
    setup = engine_setup(engine_config(model=path, enforce_eager=True))   # one rank: no rendezvous, straight to loading
    os.remove(os.path.join(path, "model.safetensors"))
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    worker = ctx.Process(target=worker_process, args=(setup, 0, errors))
    worker.start()
    STARTED.append(worker.pid)
    rank, why = errors.get(timeout=120)
    worker.join(timeout=30)
    assert rank == 0 and "model.safetensors" in why and worker.exitcode == 1


def test_bad_tensor_parallel_size_is_refused_before_starting(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "m"), num_attention_heads=3)
    with pytest.raises(ValueError, match="tensor_parallel_size = 2: must divide num_attention_heads = 3"):
        LLM(model=path, tensor_parallel_size=2, enforce_eager=True)
    with pytest.raises(ValueError, match=r"tensor_parallel_size x data_parallel_size = 64: .* CPU cores"):
        LLM(model=path, tensor_parallel_size=64, enforce_eager=True)


# ---- loading shard by shard (in-process: loading needs no collectives) ----------------------------------

def test_each_rank_reads_only_its_slices(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "m"), vocab_size=251)   # 251: the last rank's rows are padded
    file_bytes = sum(t.numel() * t.element_size() for t in read_safetensors(path).values())
    full = load_model(path).state_dict()
    for rank in range(2):
        stats = LoadStats()
        model = load_model(path, tp=TensorParallel(rank, 2), stats=stats)
        assert stats.bytes_read < 0.7 * file_bytes   # embeddings, heads, attention and experts: halves
        held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
        assert sum(held.values()) < 0.7 * file_bytes   # and the memory behind the weights is the shard's only
        shard = model.state_dict()
        for name, t in shard.items():
            index = shard_slices(shard_kind(name), tuple(full[name].shape), TensorParallel(rank, 2))
            expected = full[name] if index is None else full[name][index]
            assert torch.equal(t[:expected.shape[0]], expected), name
            assert not t[expected.shape[0]:].any(), name   # vocabulary padding is zero


def test_fp8_checkpoint_slices_dequantize_like_the_whole(tmp_path):
    """Block scales of a slice that starts inside a tile: each rank's weights equal its slice of the
    dequantized whole (tiles of 24 rows do not align with the ranks' halves)."""
    cfg = make_config()
    path = write_random_checkpoint(str(tmp_path / "m"), **cfg)
    tensors = read_safetensors(path)
    block = (24, 16)
    for k in list(tensors):
        t = tensors[k]
        if t.dim() == 2 and "embed" not in k and "head" not in k and "gate.weight" not in k:
            tensors[k], tensors[k.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8_blockwise(t, block)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block)}
    from test_loader import copy_ckpt
    fp8 = copy_ckpt(path, str(tmp_path / "fp8"), tensors=tensors, config=cfg)
    whole = load_model(fp8).state_dict()
    shard = load_model(fp8, tp=TensorParallel(1, 2)).state_dict()
    for name, t in shard.items():
        index = shard_slices(shard_kind(name), tuple(whole[name].shape), TensorParallel(1, 2))
        assert torch.equal(t, whole[name] if index is None else whole[name][index]), name


# ---- torchrun: every rank started outside the engine (the multi-node path, env:// rendezvous) ------------

def test_torchrun_launch_generates_like_one_process(ckpt, tmp_path):
    prompt = "def add(a, b):"
    ref = LLM(model=None, dtype="float32",
              speculative_config={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False}, enforce_eager=True)
    expected = ref.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "mtpserve.cli", "generate", "-tp", "2", "--dtype", "float32",
           "--max-tokens", "24", "--prompt", prompt,
           "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1, "adaptive": false}']
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert prompt + expected in out


def free_port() -> int:
    from mtpserve.distributed.launch import free_port
    return free_port()


def test_tp2_structured_outputs_match_one_process(tmp_path):
    """Each rank compiles the request's grammar itself (compiled grammars do not travel) and masks the same
    positions: TP = 2 gives one process's tokens."""
    from test_server import write_checkpoint
    from test_structured import GRAMMARS, PROMPTS as TEXTS, valid
    path = write_checkpoint(str(tmp_path / "tok"))
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=GRAMMARS[kind])
              for kind in ("json", "regex", "choice", "grammar")]
    one = LLM(model=path, dtype="float32", speculative_config=spec, max_model_len=256, enforce_eager=True)
    want = [o.outputs[0] for o in one.generate(TEXTS, params, use_tqdm=False)]
    two = tensor_parallel(path, speculative_config=spec, max_model_len=256)
    try:
        got = [o.outputs[0] for o in two.generate(TEXTS, params, use_tqdm=False)]
    finally:
        two.engine.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(valid(kind, o.text) for kind, o in zip(("json", "regex", "choice", "grammar"), got))
