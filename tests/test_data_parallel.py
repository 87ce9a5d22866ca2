"""Data-parallel attention with expert parallelism: 2 ranks (gloo, one thread each, 127.0.0.1) against one process.

Each rank runs its own requests with its own KV cache and holds half of the routed experts; every MoE layer
dispatches tokens across the ranks, so a rank with nothing to do must still run the same forwards (dummies),
including every MTP pass. The reference is the single-process engine: greedy tokens and acceptance counts must
be the same however the requests are placed. Worker processes are ended by PID and watched (rank_processes.py):
a hang is a failed test, not a stuck suite.
"""
import os
import signal
import threading
import time

os.environ.setdefault("MTPSERVE_COLLECTIVE_TIMEOUT", "120")

import pytest
import torch
import torch.multiprocessing as mp

from mtpserve import LLM, SamplingParams
from mtpserve.config import ModelConfig
from mtpserve.distributed.launch import free_port
from mtpserve.executor.multiproc import WorkerFailedError
from mtpserve.model.checkpoint import tiny_config, write_random_checkpoint
from mtpserve.model.loader import LoadStats, load_model
from mtpserve.model.parallel import ExpertParallel
from rank_processes import (STARTED, assert_same_scores, count_graph_runs, end_workers, record_workers,  # noqa: F401
                             reference, scored_outputs, watchdog)
from tiny_models import trained_checkpoint


PROMPTS = [[5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25], [20, 21, 22], [3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 36],
           [40, 38, 36, 34]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
K3 = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}   # chained over the checkpoint's 2 MTP layers


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("dp") / "m", num_mtp_layers=2)


def data_parallel(path, **kw) -> LLM:
    """DP=2 with EP=2; the caller shuts it down."""
    return record_workers(LLM(model=path, dtype="float32", data_parallel_size=2, enable_expert_parallel=True, **kw))


def generate(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics()


def run_on_ranks(engine, prompts, ranks, params=GREEDY) -> list[list[int]]:
    """Adds prompt i on data-parallel rank ranks[i] and steps the engine to the end."""
    for i, (p, rank) in enumerate(zip(prompts, ranks)):
        engine.add_request(str(i), None, p, params, data_parallel_rank=rank)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
    return [done[i] for i in range(len(prompts))]


@pytest.mark.parametrize("kw", [
    dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False}),
    # chunked prefill (8-token budget per rank) and preemption (24 blocks of 4 slots per rank)
    dict(speculative_config=K3, max_num_batched_tokens=8, num_kv_blocks=24, block_size=4),
    # adaptive k (the default): one k per step for both ranks, chosen on the front; the calibration's forced
    # turns switch it every few steps, and a rank's idle steps run the MTP passes of whatever k the step drafts
    dict(speculative_config={"method": "mtp", "num_speculative_tokens": 3}),
], ids=["mtp_k1", "mtp_k3_chunked", "mtp_adaptive_k3"])
def test_dp2_ep2_matches_one_process_with_requests_on_both_ranks(ckpt, kw):
    tokens_one, metrics_one = generate(reference(ckpt, **kw))
    two = data_parallel(ckpt, **kw)
    try:
        tokens_two, metrics_two = generate(two)   # placed by load: two requests on each rank
        counts = two.engine.executor.pass_counts()
        if kw["speculative_config"] == K3:   # prefix cache per rank: the same tokens on a hit; a request goes to
            assert generate(two)[0] == tokens_two   # the rank holding its prefix (rank 1 here, not the idler 0)
            hits = sum(c.block_manager.num_hits for c in two.engine.schedulers)
            assert hits > 0
            long = list(range(3, 40))
            assert run_on_ranks(two.engine, [long], [1]) == run_on_ranks(two.engine, [long], [1])
            two.engine.add_request("placed", None, long + [5], GREEDY)
            assert two.engine.requests["placed"].dp_rank == 1
            two.engine.abort_request("placed")
            assert_same_scores(scored_outputs(two, PROMPTS), scored_outputs(reference(ckpt, **kw), PROMPTS))
    finally:
        two.engine.shutdown()
    assert tokens_two == tokens_one and all(len(t) == 40 for t in tokens_two)
    assert metrics_two["num_accepted_tokens"] > 0
    adaptive = two.engine.policy.adapts   # (then each engine's policy picks its own k for the same tokens)
    if "max_num_batched_tokens" not in kw and not adaptive:   # (a budget per rank schedules differently)
        assert metrics_two == metrics_one
    for rank in counts:   # both ranks ran requests; every forward was matched on the other rank
        assert rank.get("dummy_main", 0) < rank["main"]
    assert counts[0]["main"] == counts[1]["main"] and counts[0]["mtp"] == counts[1]["mtp"]


@pytest.mark.parametrize("busy", [0, 1])
def test_all_requests_on_one_rank_the_other_runs_every_pass_as_a_dummy(ckpt, busy):
    one = reference(ckpt, speculative_config=K3)
    tokens_one, _ = generate(one)
    two = data_parallel(ckpt, speculative_config=K3)
    try:
        with pytest.raises(ValueError, match=r"data_parallel_rank = 2: must be in \[0, data_parallel_size = 2\)"):
            two.engine.add_request("bad", None, [3, 4], GREEDY, data_parallel_rank=2)
        tokens_two = run_on_ranks(two.engine, PROMPTS, [busy] * len(PROMPTS))
        counts = two.engine.executor.pass_counts()
        stats = two.engine.get_stats()
    finally:
        two.engine.shutdown()
    assert tokens_two == tokens_one
    idle, worked = counts[1 - busy], counts[busy]
    assert worked.get("dummy_main", 0) == 0 and worked["main"] > 10
    assert idle["dummy_main"] == idle["main"] == worked["main"]
    # the idle rank ran as many MTP passes as the busy one (k = 3 per drafting step), all of them dummies
    assert idle["dummy_mtp"] == idle["mtp"] == worked["mtp"] >= 3 * (worked["main"] - 2)
    assert [r["num_running"] + r["num_waiting"] for r in stats["data_parallel_ranks"]] == [0, 0]


def test_one_rank_prefills_while_the_other_verifies(ckpt):
    kw = dict(speculative_config=K3, max_num_batched_tokens=8)
    long_prompt = [(3 + 2 * i) % 46 + 2 for i in range(45)]
    prompts = [PROMPTS[0], PROMPTS[1], long_prompt]
    tokens_one, _ = generate(reference(ckpt, **kw), prompts)
    two = data_parallel(ckpt, **kw)
    steps = []
    execute = two.engine.executor.execute

    def recording(scheduled):
        steps.append([(s.req.dp_rank, s.samples, len(s.draft_token_ids)) for s in scheduled])
        return execute(scheduled)
    two.engine.executor.execute = recording
    try:
        engine = two.engine
        for i in range(2):
            engine.add_request(str(i), None, prompts[i], GREEDY, data_parallel_rank=0)
        for _ in range(4):   # rank 0's requests are verifying drafts by now
            engine.step()
        engine.add_request("2", None, long_prompt, GREEDY, data_parallel_rank=1)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    finally:
        two.engine.shutdown()
    assert [done[str(i)] for i in range(3)] == tokens_one
    mixed = [s for s in steps if any(r == 1 and not samples for r, samples, _ in s)
             and any(r == 0 and drafts == 3 for r, _, drafts in s)]
    assert len(mixed) >= 3   # a 45-token prompt in 8-token chunks, beside rank 0's 1+3-token verifications


def test_dp2_graph_mode_matches_one_process(ckpt):
    """Three requests: two on rank 0, one on rank 1; every rank pads to the same graph (batch 2)."""
    spec = {"method": "mtp", "num_speculative_tokens": 1, "adaptive": False}
    prompts = PROMPTS[:3]
    tokens_one, metrics_one = generate(LLM(model=ckpt, dtype="float32", speculative_config=spec,
                                           enforce_eager=True), prompts)
    two = data_parallel(ckpt, speculative_config=spec, enforce_eager=False, graph_batch_sizes=[2])
    try:
        graph_runs = count_graph_runs(two)
        tokens_two, metrics_two = generate(two, prompts)
    finally:
        two.engine.shutdown()
    assert tokens_two == tokens_one and metrics_two == metrics_one
    assert graph_runs() > 10


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_ranks_do_not_spin_and_a_killed_rank_fails_requests_within_seconds(ckpt):
    llm = data_parallel(ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False})
    (rank, worker), = llm.engine.executor.workers
    try:
        generate(llm, PROMPTS[:2], SamplingParams(max_tokens=5))
        before = cpu_seconds(worker.pid)
        time.sleep(2.0)
        assert cpu_seconds(worker.pid) - before < 0.2   # waiting for the next step, not polling for it
        threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match=f"worker rank {rank}.*exited"):
            generate(llm, PROMPTS * 30, SamplingParams(max_tokens=200, ignore_eos=True))
        assert time.monotonic() - start < 1.0 + 10.0
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.engine.shutdown()


def test_refused_layouts(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "m"), n_routed_experts=3, n_group=1, topk_group=1)
    with pytest.raises(ValueError, match=r"expert parallel size 2 .*: must divide n_routed_experts = 3"):
        LLM(model=path, data_parallel_size=2, enable_expert_parallel=True, enforce_eager=True)
    with pytest.raises(ValueError, match="data_parallel_size = 2 with tensor_parallel_size = 2"):
        LLM(model=path, data_parallel_size=2, tensor_parallel_size=2, enforce_eager=True)


def test_each_rank_loads_only_its_experts(tmp_path):
    path = write_random_checkpoint(str(tmp_path / "m"))   # 8 experts
    full_stats = LoadStats()
    full = load_model(path, stats=full_stats).state_dict()
    expert_keys = {n for n in full if ".mlp.experts." in n}
    seen = set()
    for rank in range(2):
        stats = LoadStats()
        shard = load_model(path, stats=stats, ep=ExpertParallel(rank, 2)).state_dict()
        mine = {n for n in shard if ".mlp.experts." in n}
        assert 2 * len(mine) == len(expert_keys) and not mine & seen
        seen |= mine
        assert all(torch.equal(shard[n], full[n]) for n in shard)
        expert_bytes = sum(full[n].numel() * full[n].element_size() for n in expert_keys)
        assert stats.bytes_read == full_stats.bytes_read - expert_bytes // 2   # never read the others' experts
    assert seen == expert_keys


# ---- the dispatching MoE on its own: 2 spawned ranks, random weights and inputs --------------------------------

def _ep_moe_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    from mtpserve.model.moe import MoE
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cfg = ModelConfig.from_dict(tiny_config(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1))
        torch.manual_seed(0)
        full = MoE(cfg)
        with torch.no_grad():
            for p in full.parameters():
                p.normal_(0, 0.2)
        state = full.state_dict()
        full.fuse()
        for dispatch in (True, False):
            ep = ExpertParallel(rank, 2, dist.group.WORLD, dispatch)
            part = MoE(cfg, ep=ep)
            part.load_state_dict({n: t for n, t in state.items() if n in part.state_dict()})
            part.fuse()
            for n_tokens in (2, 13):   # few choices (one GEMM per expert on all tokens) and many (grouped)
                x = torch.randn(2 * n_tokens + 1, cfg.hidden_size, generator=torch.Generator().manual_seed(n_tokens))
                with torch.inference_mode():
                    if dispatch:   # different tokens, and counts, on each rank
                        mine = x[:n_tokens] if rank == 0 else x[n_tokens:]
                        ep.tokens_per_rank = n_tokens + 1
                        err = (part(mine) - full(mine)).abs().max().item()
                    else:   # tensor-parallel style: every rank has every token; the routed partial sums add up
                        routed = part(x) - part.shared_experts(x)   # (under TP the shared experts are split too)
                        dist.all_reduce(routed)
                        err = (routed - (full(x) - full.shared_experts(x))).abs().max().item()
                results.put((rank, dispatch, n_tokens, err))
    finally:
        dist.destroy_process_group()


def test_expert_parallel_moe_equals_the_whole_moe():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ep_moe_rank, args=(rank, port, results)) for rank in range(2)]
    for p in procs:
        p.start()
    STARTED.extend(p.pid for p in procs)
    try:
        got = [results.get(timeout=120) for _ in range(8)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert len({(r, d, n) for r, d, n, _ in got}) == 8
    assert max(err for *_, err in got) < 1e-5


def test_metrics_report_each_data_parallel_rank():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from mtpserve.serve.metrics import EngineCollector
    ranks = [dict(rank=0, num_running=3, num_waiting=1, kv_usage=0.5), dict(rank=1, num_running=0, num_waiting=0,
                                                                              kv_usage=0.0)]
    snapshot = SimpleNamespace(stats=dict(num_running=3, num_waiting=1, data_parallel_ranks=ranks), spec_metrics={},
                               num_waiting=lambda: 1, num_step_errors=0)
    registry = CollectorRegistry()
    registry.register(EngineCollector(snapshot, "m"))
    text = generate_latest(registry).decode()
    assert 'mtpserve:dp_rank_running{dp_rank="0",model_name="m"} 3.0' in text
    assert 'mtpserve:dp_rank_running{dp_rank="1",model_name="m"} 0.0' in text
    assert 'mtpserve:dp_rank_waiting{dp_rank="0",model_name="m"} 1.0' in text


def test_dp2_structured_outputs_match_one_process(tmp_path):
    """A data-parallel worker rank builds its requests' matchers from the grammar's text: the same tokens as
    one process, with requests on both ranks."""
    from test_server import write_checkpoint
    from test_structured import GRAMMARS, PROMPTS as TEXTS
    path = write_checkpoint(str(tmp_path / "tok"))
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=GRAMMARS[kind])
              for kind in ("json", "regex", "choice", "grammar")]
    want = [o.outputs[0].token_ids for o in LLM(model=path, dtype="float32", speculative_config=spec,
                                                 max_model_len=256, enforce_eager=True).generate(TEXTS, params,
                                                                                                  use_tqdm=False)]
    two = data_parallel(path, speculative_config=spec, max_model_len=256)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(TEXTS, params, use_tqdm=False)]
    finally:
        two.engine.shutdown()
    assert got == want
