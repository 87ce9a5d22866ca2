"""The MTP modules are exactly DeepSeek's: depth 1 equals transformers' MTP implementation
(transformers.modeling_layers.MtpModel) on the same checkpoint; deeper depths equal DeepSeek-V3's formula
    x = eh_proj(cat[enorm(embed(t[p+k+1])), hnorm(h_k[p])]),  h_{k+1} = block(x),
    logits_k = shared_head.head(shared_head.norm(h_{k+1}))
where h_0 is the main model's final-normed hidden state and h_{k+1} (before shared_head.norm) feeds the
next depth.

transformers' MtpLayer applies shared_head.norm (its `post_norm`) to the block output before returning it,
and its MtpModel.forward chains that normed output into the next depth; DeepSeek (and vLLM, and we) chain
the block output before the norm. So depth 1 is compared with transformers as is, and deeper depths with
the formula above, built from transformers' own modules with `use_post_norm` switched off for chaining.
"""
import pytest
import torch

from conftest import CONFIGS, make_config, max_diff, rerandomize, save_with_transformers
from mtpserve.model.checkpoint import write_random_checkpoint
from mtpserve.model.loader import load_model

TOL = 1e-4


def reference_depths(hf, mtp, ids, depths):
    """Per depth k: (logits [B, T-k-1, V], block output before shared_head.norm), by the formula."""
    out = []
    with torch.no_grad():
        prev = hf.model(ids).last_hidden_state
        t = ids.shape[1]
        for k in range(depths):
            n = t - k - 1
            layer = mtp.layers[k]
            layer.use_post_norm = False     # forward_layer then returns block(eh_proj([enorm(e), hnorm(h)]))
            try:
                pos = torch.arange(n)[None].expand(ids.shape[0], -1)
                block_out = mtp.forward_layer(k, prev[:, :n], pos, None, input_ids=ids[:, k + 1:])
            finally:
                layer.use_post_norm = True
            logits = mtp.shared_head(layer.post_norm(block_out))
            out.append((logits, block_out))
            prev = block_out
    return out


def ours_depths(model, ids, depths):
    out = []
    with torch.no_grad():
        prev = model.forward_dense(ids)
        t = ids.shape[1]
        for k in range(depths):
            n = t - k - 1
            g = model.mtp_forward_dense(k, ids[:, k + 1:], prev[:, :n])
            out.append((model.mtp_logits(k, g), g))
            prev = g
    return out


@pytest.mark.parametrize("writer", ["transformers", "mtpserve"])
@pytest.mark.parametrize("name", ["dense_qlora_yarn", "moe_noqlora_yarn_norm", "moe_qlora_nonorm"])
def test_first_depth_equals_transformers_mtp(name, writer, tmp_path, load_hf):
    cfg = make_config(**CONFIGS[name])
    path = str(tmp_path / "ckpt")
    if writer == "transformers":
        save_with_transformers(path, cfg, seed=4)
    else:
        write_random_checkpoint(path, seed=4, **cfg)
        rerandomize(path, seed=4)
    ours = load_model(path, dtype=torch.float32)
    hf, mtp = load_hf(path)
    gen = torch.Generator().manual_seed(14)
    for length in (2, 8, 33):
        ids = torch.randint(0, cfg["vocab_size"], (2, length), generator=gen)
        with torch.no_grad():
            h = hf.model(ids).last_hidden_state
            pos = torch.arange(length - 1)[None].expand(2, -1)
            # transformers' own depth-1 output (shared_head.norm applied) and logits
            ref = mtp._project_to_logits(mtp.forward_layer(0, h[:, :-1], pos, None, input_ids=ids[:, 1:]))
        (got, _), = ours_depths(ours, ids, 1)
        assert got.shape == ref.shape
        assert max_diff(got, ref) < TOL, f"length {length}: {max_diff(got, ref)}"
        assert ref.abs().max() > 1.0


def test_deeper_depths_follow_the_formula(tmp_path, load_hf):
    cfg = make_config(**CONFIGS["moe_noqlora_yarn_norm"], num_nextn_predict_layers=3)
    path = save_with_transformers(str(tmp_path / "ckpt"), cfg, seed=5)
    ours = load_model(path, dtype=torch.float32)
    assert ours.num_mtp_layers == 3
    hf, mtp = load_hf(path)
    assert len(mtp.layers) == 3
    ids = torch.randint(0, cfg["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(15))
    ref = reference_depths(hf, mtp, ids, 3)
    got = ours_depths(ours, ids, 3)
    for k in range(3):
        assert max_diff(got[k][1], ref[k][1]) < TOL, f"depth {k} hidden: {max_diff(got[k][1], ref[k][1])}"
        assert max_diff(got[k][0], ref[k][0]) < TOL, f"depth {k} logits: {max_diff(got[k][0], ref[k][0])}"
    # The formula's chaining (pre-norm) differs from transformers' MtpModel.forward chaining (post-norm):
    # make sure the test can tell them apart, i.e. depth 2 would differ had we chained the normed output.
    with torch.no_grad():
        normed = mtp.layers[0].post_norm(ref[0][1])
        alt = ours.mtp_logits(1, ours.mtp_forward_dense(1, ids[:, 2:], normed[:, :-1]))
    assert max_diff(alt, ref[1][0]) > 1e-2


def test_mtp_paged_equals_dense(tmp_path):
    """MTP module on its own paged cache, chunked prefill then 1-token steps, equals the dense pass."""
    from test_model_parity import BLOCK_SIZE
    from mtpserve.model.attention import AttentionMetadata
    cfg = make_config(**CONFIGS["moe_qlora_nonorm"])
    path = write_random_checkpoint(str(tmp_path / "ckpt"), seed=6, **cfg)
    rerandomize(path, seed=6)
    model = load_model(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(16)
    n = 13
    ids = torch.randint(0, cfg["vocab_size"], (1, n), generator=gen)
    prev = torch.randn(1, n, cfg["hidden_size"], generator=gen)
    with torch.no_grad():
        dense = model.mtp_forward_dense(0, ids, prev)[0]
    num_blocks = -(-n // BLOCK_SIZE) + 1
    table = torch.randperm(num_blocks - 1, generator=gen)[None]
    cache = 1e3 * torch.randn(num_blocks, BLOCK_SIZE, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], generator=gen)
    outs = []
    for s, e in [(0, 6), (6, 9), (9, 10), (10, 13)]:
        p = torch.arange(s, e)
        meta = AttentionMetadata(query_start_loc=torch.tensor([0, e - s]), seq_lens=torch.tensor([e]),
                                 slot_mapping=table[0][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE,
                                 block_tables=table, max_query_len=e - s, max_seq_len=e)
        with torch.no_grad():
            outs.append(model.mtp_forward(0, ids[0, s:e], p, prev[0, s:e], meta, cache))
    assert max_diff(torch.cat(outs), dense) < TOL
