"""The main model is exactly DeepSeek-V3: logits equal Hugging Face transformers' DeepseekV3ForCausalLM on
the same random checkpoint (fp32, max abs diff < 1e-4), whichever side wrote the checkpoint; the paged,
chunked, flat-batch path equals the dense one; absorbed and expanded MLA agree.

transformers 5.24 facts these tests rely on (checked in its source):
- save_pretrained writes per-expert HF keys (`mlp.experts.{e}.gate_proj.weight`, ...), converting back
  from its fused 3-D `gate_up_proj` / `down_proj`, and spells rope as `rope_parameters` (rope_theta inside).
- Its router always scores with sigmoid plus e_score_correction_bias, group score = sum of the top-2 in
  each group, and masks dropped groups with -inf (DeepSeek's HF remote code used 0.0; our configs use a
  non-negative bias so that both choose the same experts; see conftest.random_tensor).
"""
import pytest
import torch

from conftest import CONFIGS, make_config, max_diff, rerandomize, save_with_transformers
from mtpserve.model.attention import AttentionMetadata
from mtpserve.model.checkpoint import write_random_checkpoint
from mtpserve.model.loader import load_model

PROMPT_LENGTHS = (1, 7, 33)
TOL = 1e-4


def assert_same_logits(ours, hf, vocab_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for length in PROMPT_LENGTHS:
        ids = torch.randint(0, vocab_size, (2, length), generator=gen)
        with torch.no_grad():
            ref = hf(ids).logits
            got = ours.compute_logits(ours.forward_dense(ids))
        assert got.shape == ref.shape
        assert max_diff(got, ref) < TOL, f"prompt length {length}: max abs diff {max_diff(got, ref)}"
        assert ref.abs().max() > 1.0  # the comparison is not between two near-zero outputs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_checkpoint_in_mtpserve(name, tmp_path, load_hf):
    """Written by transformers' save_pretrained, loaded by us."""
    cfg = make_config(**CONFIGS[name])
    path = save_with_transformers(str(tmp_path / "ckpt"), cfg, seed=1)
    ours = load_model(path, dtype=torch.float32)
    hf, _ = load_hf(path)
    assert_same_logits(ours, hf, cfg["vocab_size"], seed=11)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mtpserve_checkpoint_in_transformers(name, tmp_path, load_hf):
    """Written by our write_random_checkpoint (its key names and config.json), loaded by transformers."""
    cfg = make_config(**CONFIGS[name])
    path = write_random_checkpoint(str(tmp_path / "ckpt"), seed=2, **cfg)
    rerandomize(path, seed=2)   # our writer's init (std 0.02) is too gentle for a sharp comparison
    ours = load_model(path, dtype=torch.float32)
    hf, _ = load_hf(path)
    assert_same_logits(ours, hf, cfg["vocab_size"], seed=12)


def test_moe_test_config_exercises_routing(tmp_path, load_hf):
    """Guards the test configs: the correction bias and the group limit both change which experts are
    chosen (else the MoE parity tests would not check them)."""
    cfg = make_config(**CONFIGS["moe_noqlora_yarn_norm"])
    path = save_with_transformers(str(tmp_path / "ckpt"), cfg, seed=1)
    hf, _ = load_hf(path)
    gate = hf.model.layers[1].mlp.gate
    x = torch.randn(256, cfg["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, _, chosen = gate(x)
        scores = torch.sigmoid(x @ gate.weight.T)
        no_bias = scores.topk(cfg["num_experts_per_tok"], dim=-1).indices
        with_bias_no_groups = (scores + gate.e_score_correction_bias).topk(cfg["num_experts_per_tok"], dim=-1).indices
    as_sets = lambda t: [frozenset(r.tolist()) for r in t]  # noqa: E731
    assert as_sets(chosen) != as_sets(no_bias)
    assert as_sets(chosen) != as_sets(with_bias_no_groups)
    assert gate.e_score_correction_bias.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- paged path

BLOCK_SIZE = 4


class PagedRun:
    """Drives model(input_ids, positions, meta, kv_caches) over a paged cache with shuffled block tables."""

    def __init__(self, model, seq_lens_total, seed):
        cfg = model.config
        self.model = model
        gen = torch.Generator().manual_seed(seed)
        blocks_per_req = [-(-n // BLOCK_SIZE) for n in seq_lens_total]
        num_blocks = sum(blocks_per_req) + 1   # the last block takes slot -1 writes; never handed out
        perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
        self.block_tables = torch.zeros(len(seq_lens_total) + 1, max(blocks_per_req), dtype=torch.long)
        start = 0
        for r, nb in enumerate(blocks_per_req):
            self.block_tables[r, :nb] = torch.tensor(perm[start:start + nb])
            start += nb
        # Unwritten slots hold large random values: reading one (a masking or slot bug) shows in the output.
        self.kv_caches = [1e3 * torch.randn(num_blocks, BLOCK_SIZE, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                            generator=gen) for _ in range(cfg.num_hidden_layers)]

    def step(self, seqs, chunks, pad_rows=0):
        """chunks: per request (start, end) token positions to run this step. pad_rows: extra padding rows
        (1 query token, KV length 0, slot -1) as graph mode adds. Returns per request hidden [end-start, H]."""
        ids, pos, slots, qsl, seq_lens, rows = [], [], [], [0], [], []
        for r, (s, e) in enumerate(chunks):
            p = torch.arange(s, e)
            ids.append(seqs[r][s:e])
            pos.append(p)
            slots.append(self.block_tables[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            qsl.append(qsl[-1] + e - s)
            seq_lens.append(e)
            rows.append(r)
        for _ in range(pad_rows):
            ids.append(torch.zeros(1, dtype=torch.long))
            pos.append(torch.zeros(1, dtype=torch.long))
            slots.append(torch.full((1,), -1, dtype=torch.long))
            qsl.append(qsl[-1] + 1)
            seq_lens.append(0)
            rows.append(len(seqs))     # the all-zero block-table row
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl), seq_lens=torch.tensor(seq_lens), slot_mapping=torch.cat(slots),
            block_tables=self.block_tables[rows], max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            max_seq_len=max(seq_lens))
        with torch.no_grad():
            h = self.model(torch.cat(ids), torch.cat(pos), meta, self.kv_caches)
        return [h[qsl[r]:qsl[r + 1]] for r in range(len(chunks))]


# Steps of a two-request run: chunked prefill (mixed with the other request's prefill), a 1+k-token
# verify-like step, 1-token decodes, padding rows.
SCHEDULE = [
    ([(0, 5), (0, 6)], 0),
    ([(5, 13), (6, 9)], 0),
    ([(13, 14), (9, 10)], 2),
    ([(14, 17), (10, 11)], 1),
    ([(17, 18), (11, 14)], 0),
    ([(18, 19), (14, 15)], 0),
]


@pytest.fixture(scope="module")
def paged_model(tmp_path_factory):
    cfg = make_config(**CONFIGS["moe_noqlora_yarn_norm"])
    path = write_random_checkpoint(str(tmp_path_factory.mktemp("paged")), seed=3, **cfg)
    rerandomize(path, seed=3)
    return load_model(path, dtype=torch.float32)


@pytest.mark.parametrize("mode", ["absorbed", "expanded", "auto"])
def test_paged_chunked_equals_dense(paged_model, mode):
    model = paged_model
    lengths = (19, 15)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    model.set_attention_mode("expanded")
    with torch.no_grad():
        dense = [model.compute_logits(model.forward_dense(s[None]))[0] for s in seqs]
    model.set_attention_mode(mode)
    try:
        run = PagedRun(model, lengths, seed=7)
        got = [[], []]
        for chunks, pads in SCHEDULE:
            for r, h in enumerate(run.step(seqs, chunks, pad_rows=pads)):
                got[r].append(model.compute_logits(h))
        for r in range(2):
            paged = torch.cat(got[r])
            assert paged.shape == dense[r].shape
            assert max_diff(paged, dense[r]) < TOL, f"request {r}: {max_diff(paged, dense[r])}"
    finally:
        model.set_attention_mode("auto")


@pytest.mark.parametrize("mode", ["absorbed", "expanded"])
def test_rejected_draft_kv_is_overwritten(paged_model, mode):
    """A verify step writes KV for drafts that are then rejected; the next step rewrites those slots with
    the accepted tokens, and everything equals the dense pass over the final sequence."""
    model = paged_model
    n = 16
    true = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(17))
    drafted = true.clone()
    drafted[11:14] = (true[11:14] + 1) % model.config.vocab_size     # 3 wrong drafts after position 10
    model.set_attention_mode("expanded")
    with torch.no_grad():
        dense = model.compute_logits(model.forward_dense(true[None]))[0]
    model.set_attention_mode(mode)
    try:
        run = PagedRun(model, [n], seed=8)
        first = run.step([true], [(0, 10)])[0]
        verify = run.step([drafted], [(10, 14)])[0]          # 1 + 3 drafts; only position 10 is right
        rest = run.step([true], [(11, 14)])[0]               # accepted 1: redo 11..13 with the true tokens
        last = run.step([true], [(14, 16)])[0]
    finally:
        model.set_attention_mode("auto")
    got = torch.cat([first, verify[:1], rest, last])
    assert max_diff(model.compute_logits(got), dense) < TOL
    assert max_diff(model.compute_logits(verify[1:]), dense[11:14]) > 1e-2   # the drafts did differ


@pytest.mark.parametrize("split", [True, False])
def test_decodes_and_prompt_chunks_attend_apart_exactly(paged_model, split):
    """A step mixing a decode row with a prompt chunk longer than ABSORB_MAX_QUERY_LEN: the engine's batch
    (build_batch) attends the two kinds apart (absorbed for the decode, expanded for the chunk); logits equal
    the dense pass over each whole sequence, split or not."""
    from mtpserve.runner.batch import build_batch
    from mtpserve.step import Row
    model = paged_model
    lengths = (14, 12)
    gen = torch.Generator().manual_seed(21)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    with torch.no_grad():
        dense = [model.compute_logits(model.forward_dense(s[None]))[0] for s in seqs]
    run = PagedRun(model, lengths, seed=9)
    tables = [run.block_tables[r].tolist() for r in range(2)]
    steps = [[(0, 0, 12)], [(0, 12, 13), (1, 0, 10)], [(0, 13, 14), (1, 10, 12)]]   # (request, start, end)
    got = [[], []]
    for step in steps:
        rows = [Row(seqs[r][a:b].tolist(), a, tables[r]) for r, a, b in step]
        ids, pos, meta = build_batch(rows, BLOCK_SIZE, "cpu", split=split)
        mixed = len(step) == 2 and step[1][2] - step[1][1] > 8
        assert (meta.parts is not None) == (split and mixed)
        if meta.parts is not None:
            assert [part.max_query_len for _, part in meta.parts] == [1, 10]
        with torch.no_grad():
            h = model(ids, pos, meta, run.kv_caches)
        offsets = meta.query_start_loc.tolist()
        for i, (r, _, _) in enumerate(step):
            got[r].append(model.compute_logits(h[offsets[i]:offsets[i + 1]]))
    for r in range(2):
        assert max_diff(torch.cat(got[r]), dense[r]) < TOL, f"request {r}"


def test_absorbed_and_expanded_mla_agree(paged_model):
    model = paged_model
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(9))
    out = {}
    try:
        for mode in ("absorbed", "expanded"):
            model.set_attention_mode(mode)
            with torch.no_grad():
                out[mode] = model.compute_logits(model.forward_dense(ids))
    finally:
        model.set_attention_mode("auto")
    assert max_diff(out["absorbed"], out["expanded"]) < TOL


@pytest.mark.parametrize("topk_method,n_group,topk_group", [("greedy", 1, 1), ("group_limited_greedy", 4, 2)])
def test_deepseek_v2_checkpoint_equals_transformers(topk_method, n_group, topk_group, tmp_path):
    """DeepSeek-V2 (softmax routing, no correction bias, no MTP) written by transformers' DeepseekV2."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    from conftest import YARN, random_tensor
    cfg = make_config(model_type="deepseek_v2", topk_method=topk_method, n_group=n_group, topk_group=topk_group,
                      norm_topk_prob=False, routed_scaling_factor=1.5, q_lora_rank=None, num_nextn_predict_layers=0,
                      rope_scaling=dict(YARN, mscale=0.707, mscale_all_dim=0.707))   # V2's own mscale values
    for k in ("scoring_func", "architectures"):
        cfg.pop(k)
    hf = DeepseekV2ForCausalLM(DeepseekV2Config.from_dict(cfg))
    gen = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for name, t in hf.state_dict().items():
            t.copy_(random_tensor(name, t.shape, gen))
    hf.save_pretrained(str(tmp_path))
    ours = load_model(str(tmp_path), dtype=torch.float32)
    assert ours.config.model_type == "deepseek_v2" and ours.config.scoring_func == "softmax"
    hf = DeepseekV2ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    assert_same_logits(ours, hf, cfg["vocab_size"], seed=22)


def test_rope_interleave_false_is_refused_or_exact(tmp_path, load_hf):
    """transformers' DeepseekV3Config has rope_interleave (default True, as DeepSeek's checkpoints imply);
    a checkpoint saying False must either be refused naming the field or computed as transformers does."""
    from mtpserve.config import ModelConfig
    cfg = make_config(rope_interleave=False)
    try:
        ModelConfig.from_dict(cfg)
    except ValueError as err:
        assert "rope_interleave" in str(err)
        return
    path = save_with_transformers(str(tmp_path / "ckpt"), cfg, seed=1)
    hf, _ = load_hf(path)
    assert_same_logits(load_model(path, dtype=torch.float32), hf, cfg["vocab_size"], seed=11)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_for_inference_equals_unfused(name, tmp_path):
    """fuse_for_inference (shared-input projections as one GEMM, stacked experts, bmm-ready absorbed
    weights) changes no output, for one token (the single-token expert path) and for many, MTP included;
    its parameters keep their names and values and share the fused storage."""
    cfg = make_config(**CONFIGS[name])
    path = write_random_checkpoint(str(tmp_path), seed=4, **cfg)
    rerandomize(path, seed=4)
    plain, fused = load_model(path), load_model(path).fuse_for_inference()
    before = plain.state_dict()
    after = fused.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    gen = torch.Generator().manual_seed(6)
    for length in (1, 9):
        ids = torch.randint(0, cfg["vocab_size"], (2, length), generator=gen)
        with torch.no_grad():
            for model in (plain, fused):
                model.set_attention_mode("absorbed")
            h_plain, h_fused = plain.forward_dense(ids[:1]), fused.forward_dense(ids[:1])
            assert max_diff(plain.compute_logits(h_plain), fused.compute_logits(h_fused)) < TOL
            h_plain, h_fused = plain.forward_dense(ids), fused.forward_dense(ids)
            assert max_diff(plain.compute_logits(h_plain), fused.compute_logits(h_fused)) < TOL
            if plain.num_mtp_layers:
                m_plain = plain.mtp_forward_dense(0, ids, h_plain)
                m_fused = fused.mtp_forward_dense(0, ids, h_fused)
                assert max_diff(plain.mtp_logits(0, m_plain), fused.mtp_logits(0, m_fused)) < TOL
    moe = [m for m in fused.modules() if type(m).__name__ == "MoE"]
    for m in moe:   # the experts' parameters are views of the stacked tensors, not copies
        assert m.experts["0"].gate_proj.weight.data_ptr() == m.w13.data_ptr()
    # fp32 weights on the CPU are stored by columns ([out, in] with stride 1 along out), the embedding excepted
    linears = [m.weight for m in fused.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(w.stride(0) == 1 for w in linears)
    assert fused.model.embed_tokens.weight.stride(-1) == 1


@pytest.mark.parametrize("num_tokens, experts", [(1, 8), (2, 3), (3, 8), (20, 8)])
def test_moe_expert_paths_agree(num_tokens, experts):
    """The ways to run the routed experts (a few tokens: every chosen expert on all of them, weighted by zero
    where not chosen; many: grouped by expert; each choice as its own GEMM pair; all experts densely) agree, also
    when tokens share experts (3 experts, top-2), and the dense one is not trivially zero for the experts not
    chosen."""
    from mtpserve.model.moe import _all_experts, _chosen_pairs, _hit_experts
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, inter, k = 16, 12, 2
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(hidden, experts, inter, generator=gen)
    weights, ids = torch.rand(num_tokens, experts, generator=gen).topk(k, dim=-1)
    def expert(e, t):   # expert e on token t
        return w2[:, e] @ (torch.nn.functional.silu(w13[e, :inter] @ x[t]) * (w13[e, inter:] @ x[t]))

    ref = torch.stack([sum(weights[t, j] * expert(ids[t, j], t) for j in range(k)) for t in range(num_tokens)])
    assert max_diff(_hit_experts(x, weights, ids, w13, w2), ref) < 1e-4
    assert max_diff(_all_experts(x, weights, ids, w13, w2), ref) < 1e-4
    assert max_diff(_chosen_pairs(x, weights, ids, w13, w2), ref) < 1e-4   # some experts get no token
    assert ref.abs().max() > 1.0
    # an id of `experts` is a choice held by another rank (expert parallelism): skipped
    ids[0, 1] = experts
    ref[0] = weights[0, 0] * expert(ids[0, 0], 0)
    assert max_diff(_hit_experts(x, weights, ids, w13, w2), ref) < 1e-4


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9])
def test_linear_equals_f_linear(rows):
    """layers.linear picks its GEMM by row count, weight layout and whether it is being compiled (per-row
    reductions in a CPU graph); every choice computes F.linear."""
    from mtpserve.model.layers import linear
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 24, generator=gen)
    stacked = torch.randn(40, 3, 24, generator=gen)
    bias = torch.randn(40, generator=gen)
    compiled = torch.compile(linear, dynamic=False, fullgraph=True)
    by_columns = stacked[:, 2].t().contiguous().t()   # stored transposed, as fuse_for_inference keeps fp32 weights
    for weight in (stacked[:, 0].contiguous(), stacked[:, 1], by_columns):   # contiguous, a strided view
        for b in (None, bias):
            for fn in (linear, compiled):
                with torch._dynamo.config.patch(recompile_limit=64):   # a variant per shape and test
                    out = fn(x, weight, b)
                assert out.shape == (rows, 40) and out.is_contiguous()
                torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b))


def test_small_bmm_equals_bmm_compiled_and_eager():
    """attention.small_bmm is a fused reduction for small bf16 products in a CPU graph, torch.bmm otherwise."""
    from mtpserve.model.attention import small_bmm
    gen = torch.Generator().manual_seed(0)
    compiled = torch.compile(small_bmm, dynamic=False, fullgraph=True)
    for dtype, tol in ((torch.float32, {}), (torch.bfloat16, dict(rtol=1.6e-2, atol=2e-2))):
        for batch, rows in ((1, 16), (8, 2), (16, 8)):   # the last is over SMALL_BMM_ROWS: an extern bmm
            a = torch.randn(batch, rows, 24, generator=gen).to(dtype)
            b = torch.randn(batch, 40, 24, generator=gen).to(dtype).transpose(1, 2)   # strided, like keys.T
            for fn in (small_bmm, compiled):
                with torch._dynamo.config.patch(recompile_limit=64):
                    torch.testing.assert_close(fn(a, b), torch.bmm(a, b), **tol)


def test_gather_cache_blocks_is_called_as_aten_from_a_cpp_graph():
    """An op declared as_aten (ops.py) lowers, once registered, to the ATen call itself: the C++ wrapper calls
    aten::index_select through the dispatcher, not the op's Python kernel; the result is kv_cache[blocks]."""
    from torch._inductor.utils import run_and_get_code
    from mtpserve.model.attention import gather_cache_blocks
    from mtpserve.model.ops import register_graph_lowerings
    register_graph_lowerings()
    cache = torch.randn(9, 4, 6)
    blocks = torch.tensor([3, 0, 8, 3])
    compiled = torch.compile(lambda c, b: gather_cache_blocks(c, b) * 2, dynamic=False, fullgraph=True,
                             options={"cpp_wrapper": True, "fx_graph_cache": False})
    out, (code, *_) = run_and_get_code(compiled, cache, blocks)
    torch.testing.assert_close(out, cache[blocks] * 2)
    assert 'call_dispatcher("aten::index_select"' in code and 'call_dispatcher("mtpserve::' not in code


def test_a_graph_writing_one_cache_twice_updates_it_in_place():
    """MTP layer 0 writes its cache at depth 1 and again at depth 3 in one fused graph (k = 3 with two MTP layers).
    write_slots indexes the cache itself, so inductor updates it in place; written through a flat view, the first
    write went to a copy of the whole cache (a loop over its 2,048 values here; 76 MB a step in the shipped model's
    default cache)."""
    from torch._inductor.utils import run_and_get_code
    from mtpserve.model.attention import write_slots

    def step(cache, slots1, kv1, slots2, kv2):
        write_slots(cache, slots1, kv1)
        seen = cache[slots1.clamp_min(0) // 4].sum()   # (read between the writes, as the depth-1 pass attends)
        write_slots(cache, slots2, kv2)
        return seen + cache[slots2 // 4].sum()
    args = (torch.tensor([5, 6, -1]), torch.randn(3, 8), torch.tensor([6, 7]), torch.randn(2, 8))
    cache, want_cache = torch.zeros(64, 4, 8), torch.zeros(64, 4, 8)
    want = step(want_cache, *args)
    compiled = torch.compile(step, fullgraph=True, dynamic=False,
                             options={"cpp_wrapper": True, "fx_graph_cache": False})
    with torch.inference_mode():
        got, (code, *_) = run_and_get_code(compiled, cache, *args)
    assert torch.equal(cache, want_cache) and torch.allclose(got, want)
    assert "2048L" not in code, "the graph copies the whole cache"
