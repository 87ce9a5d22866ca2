"""Graph mode: uniform decode/verify steps as compiled fixed-shape graphs; outputs identical to eager, and
no recompilation once the graphs are built."""
import os
import time

import pytest
import torch
from torch._dynamo.utils import counters

from mtpserve import LLM, SamplingParams
from mtpserve.runner.direct_call import DirectCall
from mtpserve.step import FUSED
from tiny_models import trained_checkpoint

# 3 requests with different lengths: the decode batch shrinks 3 -> 2 -> 1, hitting graph size 2 exactly (sizes
# 1, 2, 4; with 1 and 4, 2 pads too), padding 3 -> 4 and 1 -> 1; a 5th and 6th request make a batch above the
# largest graph (eager). (Every graph costs 20-50 s to compile here: the MTP cases build fewer sizes.)
PROMPTS = [[5, 8, 11], [20, 21, 22, 23, 24, 25, 26], [30, 32], [2, 5, 8, 11, 14], [40, 41], [9, 12, 15]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in [16, 10, 4, 12, 6, 3]]
# seeded sampling (the same tokens with or without speculation, in graphs or eagerly) beside a greedy request
SAMPLED = [SamplingParams(temperature=1.5, top_p=0.95, min_p=0.05, max_tokens=16, ignore_eos=True, seed=7),
           SamplingParams(temperature=2.0, top_k=20, frequency_penalty=0.5, max_tokens=12, ignore_eos=True, seed=3),
           SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("graphs"), num_mtp_layers=1)


@pytest.fixture(scope="module")
def ckpt2(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("graphs2"), num_mtp_layers=2)


@pytest.mark.parametrize("spec, overlap, sizes", [
    (None, False, [1, 2, 4]), ({"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}, True, [1, 4]),
    ({"method": "mtp", "num_speculative_tokens": 2, "adaptive": False, "fused_graph_step": False}, False, [1, 4])],
    ids=["plain", "mtp-k2-overlap", "mtp-k2-unfused"])
def test_graph_mode_identical_to_eager_and_no_recompiles(ckpt, spec, overlap, sizes):
    """(With overlap, the graphs built at start-up run on the model thread.)"""
    check_graph_mode(ckpt, spec, sizes, overlap)


def test_graph_mode_two_mtp_layers(ckpt2):
    """A checkpoint with two MTP layers, k=3: the fused step chains layer 1 for depth 2 and drafts depth 3
    with layer 0 as eager does (the same acceptance at every position). Steps of requests that process their
    logits on the host (logit_bias here) run apart, the chain's passes as graphs of their own, built by the
    compiler thread when first needed (eager until then): the same tokens and logprobs as eager."""
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
    graph = check_graph_mode(ckpt2, spec, [4])
    graphs = graph.engine.runner.graphs
    assert {str(which) for which, _ in graphs.later} == {"main", "mtp0", "mtp1"}
    assert graph.get_metrics()["acceptance_rate"] > 0.3
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logit_bias={7: 2.0}, logprobs=2)
              for n in (14, 9, 5)]
    eager = LLM(ckpt2, speculative_config=spec, enforce_eager=True)
    want = eager.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params, use_tqdm=False)
    got = graph.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params, use_tqdm=False)   # (queues them)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    graphs.drain()
    assert {str(which) for which, _, _ in graphs.graphs} == {"main", "fused", "fused_sampled", "mtp0", "mtp1"}
    passes = []
    original = graphs.run
    graphs.run = lambda which, *args, **kwargs: passes.append(str(which)) or original(which, *args, **kwargs)
    got = graph.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [list(p) for p in g.outputs[0].logprobs] == [list(p) for p in w.outputs[0].logprobs]
        assert [p[t].logprob for p, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)] == pytest.approx(
            [p[t].logprob for p, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)], abs=1e-4)
    assert {"main", "mtp0", "mtp1"} <= set(passes)


def check_graph_mode(ckpt, spec, sizes, overlap=False):
    """Graph mode gives eager's tokens, greedy and seeded sampling (MTP decode steps run fused:
    spec_decode/fused.py), and the same acceptance at every draft position (the same drafts)."""
    eager = LLM(ckpt, speculative_config=spec, enforce_eager=True)
    graph = LLM(ckpt, speculative_config=spec, enforce_eager=False, graph_batch_sizes=sizes, max_model_len=64,
                overlap=overlap)
    assert graph.engine.graph_warmup_seconds > 0
    frames_after_warmup, built_at_warmup = counters["stats"]["unique_graphs"], len(graph.engine.runner.graphs.graphs)
    runs = {"graph": 0, "eager": 0}
    graphs = graph.engine.runner.graphs
    for name in ("run", "run_fused"):
        original = getattr(graphs, name)

        def counting_run(*args, original=original, **kwargs):
            runs["graph"] += 1
            return original(*args, **kwargs)
        setattr(graphs, name, counting_run)
    for prompts, params in [(PROMPTS[:3], PARAMS[:3]), (PROMPTS, PARAMS), (PROMPTS[:3], SAMPLED)]:
        want = eager.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        got = graph.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # logprobs: read from the step's hidden states, in the fused step too (the same rows as eager)
    fused_before = graph.engine.runner.pass_counts["fused"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (12, 7, 4)]
    want = eager.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params, use_tqdm=False)
    got = graph.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for entry_g, entry_w in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert list(entry_g) == list(entry_w)
            assert [lp.logprob for lp in entry_g.values()] == pytest.approx(
                [lp.logprob for lp in entry_w.values()], abs=1e-4)
    if spec is not None and spec.get("fused_graph_step", True):
        assert graph.engine.runner.pass_counts["fused"] > fused_before
    assert runs["graph"] > 0
    graphs.drain()   # (graphs built when first needed: each compiled once)
    assert (counters["stats"]["unique_graphs"] - frames_after_warmup == len(graphs.graphs) - built_at_warmup), \
        "recompiled after warm-up"
    # each CPU graph is called as the plain function dynamo made of its step, not through torch.compile's hook, and
    # (a fixed batch) straight into its compiled C++, not through that function either
    assert not any(hasattr(fn, "_torchdynamo_orig_callable") for fn, _ in graphs.graphs.values())
    assert all(isinstance(fn, DirectCall) for fn, _ in graphs.graphs.values())
    bm = graph.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    if spec is not None:
        fused = spec.get("fused_graph_step", True)
        assert (graph.engine.runner.pass_counts["fused"] > 0) == fused
        assert (graph.engine.runner.pass_counts["fused_sampled"] > 0) == fused
        assert graph.get_metrics()["accepted_per_position"] == eager.get_metrics()["accepted_per_position"]
    return graph


def test_one_graph_serves_every_batch_above_few_rows(ckpt):
    """On the CPU batches above FEW_ROWS rows share one graph per kind with a dynamic batch, unpadded (12
    requests finishing one by one: steps of 12, 11, ... 9 rows, then fewer padded to 9): eager's tokens, greedy
    and seeded sampling, and no recompiling."""
    from mtpserve.model.layers import FEW_ROWS
    from mtpserve.runner.graphs import MANY
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    prompts = [[3 + i, 7 + 2 * i, 11] for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(12)]
    sampled = [SamplingParams(temperature=1.2, top_p=0.9, max_tokens=4 + 2 * i, ignore_eos=True, seed=i)
               for i in range(12)]
    eager = LLM(ckpt, speculative_config=spec, enforce_eager=True, max_num_seqs=16)
    graph = LLM(ckpt, speculative_config=spec, enforce_eager=False, graph_batch_sizes=[16], max_model_len=64,
                max_num_seqs=16)
    graphs = graph.engine.runner.graphs
    assert {size for _, size, _ in graphs.graphs} == {MANY}
    compiled, built = counters["stats"]["unique_graphs"], len(graphs.graphs)
    sizes = []
    run_fused = graphs.run_fused
    graphs.run_fused = lambda what, rows, *a: sizes.append(len(rows)) or run_fused(what, rows, *a)
    for p in (params, sampled):
        want = eager.generate(prompt_token_ids=prompts, sampling_params=p, use_tqdm=False)
        got = graph.generate(prompt_token_ids=prompts, sampling_params=p, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len({n for n in sizes if n > FEW_ROWS}) >= 3 and min(sizes) <= FEW_ROWS
    graphs.drain()
    assert counters["stats"]["unique_graphs"] - compiled == len(graphs.graphs) - built, "recompiled after warm-up"


def test_graph_mode_flags():
    """--graph-mode asks for graphs (also on the CPU), --graph-batch-sizes sets the sizes, and asking for
    graphs and for eager at once is refused."""
    import argparse
    from mtpserve.engine_args import add_engine_args, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kw = engine_kwargs(parser.parse_args(["--graph-mode", "--graph-batch-sizes", "1,4"]))
    assert kw["enforce_eager"] is False and kw["graph_batch_sizes"] == [1, 4]
    assert engine_kwargs(parser.parse_args([]))["enforce_eager"] is None   # default: graphs on CUDA only
    assert engine_kwargs(parser.parse_args(["--graph-mode", "--compile-in-background"]))["compile_in_background"]
    with pytest.raises(SystemExit, match="choose one"):
        engine_kwargs(parser.parse_args(["--graph-mode", "--enforce-eager"]))


def test_kv_bucket_covers_the_kv_exactly_on_cpu_and_in_powers_of_two_for_cuda_graphs():
    from mtpserve.runner.graphs import GraphRunner
    runner = GraphRunner(None, [], [], [1], block_size=16, max_span=200, device="cpu")   # 13 blocks at most
    assert [runner.kv_bucket(n) for n in (1, 16, 17, 33, 64, 65, 129, 200)] == [2, 2, 2, 3, 4, 5, 9, 13]
    assert runner.warm_up_buckets() == [2, 13]
    runner.cuda_graphs = True   # (the bucket arithmetic only; nothing is captured here)
    assert [runner.kv_bucket(n) for n in (1, 16, 17, 33, 64, 65, 129, 200)] == [2, 2, 2, 4, 4, 8, 13, 13]
    assert runner.warm_up_buckets() == [2, 4, 8, 13]
    for kv_len in range(1, 201):
        bucket = runner.kv_bucket(kv_len)
        assert bucket * 16 >= kv_len and bucket <= 13
        assert bucket == 13 or (bucket >= 2 and bucket & (bucket - 1) == 0)


@pytest.mark.parametrize("num_tokens", [3, 6])
def test_compiled_moe_paths_match_eager_in_bf16(num_tokens):
    """Inside a CPU graph a few tokens run as (token, expert) GEMV pairs and more (in bf16) as one grouped GEMM
    pair; both agree with the eager expert loop to bf16 rounding."""
    from mtpserve.config import ModelConfig
    from mtpserve.model import moe
    from mtpserve.model.checkpoint import tiny_config
    cfg = ModelConfig.from_dict(tiny_config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8,
                                            num_experts_per_tok=2, n_group=1, topk_group=1))
    torch.manual_seed(0)
    layer = moe.MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer = layer.to(torch.bfloat16).eval()
    layer.fuse()
    x = torch.randn(num_tokens, 64, dtype=torch.bfloat16)
    with torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)(x)
    assert (compiled.float() - eager.float()).abs().max() <= 0.02 * eager.float().abs().max()


def test_a_cpu_graph_routes_tokens_as_eager_mode_does():
    """In a CPU graph over a few tokens the router's product is a fused sum and its top-k a ranking by comparisons
    (moe._top): the same experts as eager mode's GEMM and topk, in the same order, with masked (-inf) groups."""
    from mtpserve.config import ModelConfig
    from mtpserve.model import moe
    from mtpserve.model.checkpoint import tiny_config
    cfg = ModelConfig.from_dict(tiny_config(hidden_size=64, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                                            topk_group=2))
    torch.manual_seed(0)
    gate = moe.Gate(cfg)
    torch.nn.init.normal_(gate.weight)
    torch.nn.init.normal_(gate.e_score_correction_bias, std=0.1)
    x = torch.randn(24, 64)
    top = torch.compile(lambda s: moe._top(s, 3), fullgraph=True, dynamic=False)
    with torch.no_grad():
        scores = torch.randn(24, 16).masked_fill(torch.rand(24, 16) < 0.3, float("-inf"))
        assert torch.equal(top(scores), scores.topk(3, dim=-1).indices)
        weights, ids = gate(x)
        compiled_weights, compiled_ids = torch.compile(gate, fullgraph=True, dynamic=False)(x)
    assert torch.equal(compiled_ids, ids) and torch.allclose(compiled_weights, weights, atol=1e-6)


def test_compile_in_background_serves_at_once_then_runs_the_graph(ckpt, tmp_path, monkeypatch):
    """compile_in_background: nothing is built at start-up; the first decode step queues its fused graph and
    runs eagerly; the compiler process compiles it cold, then the compiler thread builds it from the cache (an
    empty one: it hits only what that process wrote); steps then run it, with eager's tokens throughout. Only the
    start-up shapes are queued (a prompt chunk's shape is not). Shutting down ends the compiler process."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    hits = counters["inductor"]["fxgraph_cache_hit"]
    spec = {"method": "mtp", "num_speculative_tokens": 1, "adaptive": False}
    eager = LLM(ckpt, speculative_config=spec, enforce_eager=True)
    graph = LLM(ckpt, speculative_config=spec, enforce_eager=False, graph_batch_sizes=[1], max_model_len=64,
                compile_in_background=True)
    graphs = graph.engine.runner.graphs
    assert graph.engine.graph_warmup_seconds == 0 and not graphs.graphs
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params,
                                                            use_tqdm=False)]
    deadline = time.monotonic() + 600
    while (FUSED, 1, 2) not in graphs.graphs:
        got = graph.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        assert time.monotonic() < deadline, "the background compiler built nothing in 600 s"
        time.sleep(0.5)
    assert (FUSED, 1, 2) in graphs._queued and all(q <= 2 for _, _, q in graphs._queued)
    runs = []
    run_fused = graphs.run_fused
    graphs.run_fused = lambda *a, **kw: runs.append(1) or run_fused(*a, **kw)
    got = graph.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want and runs
    assert counters["inductor"]["fxgraph_cache_hit"] > hits and graphs.compile_elsewhere.pids
    graph.engine.shutdown()
    assert not graphs._compiler.is_alive() and not any(running(pid) for pid in graphs.compile_elsewhere.pids)


@pytest.mark.parametrize("kwargs, why", [
    (dict(enforce_eager=True), "graph mode only"),
    (dict(enforce_eager=False, tensor_parallel_size=2), "one process only")])
def test_compile_in_background_refused_where_it_cannot_work(ckpt, kwargs, why):
    with pytest.raises(ValueError, match=f"compile_in_background: .*{why}"):
        LLM(ckpt, compile_in_background=True, **kwargs)


SERVING_PROCESS = """
import sys, time
from mtpserve import LLM, SamplingParams
llm = LLM(sys.argv[1], speculative_config={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False},
          enforce_eager=False, graph_batch_sizes=[1], max_model_len=64, compile_in_background=True)
llm.generate(prompt_token_ids=[[5, 8, 11]], sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)
started = llm.engine.runner.graphs.compile_elsewhere.pids   # (by the compiler thread, for the graph queued)
while not started:
    time.sleep(0.1)
print(started[0], flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's exit status waits for a reaper that may never come)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_compiler_process_ends_when_the_serving_process_is_killed(ckpt, tmp_path):
    """A serving process killed outright (no shutdown, no atexit) leaves no compiler process behind."""
    import signal
    import subprocess
    import sys
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))   # (cold: it is still compiling)
    serving = subprocess.Popen([sys.executable, "-c", SERVING_PROCESS, ckpt], stdout=subprocess.PIPE, env=env)
    compiler = None
    try:
        compiler = int(serving.stdout.readline())
        time.sleep(8)   # (started, the rank built, compiling cold: tens of seconds to go)
        assert running(compiler)
        serving.kill()
        serving.wait(30)
        deadline = time.monotonic() + 5   # (well inside the compile: it does not wait for the graph)
        while running(compiler):
            assert time.monotonic() < deadline, "the compiler process outlived the serving process by 5 s"
            time.sleep(0.2)
    finally:
        serving.kill()
        if compiler is not None:
            try:
                os.kill(compiler, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_closed_compiler_process_never_starts_again():
    """Shutdown closes it: a graph asked for afterwards (the compiler thread finding its process gone at exit)
    starts no process; one started with its parent already gone (passed in, here pid 1: not its parent) ends at
    once, though its requests pipe stays open."""
    import subprocess
    import sys
    from mtpserve.executor.compile_process import CompileProcess
    closed = CompileProcess(setup=None)
    closed.close()
    assert closed((FUSED, 1, 2)) is False and not closed.pids
    orphan = subprocess.Popen([sys.executable, "-m", "mtpserve.executor.compile_process", "1"], stdin=subprocess.PIPE)
    try:
        assert orphan.wait(30) == 0
    finally:
        orphan.kill()
