"""mtpserve's own CPU kernels (model/csrc/): built on a CPU with AVX512-BF16. bf16_linear: the fp32 sums of a bf16
product rounded once, a row's bits independent of the batch around it, the same in a CPU graph as eagerly.
latent_attention: MLA's absorbed attention against the same attention in fp64, masked rows, a graph's bits, the paged
cache read in place. routed_experts: the grouped Python path's bits.
int8_linear: the exact integer sum of x in 16-bit fixed point and int8 weights, scaled and rounded, a row's bits
independent of the batch; bf16_bmm and fp32_linear as bf16_linear;
fp32_columns_linear (fp32 weights stored by columns) likewise.
The CPU allocator that keeps freed tensor memory: blocks reused by size class, aligned, data kept intact."""
import pytest
import torch
import torch.nn.functional as F

from mtpserve.model import cpu_kernels

pytestmark = pytest.mark.skipif(not torch.cpu._is_avx512_bf16_supported(),
                                reason="the kernel needs AVX512-BF16; this CPU lacks it (bf16 linears use PyTorch's)")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_kernels.load(), "the kernels did not build on a CPU that supports them"


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
    # one row reads a weight row after another, more rows read the rows side by side: the same sums, tails too
    odd, wide = torch.randn(5, 1000, generator=gen).bfloat16(), torch.randn(2051, 1000, generator=gen).bfloat16()
    for take in (2, 3, 5):
        together = cpu_kernels.bf16_linear(odd[:take], wide)
        for r in range(take):
            assert torch.equal(cpu_kernels.bf16_linear(odd[r:r + 1], wide), together[r:r + 1])
    columns = torch.randn(64, 6, generator=gen).bfloat16().t()   # rows not contiguous: copied first
    assert torch.equal(cpu_kernels.bf16_linear(columns, stacked[:, 3]),
                       cpu_kernels.bf16_linear(columns.contiguous(), stacked[:, 3]))


def test_a_cpu_graph_runs_the_kernels_as_eager_mode_does():
    """layers.linear sends bf16 and int8 products to the kernels, eagerly and inside an inductor graph (C++ wrapper,
    as graph mode compiles): the same bits both ways."""
    from mtpserve.model.int8 import quantize_rows
    from mtpserve.model.layers import FEW_ROWS, linear
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 128, generator=gen).bfloat16()
    x = torch.randn(FEW_ROWS, 128, generator=gen).bfloat16()

    def mlp(x):
        return F.silu(linear(x, w)) * 2

    q = quantize_rows(w.float(), torch.bfloat16)

    def int8_mlp(x):
        return F.silu(linear(x, q)) * 2

    compiled = torch.compile(mlp, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
    int8_compiled = torch.compile(int8_mlp, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
    for rows in (1, 3, FEW_ROWS):
        assert torch.equal(compiled(x[:rows]), mlp(x[:rows]))
        assert torch.equal(mlp(x[:rows]), F.silu(cpu_kernels.bf16_linear(x[:rows], w)) * 2)
        assert torch.equal(int8_compiled(x[:rows]), int8_mlp(x[:rows]))
        assert torch.equal(int8_mlp(x[:rows]), F.silu(cpu_kernels.int8_linear(x[:rows], q.data, q.scale)) * 2)


def _fixed_point_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row of bf16 x as csrc/int8_linear.cpp takes it, in fp64: integers at a power of two, the row's largest
    value under 2^15 (rounded to nearest, ties to even)."""
    exponent = torch.frexp(x.float().abs().amax(-1, keepdim=True)).exponent.double()
    return torch.round(x.double() * 2.0 ** (15 - exponent)) * 2.0 ** (exponent - 15)


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 512, 256), (3, 4099, 256), (8, 100, 37), (5, 3, 300),
                                                           (40, 96, 64), (2, 24, 9000), (1, 40, 5000)])
def test_int8_linear_is_the_exact_integer_sum_scaled_and_rounded(rows, out_features, in_features):
    """A row of x in 16-bit fixed point times the int8 weight, summed exactly (in fp64 here), scaled by the row's
    scale, rounded to bf16: at most one bf16 step apart (the int32 lanes' fp32 sums, two roundings), rarely any. The
    fixed point is within 2^-15 of the row's largest value of x (half its step)."""
    from mtpserve.model.int8 import quantize_rows
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    w = quantize_rows(torch.randn(out_features, in_features, generator=gen), torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    fixed = _fixed_point_rows(x)
    assert ((fixed - x.double()).abs() <= x.double().abs().amax(-1, keepdim=True) * 2.0 ** -15).all()
    ours = cpu_kernels.int8_linear(x, w.data, w.scale)
    exact = (F.linear(fixed, w.data.double()) * w.scale.double()).bfloat16()   # (fp64, rounded once)
    apart = _bits_apart(ours, exact)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, out_features)
    assert apart.max() <= 1 and (apart > 0).float().mean() < 0.01


def test_int8_linear_sums_the_largest_products_without_overflow():
    """Every product at its largest (x just under a power of two, weights +-127) over 9,000 values: the int32 lanes
    move to fp32 often enough (csrc/int8_linear.cpp's chunk) to give the exact sum."""
    x = torch.full((2, 9000), 1.9921875).bfloat16()   # (bf16's largest value under 2: 32,640 at its power of two)
    x[1] = -x[1]
    w = torch.full((16, 9000), 127, dtype=torch.int8)
    w[1::2] = -127
    scale = torch.ones(16).bfloat16()
    want = (x.double() @ w.double().T).bfloat16()
    assert torch.equal(cpu_kernels.int8_linear(x, w, scale), want)


def test_int8_linear_gives_a_row_the_same_bits_in_any_batch_and_reads_an_experts_weight_in_place():
    """As bf16_linear: a row alone or in a batch, on one thread or two; an expert's down projection and its scales
    read in place (MoE.fuse stacks int8 experts expert-major and views them [H, E, I], scales [H, E])."""
    gen = torch.Generator().manual_seed(0)
    stacked = torch.randint(-127, 128, (8, 96, 64), dtype=torch.int8, generator=gen).movedim(0, 1)   # [H, E, I]
    scales = (torch.rand(96, 8, generator=gen) / 100).bfloat16()
    w, s = stacked[:, 3], scales[:, 3]
    assert s.stride(0) == 8
    x = torch.randn(6, 64, generator=gen).bfloat16()
    together = cpu_kernels.int8_linear(x, w, s)
    assert torch.equal(together, cpu_kernels.int8_linear(x, w.contiguous(), s.contiguous()))
    for r in range(6):
        assert torch.equal(cpu_kernels.int8_linear(x[r:r + 1], w, s), together[r:r + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        big = torch.randint(-127, 128, (4096, 256), dtype=torch.int8, generator=gen)
        big_scales, rows = torch.rand(4096, generator=gen).bfloat16(), torch.randn(3, 256, generator=gen).bfloat16()
        split = cpu_kernels.int8_linear(rows, big, big_scales)
        torch.set_num_threads(1)
        assert torch.equal(split, cpu_kernels.int8_linear(rows, big, big_scales))
    finally:
        torch.set_num_threads(threads)


def test_bf16_bmm_is_bf16_linear_per_batch_entry_and_fp32_linear_the_fp32_sum():
    """bf16_bmm (MLA's per-head projections): entry b is bf16_linear(x[b], weight[b]), for x a strided view as the
    heads leave it. fp32_linear (the router): within fp32 rounding of the fp64 sum. Both give a row the same bits
    alone or in any batch."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 8, 48, generator=gen).bfloat16()[..., :32]   # [N, H, 32] of a wider row
    w = torch.randn(8, 40, 32, generator=gen).bfloat16()            # [H, out, in]
    heads = cpu_kernels.bf16_bmm(q.transpose(0, 1), w)
    for h in range(8):
        assert torch.equal(heads[h], cpu_kernels.bf16_linear(q[:, h].contiguous(), w[h]))
    assert torch.equal(cpu_kernels.bf16_bmm(q[:1].transpose(0, 1), w), heads[:, :1])
    x, router = torch.randn(37, 300, generator=gen), torch.randn(9, 300, generator=gen)
    logits = cpu_kernels.fp32_linear(x, router)
    assert (logits.double() - F.linear(x.double(), router.double())).abs().max() < 1e-4
    for r in (0, 17, 36):
        assert torch.equal(cpu_kernels.fp32_linear(x[r:r + 1], router), logits[r:r + 1])


def test_every_routed_experts_path_gives_a_token_the_same_bits():
    """bf16, top-3 of 6 experts: a graph's few tokens (each choice its own GEMM pair), a few tokens eagerly (each
    expert chosen on all tokens) and many tokens (grouped by expert) sum a token's experts in one order, through the
    row-independent kernel: a token's output has the same bits on every path and among any other tokens."""
    from mtpserve.model.moe import _chosen_pairs, _hit_experts
    gen = torch.Generator().manual_seed(4)
    w13 = torch.randn(6, 2 * 32, 64, generator=gen).bfloat16()
    w2 = torch.randn(64, 6, 32, generator=gen).bfloat16()
    x = torch.randn(5, 64, generator=gen).bfloat16()
    weights, ids = torch.rand(5, 6, generator=gen).bfloat16().topk(3, dim=-1)
    weights, ids = weights.flip(-1), ids.flip(-1)   # (largest weight last: not id order)
    alone = _hit_experts(x[:1], weights[:1], ids[:1], w13, w2)   # 3 choices: the few-tokens path
    assert torch.equal(_chosen_pairs(x[:1], weights[:1], ids[:1], w13, w2), alone)
    assert torch.equal(_hit_experts(x, weights, ids, w13, w2)[:1], alone)   # 15 choices: grouped by expert
    assert torch.equal(_chosen_pairs(x, weights, ids, w13, w2)[:1], alone)


@pytest.mark.parametrize("kind", ["bf16", "bf16_side_by_side", "int8", "fp32"])
@pytest.mark.parametrize("tokens,k,experts,hidden,inter", [(32, 2, 8, 256, 256), (5, 3, 6, 40, 24), (1, 1, 4, 16, 8)])
def test_routed_experts_kernel_gives_the_grouped_paths_bits(tokens, k, experts, hidden, inter, kind):
    """csrc/routed_experts.cpp against model/moe.py's `_grouped` (the same products through bf16_linear, int8_linear
    or, in fp32, the column kernel up to FEW_ROWS rows of an expert and ATen's linear above, then ATen's silu and
    mul, the fp32 sum in expert id order): bit for bit, with experts nobody chose, choices of an expert held
    elsewhere (id E, expert parallelism) and a token all of whose experts are elsewhere. The experts stacked as
    MoE.fuse stacks them on the CPU (w2 expert-major, viewed [H, E, I]; fp32: stored by columns), and bf16 also side
    by side (as on CUDA, and as training's unfused experts reach the kernel)."""
    from mtpserve.model.int8 import Int8Weight, quantize_rows
    from mtpserve.model.layers import FEW_ROWS, by_columns
    from mtpserve.model.moe import _grouped
    gen = torch.Generator().manual_seed(tokens + k)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen).to(dtype)
    w2 = torch.randn(hidden, experts, inter, generator=gen).to(dtype) / 4
    if kind == "int8":
        parts = [quantize_rows(w, torch.bfloat16) for w in w13]
        w13 = Int8Weight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]))
        parts = [quantize_rows(w2[:, e], torch.bfloat16) for e in range(experts)]
        w2 = Int8Weight(torch.stack([p.data for p in parts]).movedim(0, 1),
                        torch.stack([p.scale for p in parts]).movedim(0, 1))
    if kind == "fp32":
        w13, w2 = by_columns(w13), by_columns(w2.movedim(1, 0)).movedim(0, 1)
    if kind == "bf16":
        w2 = w2.movedim(1, 0).contiguous().movedim(0, 1)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, ids = torch.rand(tokens, experts - 1, generator=gen).to(dtype).topk(k, dim=-1)   # (expert E-1: none)
    assert cpu_kernels.experts_usable(x, weights, w13, w2)
    bits = torch.int32 if kind == "fp32" else torch.int16

    def kernel(chosen):
        return cpu_kernels.routed_experts(x, weights, chosen, w13, w2, FEW_ROWS)
    assert torch.equal(kernel(ids).view(bits), _grouped(x, weights, ids, w13, w2).view(bits))
    elsewhere = ids.masked_fill(torch.rand(ids.shape, generator=gen) < 0.3, experts)
    elsewhere[0] = experts
    got = kernel(elsewhere)
    assert torch.equal(got.view(bits), _grouped(x, weights, elsewhere, w13, w2).view(bits))
    assert torch.equal(got[0], torch.zeros(hidden, dtype=dtype))
    with pytest.raises(RuntimeError, match="outside"):
        kernel(ids + experts + 1)


def _attention_in_fp64(q, keys, mask, scale, value_dim):
    rows_per_mask_row = q.shape[1] // mask.shape[1]
    scores = (q.double() @ keys.double().transpose(1, 2)) * scale
    scores = scores.masked_fill(~mask.repeat(1, rows_per_mask_row, 1), float("-inf"))
    return scores.softmax(-1) @ keys[..., :value_dim].double()


@pytest.mark.parametrize("batch,heads,queries,keys_len,dim,value_dim", [
    (1, 8, 1, 160, 144, 128),   # the shipped model's decode step: 8 heads, latent 128 + rope 16
    (2, 8, 3, 37, 144, 128),    # MTP k = 2 verify, two requests
    (3, 5, 2, 17, 40, 33),      # tails everywhere: rows, positions, dimensions, value columns
    (1, 16, 1, 300, 576, 512)])  # DeepSeek-V3's latent 512 + rope 64
def test_latent_attention_is_the_attention_in_fp64_rounded_once(batch, heads, queries, keys_len, dim, value_dim):
    """Rows are heads x query tokens; row i attends where mask row i % queries allows (each request's own
    positions up to its query's). The cached keys are read in place from a longer buffer, as a step slices them."""
    gen = torch.Generator().manual_seed(keys_len)
    q = torch.randn(batch, heads * queries, dim, generator=gen).bfloat16()
    buffer = torch.randn(batch, keys_len + 16, dim, generator=gen).bfloat16()
    keys = buffer[:, :keys_len]
    pos = torch.randint(keys_len // 2, keys_len, (batch, queries), generator=gen)
    mask = torch.arange(keys_len)[None, None, :] <= pos[:, :, None]
    scale = dim ** -0.5
    ours = cpu_kernels.latent_attention(q, keys, mask, scale, value_dim)
    want = _attention_in_fp64(q, keys, mask, scale, value_dim)
    assert ours.dtype == torch.bfloat16 and ours.shape == (batch, heads * queries, value_dim)
    # fp32 scores and weights, the output rounded once: within a bf16 step of the fp64 result, or near zero
    assert ((ours.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-3).all()


def test_latent_attention_ignores_masked_positions_and_gives_a_row_the_same_bits_in_any_batch():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 144, generator=gen).bfloat16()
    keys = torch.randn(2, 40, 144, generator=gen).bfloat16()
    mask = torch.arange(40)[None, None, :] < torch.tensor([25, 40])[:, None, None]
    out = cpu_kernels.latent_attention(q, keys, mask, 0.1, 128)
    far = keys.clone()
    far[0, 25:] = 1e4   # masked: no weight, whatever they hold
    assert torch.equal(cpu_kernels.latent_attention(q, far, mask, 0.1, 128), out)
    assert torch.equal(cpu_kernels.latent_attention(q[1:], keys[1:], mask[1:], 0.1, 128), out[1:])


def test_latent_attention_reads_a_paged_cache_in_place_with_the_gathered_keys_bits():
    """With block_tables, keys is the cache [blocks, block_size, D]: request b's position p is row p % block_size of
    block block_tables[b, p // block_size]. The same bits as the keys gathered into [B, L, D] (L: 37, not a whole
    number of blocks; tables padded with block 0 past it); a block id outside the cache is refused."""
    gen = torch.Generator().manual_seed(9)
    cache = torch.randn(12, 16, 144, generator=gen).bfloat16()
    tables = torch.tensor([[3, 7, 1, 0], [11, 2, 5, 9]])
    q = torch.randn(2, 24, 144, generator=gen).bfloat16()
    mask = torch.arange(37)[None, None, :] <= torch.tensor([[30, 31, 32], [34, 35, 36]])[:, :, None]
    gathered = cache[tables].flatten(1, 2)[:, :37]
    want = cpu_kernels.latent_attention(q, gathered, mask, 0.1, 128)
    assert torch.equal(cpu_kernels.latent_attention(q, cache, mask, 0.1, 128, tables), want)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.latent_attention(q, cache, mask, 0.1, 128, tables + 5)


def test_a_cpu_graph_runs_the_attention_kernel_as_eager_mode_does():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 24, 144, generator=gen).bfloat16()
    keys = torch.randn(1, 48, 144, generator=gen).bfloat16()
    mask = torch.arange(48)[None, None, :] <= torch.tensor([[45, 46, 47]])[:, :, None]

    def attend(q, keys, mask):
        return cpu_kernels.latent_attention(q * 2, keys, mask, 0.125, 128).float().sum(-1)

    compiled = torch.compile(attend, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
    assert torch.equal(compiled(q, keys, mask), attend(q, keys, mask))


def test_freed_cpu_tensor_memory_is_handed_out_again_by_size_class_and_large_blocks_are_not_kept():
    first, neighbour = torch.empty(2100, dtype=torch.uint8), torch.empty(2100, dtype=torch.uint8)
    address = first.data_ptr()
    del first
    # the same class (2,049 .. 4,096 bytes) and larger than the freed tensor: glibc's malloc cannot serve it there
    again = torch.empty(4000, dtype=torch.uint8)
    assert again.data_ptr() == address and address % 64 == 0
    other = torch.empty(5000, dtype=torch.uint8)   # (the next class: another block)
    assert other.data_ptr() not in (address, neighbour.data_ptr())
    values = torch.arange(1000, dtype=torch.float32)
    held = values.clone()
    del again, other, neighbour
    for _ in range(100):   # churn through the kept blocks: a live tensor's data is never handed out
        torch.empty(3000, dtype=torch.uint8).fill_(7)
    assert torch.equal(values, held) and torch.equal(values, torch.arange(1000, dtype=torch.float32))
    large = torch.empty(2 << 20, dtype=torch.uint8)   # over 1 MB: from the system and back to it
    assert large.data_ptr() % 64 == 0
    large.fill_(1)
    assert int(large.sum()) == 2 << 20


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 4096, 256), (3, 1536, 256), (6, 7, 48), (8, 100, 769)])
def test_fp32_columns_linear_sums_in_order_and_gives_a_row_the_same_bits_in_any_batch(rows, out_features,
                                                                                       in_features):
    """fp32_columns_linear (fp32 weights stored by columns, layers.by_columns): within fp32 rounding of the fp64
    sum; a row's output has the same bits alone, in a batch, on 1 or 2 threads; a column view of a wider weight (a
    fused gate_up's half) read in place."""
    gen = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    fused = torch.randn(2 * out_features, in_features, generator=gen).t().contiguous().t()   # stored by columns
    w = fused[out_features:]
    ours = cpu_kernels.fp32_columns_linear(x, w.t())
    assert ours.shape == (rows, out_features)
    assert (ours.double() - F.linear(x.double(), w.double())).abs().max() < 1e-4 * in_features ** 0.5
    assert torch.equal(ours, cpu_kernels.fp32_columns_linear(x, w.t().contiguous()))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for r in range(rows):
                assert torch.equal(cpu_kernels.fp32_columns_linear(x[r:r + 1], w.t()), ours[r:r + 1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_bf16_engine_runs_its_linears_in_the_kernels_and_mtp_keeps_every_bit(tmp_path, monkeypatch, quantization):
    """A bf16 engine on the CPU loads the kernels with its weights; its linears (bf16 or int8, a decode step's rows
    and a prompt's alike), absorbed projections and attention run in them (a verify step's rows get a plain step's
    bits, row by row), and MTP gives the tokens and the logprobs of no MTP to the bit. Two requests at a time of
    three with different lengths: the third's prompt arrives beside the first's decode rows (a mixed step)."""
    from mtpserve import LLM, SamplingParams
    from tiny_models import trained_checkpoint
    ckpt = trained_checkpoint(tmp_path / "ckpt", num_mtp_layers=1)
    calls, int8_calls, attended, per_head = [], [], [], []
    originals = cpu_kernels.bf16_linear, cpu_kernels.int8_linear, cpu_kernels.latent_attention, cpu_kernels.bf16_bmm
    monkeypatch.setattr(cpu_kernels, "bf16_linear", lambda x, w: calls.append(x.shape[0]) or originals[0](x, w))
    monkeypatch.setattr(cpu_kernels, "int8_linear", lambda x, *w: int8_calls.append(x.shape[0]) or originals[1](x, *w))
    monkeypatch.setattr(cpu_kernels, "latent_attention", lambda *a: attended.append(a[0].shape) or originals[2](*a))
    monkeypatch.setattr(cpu_kernels, "bf16_bmm", lambda x, w: per_head.append(x.shape) or originals[3](x, w))
    prompts = [[5, 8, 11], [20, 21, 22, 23, 24, 25, 26], [30, 32, 34, 36, 38, 40, 42, 44, 46, 31, 33, 35]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (9, 24, 16)]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    outs = {}
    for name, s in (("plain", None), ("mtp", spec)):
        calls.clear(), int8_calls.clear(), attended.clear(), per_head.clear()
        llm = LLM(ckpt, dtype="bfloat16", quantization=quantization, speculative_config=s, enforce_eager=True,
                  max_num_seqs=2)
        done = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        outs[name] = [(o.outputs[0].token_ids, [[(t, lp.logprob) for t, lp in e.items()] 
                                                 for e in o.outputs[0].logprobs])
                      for o in done]
        # (every product, a decode step's rows and two prompts' 10 tokens alike; int8: the LM head in bf16)
        assert calls and min(calls) <= 3 and max(calls) >= (1 if quantization else 10)
        assert (int8_calls and min(int8_calls) <= 3 and max(int8_calls) >= 10) if quantization else not int8_calls
        assert attended and per_head and min(rows for _, rows, _ in per_head) == 1
        if s:
            assert llm.get_metrics()["acceptance_rate"] > 0.3
    assert outs["mtp"] == outs["plain"]


def test_every_kernel_source_is_built_and_in_the_graphs_cache_key():
    """cpu_kernels.SOURCES names every file of csrc/: each .cpp is built, and all of them are digested into inductor's
    cache key (ops.register_graph_lowerings), so that a graph compiled before a kernel changed is not reused."""
    import os
    from mtpserve.model.ops import register_graph_lowerings
    csrc = os.path.join(os.path.dirname(cpu_kernels.__file__), "csrc")
    assert sorted(cpu_kernels.SOURCES) == sorted(os.listdir(csrc))
    assert register_graph_lowerings().uuid().endswith(f"kernels {cpu_kernels.sources_digest()}")


def test_a_cpu_graph_calls_every_kernel_through_its_c_function_with_eager_bits():
    """Graphs compile with cpu_kernels.inductor_config(): inductor's C++ calls each op through the C function
    declared from its schema (csrc: C_SHIM), not the dispatcher. One graph calling every op (an optional tensor
    given and not, ints and floats among the arguments) returns eager's bits, and its C++ names every function."""
    from torch._inductor.utils import run_and_get_cpp_code
    from mtpserve.model.int8 import quantize_rows
    from mtpserve.model.layers import FEW_ROWS, by_columns
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 64, generator=gen).bfloat16(), torch.randn(40, 64, generator=gen)
    q8 = quantize_rows(w, torch.bfloat16)
    cache, tables = torch.randn(6, 16, 144, generator=gen).bfloat16(), torch.tensor([[3, 1, 4]])
    q, mask = torch.randn(1, 24, 144, generator=gen).bfloat16(), torch.ones(1, 3, 40, dtype=torch.bool)
    w13, w2 = torch.randn(4, 2 * 8, 64, generator=gen).bfloat16(), torch.randn(64, 4, 8, generator=gen).bfloat16()
    experts8 = [quantize_rows(e, torch.bfloat16) for e in w13]
    w2_8 = [quantize_rows(w2[:, e], torch.bfloat16) for e in range(4)]
    weights, ids = torch.rand(3, 4, generator=gen).bfloat16().topk(2, dim=-1)
    ops = torch.ops.mtpserve_cpu

    def every_op(x):
        return [ops.bf16_linear(x, w.bfloat16()), ops.bf16_bmm(x.unsqueeze(0), w.bfloat16().unsqueeze(0)),
                ops.int8_linear(x, q8.data, q8.scale), ops.fp32_linear(x.float(), w),
                ops.fp32_columns_linear(x.float(), by_columns(w).t()),
                ops.latent_attention(q, cache, mask, 0.125, 128, tables),
                ops.latent_attention(q, cache[tables[0]].flatten(0, 1)[:40].unsqueeze(0), mask, 0.125, 128),
                ops.routed_experts(x, weights, ids, w13, w2, FEW_ROWS),
                ops.routed_int8_experts(x, weights, ids, torch.stack([e.data for e in experts8]),
                                        torch.stack([e.scale for e in experts8]),
                                        torch.stack([e.data for e in w2_8]).movedim(0, 1),
                                        torch.stack([e.scale for e in w2_8]).movedim(0, 1))]

    compiled = torch.compile(every_op, fullgraph=True, dynamic=False,
                             options={"cpp_wrapper": True, **cpu_kernels.inductor_config()})
    got, code = run_and_get_cpp_code(compiled, x)
    assert all(torch.equal(a, b) for a, b in zip(got, every_op(x)))
    assert "aoti_torch_call_dispatcher" not in code and cpu_kernels.C_SHIMS
    assert all(f"aoti_torch_cpu_{op._opname}(" in code for op in cpu_kernels.C_SHIMS)
