"""Graph mode: uniform decode/verify steps as compiled fixed-shape graphs; outputs identical to eager, and
no recompilation once the graphs are built."""
import pytest
import torch
from torch._dynamo.utils import counters

from mtpserve import LLM, SamplingParams
from tiny_models import trained_checkpoint

# 3 requests with different lengths: the decode batch shrinks 3 -> 2 -> 1, hitting graph size 2 exactly,
# padding 3 -> 4 and 1 -> 1; a 5th and 6th request make a batch above the largest graph (eager).
PROMPTS = [[5, 8, 11], [20, 21, 22, 23, 24, 25, 26], [30, 32], [2, 5, 8, 11, 14], [40, 41], [9, 12, 15]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in [16, 10, 4, 12, 6, 3]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("graphs"), num_mtp_layers=1)


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 2}], ids=["plain", "mtp-k2"])
def test_graph_mode_identical_to_eager_and_no_recompiles(ckpt, spec):
    eager = LLM(ckpt, speculative_config=spec, enforce_eager=True)
    graph = LLM(ckpt, speculative_config=spec, enforce_eager=False, graph_batch_sizes=[1, 2, 4], max_model_len=64)
    assert graph.engine.graph_warmup_seconds > 0
    frames_after_warmup = counters["stats"]["unique_graphs"]
    runs = {"graph": 0, "eager": 0}
    graphs = graph.engine.runner.graphs
    original = graphs.run

    def counting_run(*args, **kwargs):
        runs["graph"] += 1
        return original(*args, **kwargs)
    graphs.run = counting_run
    for prompts, params in [(PROMPTS[:3], PARAMS[:3]), (PROMPTS, PARAMS)]:
        want = eager.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        got = graph.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert runs["graph"] > 0
    assert counters["stats"]["unique_graphs"] == frames_after_warmup, "recompiled after warm-up"
    bm = graph.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
