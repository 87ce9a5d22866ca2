"""The fused speculative step of graph mode (greedy MTP): verify, accept and draft in one compiled graph.

One decode step of B requests, each verifying k drafts (1+k query tokens), normally runs the main graph, the
LM head and the acceptance eagerly, the MTP graph at the accepted index, the draft head eagerly, and k-1 more
one-token MTP graphs, with a host sync between each. When every request is greedy all of it is a function of
the step's inputs alone, so it compiles into one graph with one host sync at the end:

    hidden  = main model over the 1+k tokens                  (writes main KV)
    target  = argmax of the LM head at each of the 1+k positions
    accepted = number of leading drafts equal to target          (greedy verification)
    MTP layer 0 over the 1+k positions, fed target as the next tokens (equal to the drafts where accepted,
             the bonus token at the accepted index), run at the accepted index   (writes MTP KV)
    draft 1 = argmax of the draft head; drafts 2..k_next: layer 0 one token further each (graph mode's
             drafting, as in spec_decode/mtp.py)

Tokens, acceptance and drafts are exactly those of the unfused path: the same computations in the same order,
only without the trips through Python in between.
"""
import torch

from mtpserve.model.attention import AttentionMetadata


def fused_greedy_step(model, main_caches, mtp_cache, block_size: int, batch: int, q: int, k_next: int):
    """step(input_ids, positions, seq_lens, slot_mapping, block_tables) -> [batch, q + 1 + k_next] ids: the
    target's argmax at the q positions, the accepted count, the next drafts. Padding rows (KV length 0,
    slot -1) compute garbage that the caller drops, and write no KV."""
    query_start_loc = torch.arange(batch + 1, device=mtp_cache.device) * q
    row_start = torch.arange(batch, device=mtp_cache.device) * q
    one_token = torch.arange(batch + 1, device=mtp_cache.device)

    def draft(hidden):
        token = model.mtp_logits(0, hidden, restricted=True).argmax(-1)
        return token if model.draft_vocab is None else model.draft_vocab[token]

    def step(input_ids, positions, seq_lens, slot_mapping, block_tables):
        max_seq_len = block_tables.shape[1] * block_size
        meta = AttentionMetadata(query_start_loc, seq_lens, slot_mapping, block_tables, q, max_seq_len)
        hidden = model(input_ids, positions, meta, main_caches)
        target = model.compute_logits(hidden).argmax(-1).view(batch, q)
        drafts = input_ids.view(batch, q)[:, 1:]
        accepted = (drafts == target[:, :q - 1]).long().cumprod(-1).sum(-1)
        index = row_start + accepted
        # the MTP pass reuses the main pass's metadata: the same tokens' positions and slots
        out = model.mtp_forward(0, target.flatten(), positions, hidden, meta, mtp_cache, index)
        real = seq_lens > 0
        position = positions[index]
        next_drafts = [draft(out)]
        for j in range(1, k_next):   # one token at the next position, fed the previous draft and output
            p = position + j
            block = block_tables.gather(1, (p // block_size).unsqueeze(1)).squeeze(1)
            slots = torch.where(real, block * block_size + p % block_size, -1)
            meta_j = AttentionMetadata(one_token, torch.where(real, p + 1, 0), slots, block_tables, 1, max_seq_len)
            out = model.mtp_forward(0, next_drafts[-1], p, out, meta_j, mtp_cache)
            next_drafts.append(draft(out))
        return torch.cat([target, accepted.unsqueeze(1), torch.stack(next_drafts, dim=1)], dim=1)

    return step


def fusable(runner, scheduled) -> bool:
    """Whether this step can run as the fused graph (built when runner.builds_fused_step): every request
    greedy and decoding (one pending token plus k drafts, k more wanted), nothing handed over or held for a
    hand-off."""
    if not scheduled or not runner.builds_fused_step:
        return False
    k = runner.spec.num_speculative_tokens
    return all(s.samples and s.num_new_tokens == 1 and len(s.draft_token_ids) == k and s.req.params.greedy
               and not s.req.placeholder_drafts and not s.req.hold_kv and s.req.mtp_prefix_hidden is None
               and s.num_next_drafts in (None, k) for s in scheduled) and runner.graphs.fits_fused(scheduled, k)
