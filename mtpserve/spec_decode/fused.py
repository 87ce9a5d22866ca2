"""The fused decode step: verify, accept and draft in one function over tensors, one host sync at the end;
eager mode calls it (ModelRunner._fused_eagerly), graph mode compiles it (runner/graphs.py). Without speculation
k = 0: the target pass over the pending token and its sample. Greedy, one own MTP layer, request at 5 with
pending t5 and drafts [d6, d7] (q = 3, k = 2):

    main model over [t5 d6 d7] at 5 6 7              -> argmax [d6 e7 x8]          (main KV at 5 6 7)
    accepted: d6 kept, d7 != e7                       -> 1, emitted [d6 e7]
    own layer 0 over [d6 e7 e7] at 5 6 7, fed the main hidden states, output at 6 -> draft f8   (MTP KV at 5 6 7)
    layer 0 over [f8] at 7, fed that output           -> draft f9                    (MTP KV at 7)
    ids [d6 e7 x8 | 1 | f8 f9]: the caller keeps [d6 e7] and drafts [f8 f9]

The drafting follows spec_decode/mtp.py's plan (mtp_passes), as the separate path does. Sampled: the requests'
distributions (penalties counting the drafts before each position), token-wise or block verification
(spec_decode/verify.py) with the recovered or bonus token, drafts drawn from the draft head's distribution; the
random draws come in as inputs keyed as the separate path keys them (Exp(1) noise at the 2k+1 positions from the
pending token on, a uniform per draft): a seeded request gets the same tokens, an unseeded one the same
distribution.
"""
import torch

from mtpserve.model.attention import AttentionMetadata
from mtpserve.sampling.processors import penalize_after, penalty_inputs
from mtpserve.sampling.sampler import ACCEPT_UNIFORM, TARGET_NOISE, draw, logits_to_probs, sample, sampling_tensors
from mtpserve.spec_decode.mtp import mtp_passes
from mtpserve.spec_decode.verifier import stack_draft_probs
from mtpserve.spec_decode.verify import coupled_rows, verify_tokens
from mtpserve.step import FUSED, FUSED_SAMPLED, Pass, fused_kv_reach


def fused_step(model, main_caches, mtp_caches, block_size: int, spec, which: Pass, q: int, static: bool = True):
    """The fused step `which` (FUSED, FUSED_SAMPLED) over rows of q = 1+k tokens, drafting k:
    step(input_ids, positions, seq_lens, slot_mapping, block_tables, then sampled: sampling_inputs()) ->
    (ids [batch, q + 1 + k_next]: the emitted tokens (greedy: the target's argmax at the q positions; sampled:
    -1 past the accepted ones), the accepted count, the next drafts; the drafts' distributions [batch, k_next,
    V], or None for argmax drafts; the main model's hidden states [batch * q, H], logprobs read them). Padding rows (KV
    length 0, slot -1, greedy) compute garbage that the caller drops, and write no KV. The checkpoint's own MTP
    layers draft the first depths, chained, one per MTP cache (spec_decode/mtp.py). static: no host branch on
    values (compiled; eager mode runs it with host branches, sampling/sampler.py)."""
    device, k_next, sampled, chain_depth = main_caches[0].device, q - 1, which.sampled, len(mtp_caches)
    # (no speculation: q = 1, no drafts to sample or verify)
    draft_sampling, verification = (spec.draft_sampling, spec.verification) if spec else ("greedy", "token")
    vocab = model.draft_vocab
    probabilistic = sampled and draft_sampling == "probabilistic"

    def penalized(x, tokens, penalties):
        """x [B, ..., V] with the requests' penalties, `tokens` [B, ..., m] generated after their output (-1:
        none)."""
        shape = (x.shape[0],) + (1,) * (x.dim() - 2)
        return penalize_after(x, tokens, *[t.view(shape) for t in penalties[:3]],
                              *[t.view(shape + (-1,)) for t in penalties[3:]])

    def draft(layer, hidden, params, noise, penalties, history):
        """The next draft of every row; with params (sampled), its distribution over the whole vocabulary.
        history: the tokens generated this step before it (-1: none), which its penalties count (without a
        draft vocabulary: with one the drafts stay unpenalized proposals)."""
        logits = model.mtp_logits(layer, hidden, restricted=True)
        if penalties is not None and vocab is None:
            logits = penalized(logits.float(), history, penalties)
        if not probabilistic:
            token = logits.argmax(-1)
            return (token if vocab is None else vocab[token]), None
        probs = logits_to_probs(logits, *params, static=static)
        token = sample(probs, noise[:, :probs.shape[-1]])
        if vocab is None:
            return token, probs
        full = probs.new_zeros(probs.shape[0], model.config.vocab_size).index_copy(1, vocab, probs)
        return vocab[token], full

    def metadata_at(p, span, real, block_tables, max_seq_len):
        """`span` tokens per row at positions p[:, 0].. (one row per request; padding rows write nothing)."""
        block = block_tables.gather(1, p // block_size)
        slots = torch.where(real.unsqueeze(1), block * block_size + p % block_size, -1).flatten()
        return AttentionMetadata(torch.arange(p.shape[0] + 1, device=device) * span,
                                 torch.where(real, p[:, -1] + 1, 0), slots, block_tables, span, max_seq_len)

    def accept_greedy(logits, drafts):
        """-> (emitted [B, q]: the target's argmax at each position, accepted [B]: the leading drafts equal to it,
        None: what drafting needs from sampling)."""
        emitted = logits.argmax(-1).view(drafts.shape[0], q)
        return emitted, (drafts == emitted[:, :q - 1]).long().cumprod(-1).sum(-1), None

    def accept_sampled(logits, drafts, temperature, top_k, top_p, min_p, repetition, frequency, presence, seen,
                       counts, noise, uniforms=None, coupled=None, draft_probs=None):
        """-> (emitted [B, q]: the accepted drafts, the recovered or bonus token, then -1; accepted [B]; the
        sampling parameters, penalties and noise the drafts are drawn with)."""
        params = (temperature, top_k, top_p, min_p)
        penalties = (repetition, frequency, presence, seen, counts)
        # eagerly only when some row penalizes; a graph always runs them (with a torch.cond around them,
        # inductor's CPU code read garbage token indices, torch 2.13)
        if not static and not bool(((repetition != 1) | (frequency != 0) | (presence != 0)).any()):
            penalties = None
        scored = logits.float()
        if penalties is not None:   # position j counts the drafts before it: [d1 d2] -> [-1 -1], [d1 -1], [d1 d2]
            before = torch.where(torch.arange(q - 1, device=device) < torch.arange(q, device=device).unsqueeze(1),
                                 drafts.unsqueeze(1), -1)
            scored = penalized(scored.view(drafts.shape[0], q, -1), before, penalties).flatten(0, 1)
        target = logits_to_probs(scored, *[t.repeat_interleave(q) for t in params], static=static)
        target = target.view(drafts.shape[0], q, -1)
        if not probabilistic:   # argmax drafts (a graph's buffers hold zeros); token-wise: every row coupled
            draft_probs, coupled = None, True if verification == "token" else coupled
        emitted, accepted = verify_tokens(drafts, draft_probs, target, uniforms, noise[:, :q], verification, coupled)
        return emitted, accepted, (params, penalties, noise)

    accept = accept_sampled if sampled else accept_greedy

    def step(input_ids, positions, seq_lens, slot_mapping, block_tables, *sampling):
        batch, max_seq_len = seq_lens.shape[0], block_tables.shape[1] * block_size
        rows = torch.arange(batch, device=device)
        meta = AttentionMetadata(torch.arange(batch + 1, device=device) * q, seq_lens, slot_mapping, block_tables, q,
                                 max_seq_len)
        hidden = model(input_ids, positions, meta, main_caches)
        emitted, accepted, drawn = accept(model.compute_logits(hidden), input_ids.view(batch, q)[:, 1:], *sampling)
        params, penalties, noise = drawn or (None, None, None)
        index = rows * q + accepted
        real = seq_lens > 0
        position = positions[index]
        next_drafts, next_probs, depth_hidden = [], [], []

        def add_draft(layer, out):
            j = len(next_drafts)
            history = None if penalties is None else torch.cat([emitted] + [d.unsqueeze(1) for d in next_drafts], 1)
            token, probs = draft(layer, out, params, None if noise is None else noise[rows, accepted + 1 + j],
                                 penalties, history)
            next_drafts.append(token)
            next_probs.append(probs)
            depth_hidden.append(out)

        # The MTP passes (spec_decode/mtp.py's plan) reuse the main pass's metadata: the same tokens' positions
        # and slots. Own layer j reads the tokens shifted by j+1: known[:, i] is the token at position start + i + 1,
        # the emitted ones, then the drafts; past those, the last of them.
        known = torch.cat([emitted.clamp_min(0), emitted.new_zeros(batch, k_next)], dim=1)
        columns = torch.arange(q, device=device).unsqueeze(0)
        chain_hidden = hidden
        for j, p in enumerate(mtp_passes(k_next, chain_depth)):
            if p.own:
                if 0 < j <= k_next:
                    known = known.scatter(1, (accepted + j).unsqueeze(1), next_drafts[-1].unsqueeze(1))
                tokens = known.gather(1, torch.minimum(columns + j, (accepted + min(j, k_next)).unsqueeze(1)))
                out = model.mtp_forward(j, tokens.flatten(), positions, chain_hidden, meta,
                                        mtp_caches[j], {"all": None, "index": index, "none": rows[:0]}[p.outputs])
                if p.outputs == "all":
                    chain_hidden, out = out, out[index]
            else:   # layer 0, `span` tokens up to the next position, fed the previous depths' drafts and outputs
                at = position.unsqueeze(1) + torch.arange(j - p.span + 1, j + 1, device=device)
                tokens = torch.stack(next_drafts[-p.span:], dim=1).flatten()
                inputs = torch.stack(depth_hidden[-p.span:], dim=1).flatten(0, 1)
                out = model.mtp_forward(0, tokens, at.flatten(), inputs,
                                        metadata_at(at, p.span, real, block_tables, max_seq_len), mtp_caches[0],
                                        (rows + 1) * p.span - 1 if p.span > 1 else None)
            if p.drafts:
                add_draft(p.layer, out)
        drafted = torch.stack(next_drafts, dim=1) if next_drafts else emitted.new_zeros(batch, 0)
        ids = torch.cat([emitted, accepted.unsqueeze(1), drafted], dim=1)
        return ids, (torch.stack(next_probs, dim=1) if probabilistic and next_probs else None), hidden

    return step


def sampling_inputs(spec, reqs, drafts: list[list[int]], vocab_size: int, generator, device) -> list[torch.Tensor]:
    """The sampled fused step's inputs after the first five: per request temperature, top_k, top_p, min_p; the
    penalties (processors.penalty_inputs: repetition, frequency, presence, seen [B, V], counts [B, V]); Exp(1) noise
    [B, 2k+1, V] for the positions from the pending token on; with sampled drafts also a uniform per draft
    [B, k], which rows verify by coupling [B] and the drafts' distributions [B, k, V]; with argmax drafts none of
    these under token-wise verification (every row coupled), the uniforms and the coupled rows under block
    verification. As the unfused Verifier and MTP drafter draw them: a seeded request's draws keyed on its
    positions, greedy rows none. drafts: the k drafts each request verifies (the step's: a worker's copy of a
    request holds none)."""
    k = len(drafts[0])
    seeds, positions, greedy = [r.seed for r in reqs], [r.num_tokens for r in reqs], [r.params.greedy for r in reqs]
    noise = draw(seeds, positions, 2 * k + 1, vocab_size, "exponential", TARGET_NOISE, generator, device, greedy)
    inputs = [*sampling_tensors(reqs, None, device), *penalty_inputs(reqs, vocab_size, device), noise]
    if spec is None or (spec.draft_sampling != "probabilistic" and spec.verification == "token"):
        return inputs
    uniforms = draw(seeds, positions, k, 1, "uniform", ACCEPT_UNIFORM, generator, device, greedy)[..., 0]
    draft_probs = None
    if spec.draft_sampling == "probabilistic":
        draft_ids = torch.tensor(drafts, dtype=torch.long, device=device).view(len(reqs), k)
        draft_probs = stack_draft_probs(reqs, draft_ids, vocab_size)
    coupled = torch.tensor(coupled_rows(draft_probs, spec.verification, [s is not None for s in seeds]), device=device)
    return inputs + [uniforms, coupled] + ([] if draft_probs is None else [draft_probs])


def fused_graph(runner, scheduled) -> Pass | None:
    """The fused step this step can run as (its graph, or eagerly: ModelRunner._fused_step): FUSED when every
    request is greedy without penalties, FUSED_SAMPLED when some sample or penalize; None when some request is
    not decoding k drafts into k drafts (one pending token plus k drafts verified, k drafted next; adaptive k = 0
    has a graph of its own; a step changing k runs the graphs apart), or
    would write past its block table (2k positions past the pending token)."""
    if not scheduled or not runner.fuses:
        return None
    k = len(scheduled[0].draft_token_ids)
    if not all(_decodes(s, k) and s.num_next_drafts == k for s in scheduled):
        return None
    which = FUSED if all(s.req.params.greedy and not s.req.params.penalizes for s in scheduled) else FUSED_SAMPLED
    return which if all(fused_kv_reach(s.start, k) <= runner.max_positions for s in scheduled) else None


def _decodes(s, k: int) -> bool:
    """Request s runs a decode step a fused graph can take: its pending token and k drafts, not processing its
    logits on the host (processors but the penalties: the separate path; logprobs are read from the hidden
    states the step returns)."""
    return s.decodes(k) and not s.req.params.processes_on_host
