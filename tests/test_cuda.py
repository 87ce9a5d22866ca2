"""The CUDA checks scripts/gpu_check.sh runs on a GPU machine (collected everywhere, skipped without CUDA, so that
a typo cannot hide until a GPU arrives): CUDA graphs equal eager and the CPU, MTP lossless with CUDA graphs, FP8
weights, int8 refused on CUDA, and a 2-rank NCCL run where two GPUs exist."""
import pytest
import torch
from torch._dynamo.utils import counters

from mtpserve import LLM, SamplingParams
from tiny_models import pattern_batch, trained_checkpoint

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="no CUDA device (scripts/gpu_check.sh runs these on a GPU)")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = pattern_batch(torch.Generator().manual_seed(4), 3, 10).tolist()


@pytest.fixture(autouse=True)
def no_skips_yet():
    counters["inductor"]["cudagraph_skips"] = 0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("cuda") / "m", num_mtp_layers=1)


def recorded(llm) -> bool:
    """Graph mode ran as CUDA graphs: inductor skipped none (it falls back to its kernels, e.g. for a graph that
    writes an input not marked static, such as a KV cache)."""
    return llm.engine.runner.graphs.cuda_graphs and counters["inductor"]["cudagraph_skips"] == 0


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                         use_tqdm=False)]


def test_cuda_graphs_equal_eager_and_the_cpu(ckpt):
    cpu = tokens(LLM(ckpt, device="cpu", dtype="float32", enforce_eager=True))
    assert tokens(LLM(ckpt, device="cuda", dtype="float32", enforce_eager=True)) == cpu
    graphs = LLM(ckpt, device="cuda", dtype="float32", enforce_eager=False, graph_batch_sizes=[1, 4])
    assert tokens(graphs) == cpu and recorded(graphs)


@pytest.mark.parametrize("spec", [{"num_speculative_tokens": 2, "adaptive": False}, {"num_speculative_tokens": 2}],
                         ids=["k2", "adaptive-k2"])
def test_mtp_is_lossless_with_cuda_graphs(ckpt, spec):
    plain = tokens(LLM(ckpt, device="cuda", dtype="float32", enforce_eager=False, graph_batch_sizes=[4]))
    llm = LLM(ckpt, device="cuda", dtype="float32", enforce_eager=False, graph_batch_sizes=[4],
              speculative_config=spec)
    assert tokens(llm) == plain and llm.get_metrics()["num_accepted_tokens"] > 0 and recorded(llm)


def test_fp8_weights_on_cuda_with_and_without_mtp(ckpt):
    # (one graph batch size: the default six took over 300 s to compile on the H200 machine's first run)
    plain = tokens(LLM(ckpt, device="cuda", quantization="fp8", dtype="float32", graph_batch_sizes=[4]))
    mtp = LLM(ckpt, device="cuda", quantization="fp8", dtype="float32", graph_batch_sizes=[4],
              speculative_config={"num_speculative_tokens": 2, "adaptive": False})
    assert tokens(mtp) == plain


def test_int8_is_refused_on_cuda(ckpt):
    with pytest.raises(ValueError, match="quantization = 'int8': CPU only"):
        LLM(ckpt, device="cuda", quantization="int8")


@pytest.mark.skipif(CUDA and torch.cuda.device_count() < 2, reason="one GPU: the 2-rank NCCL run needs two")
def test_tensor_parallel_over_nccl_equals_one_gpu(ckpt):
    one = tokens(LLM(ckpt, device="cuda", dtype="float32"))
    two = LLM(ckpt, device="cuda", dtype="float32", tensor_parallel_size=2)
    try:
        assert tokens(two) == one
    finally:
        two.engine.shutdown()
