"""mtpserve's own CPU kernel (model/csrc/bf16_linear.cpp): built on a CPU with AVX512-BF16, the fp32 sums of a
bf16 product rounded once, a row's bits independent of the batch around it, the same in a CPU graph as eagerly."""
import pytest
import torch
import torch.nn.functional as F

from mtpserve.model import cpu_kernels

pytestmark = pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(),
                                reason="the kernel needs AVX512-BF16; this CPU lacks it (bf16 linears use PyTorch's)")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_kernels.load_bf16_linear(), "the bf16 kernel did not build on a CPU that supports it"


def _bits_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart a and b are, element by element (same sign: adjacent values differ by one)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 512, 256), (3, 4099, 256), (2, 7, 48), (8, 1536, 1000),
                                                           (5, 3, 31)])
def test_bf16_linear_is_the_fp32_sum_rounded_once(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    ours = cpu_kernels.bf16_linear(x, w)
    exact = F.linear(x.double(), w.double()).bfloat16()   # (the sum in fp64, rounded once)
    apart = _bits_apart(ours, exact)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, out_features)
    # fp32 sums in another order than fp64's round to the same bf16 but for a rare tie at a rounding boundary
    assert apart.max() <= 1 and (apart > 0).float().mean() < 0.01


def test_bf16_linear_reads_a_strided_weight_and_rows_as_the_batch_leaves_them():
    """A row's output has the same bits alone or in any batch (so a verify step's rows and a plain decode step's
    one row agree) and on any number of threads, and a weight read in place (an expert's down projection, a
    view) as copied."""
    gen = torch.Generator().manual_seed(0)
    stacked = torch.randn(96, 8, 64, generator=gen).bfloat16()   # [H, E, I], as MoE.fuse stacks w2
    x = torch.randn(6, 64, generator=gen).bfloat16()
    together = cpu_kernels.bf16_linear(x, stacked[:, 3])
    assert torch.equal(together, cpu_kernels.bf16_linear(x, stacked[:, 3].contiguous()))
    for r in range(6):
        assert torch.equal(cpu_kernels.bf16_linear(x[r:r + 1], stacked[:, 3]), together[r:r + 1])
    threads = torch.get_num_threads()
    try:   # torch's threads split the weight's rows: an output's bits do not depend on how many there are
        torch.set_num_threads(2)
        big, rows = torch.randn(4096, 256, generator=gen).bfloat16(), torch.randn(6, 256, generator=gen).bfloat16()
        split = cpu_kernels.bf16_linear(rows, big)
        torch.set_num_threads(1)
        assert torch.equal(split, cpu_kernels.bf16_linear(rows, big))
    finally:
        torch.set_num_threads(threads)
    columns = torch.randn(64, 6, generator=gen).bfloat16().t()   # rows not contiguous: copied first
    assert torch.equal(cpu_kernels.bf16_linear(columns, stacked[:, 3]),
                       cpu_kernels.bf16_linear(columns.contiguous(), stacked[:, 3]))


def test_a_cpu_graph_runs_the_kernel_as_eager_mode_does():
    """layers.linear sends bf16 products of up to FEW_ROWS rows to the kernel, eagerly and inside an inductor graph
    (C++ wrapper, as graph mode compiles): the same bits both ways."""
    from mtpserve.model.layers import FEW_ROWS, linear
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 128, generator=gen).bfloat16()
    x = torch.randn(FEW_ROWS, 128, generator=gen).bfloat16()

    def mlp(x):
        return F.silu(linear(x, w)) * 2

    compiled = torch.compile(mlp, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
    for rows in (1, 3, FEW_ROWS):
        assert torch.equal(compiled(x[:rows]), mlp(x[:rows]))
        assert torch.equal(mlp(x[:rows]), F.silu(cpu_kernels.bf16_linear(x[:rows], w)) * 2)


def test_a_bf16_engine_runs_its_few_row_linears_in_the_kernel_and_mtp_stays_lossless(tmp_path, monkeypatch):
    """A bf16 engine on the CPU loads the kernel with its weights; its decode and verify steps' linears run in it
    (a verify step's rows get a plain step's bits, row by row), and greedy MTP gives the tokens of no MTP."""
    from mtpserve import LLM, SamplingParams
    from tiny_models import trained_checkpoint
    ckpt = trained_checkpoint(tmp_path / "ckpt", num_mtp_layers=1)
    calls = []
    original = cpu_kernels.bf16_linear
    monkeypatch.setattr(cpu_kernels, "bf16_linear", lambda x, w: calls.append(x.shape[0]) or original(x, w))
    prompts = [[5, 8, 11], [20, 21, 22, 23, 24, 25, 26], [30, 32]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    outs = {}
    for name, s in (("plain", None), ("mtp", spec)):
        calls.clear()
        llm = LLM(ckpt, dtype="bfloat16", speculative_config=s, enforce_eager=True)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                   use_tqdm=False)]
        assert calls and max(calls) <= 8   # (prompt chunks and verify steps of more rows: PyTorch's GEMMs)
        if s:
            assert llm.get_metrics()["acceptance_rate"] > 0.3
    assert outs["mtp"] == outs["plain"]
