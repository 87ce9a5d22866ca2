"""MTP drafting (DeepSeek-V3's predict phase).

A step's MTP passes follow one plan, `mtp_passes` (the fused step of spec_decode/fused.py runs the same plan
inside its graph). Own layer j (the checkpoint's layer for depth j+1) runs over every position whose main-model
hidden state was computed this step and whose next token is now known (a prompt chunk; or the pending token plus
the accepted drafts), fed the tokens shifted by j+1 and, chained, the previous own layer's outputs there. That
fills its KV cache exactly where the main cache is valid, and its output at the accepted position gives draft
j+1. Past the own layers (DeepSeek-V3 ships one), layer 0 runs one token further per depth, fed the previous
draft and output. Request at 5, pending t5, drafts [d6, d7], d6 accepted, e7 emitted, k = 3, one own layer:

    own layer 0     tokens [d6, e7] at 5, 6, main hidden states   -> output at 6 -> draft x8
    layer 0         token  [x8] at 7, fed that output             -> draft x9
    layer 0         token  [x9] at 8                              -> draft x10

A decode step drafting fewer depths than the checkpoint has own layers (adaptive k), or none (k = 0), still
runs every own layer chained, the deeper ones KV only: the caches hold what a step drafting every depth would
have written, so drafts after a change of k are as good as steady ones. Slots written past the accepted length
are never read before being overwritten.
"""
from dataclasses import dataclass

import torch

from mtpserve.sampling import processors
from mtpserve.sampling.sampler import TARGET_NOISE, draw, request_probs, sample
from mtpserve.step import Row, mtp_layer


@dataclass(frozen=True)
class MTPPass:
    """One depth of a step's drafting. Two own layers, k = 3, a decode step:
        MTPPass(layer=0, own=True, outputs="all")                 -> draft 1 (at the accepted position)
        MTPPass(layer=1, own=True, outputs="index")               -> draft 2 (fed layer 0's outputs)
        MTPPass(layer=0, own=False, span=2)                       -> draft 3 (positions of drafts 1 and 2)"""
    layer: int
    own: bool               # over the step's positions (else one token past the previous depth's, `span` tokens);
                            # own layer 0 fed the main model's hidden states, own layer j > 0 layer j-1's outputs
    outputs: str = "index"  # "all" (the next own layer reads them), "index" (the accepted position's), "none" (KV)
    drafts: bool = True
    span: int = 1           # past the own layers, the first depth also covers the positions they drafted at


def mtp_passes(k: int, chain_depth: int) -> list[MTPPass]:
    """The passes of a step drafting k tokens with `chain_depth` own layers: every own layer runs chained, as
    trained, whatever k (a later step drafting more depths reads their KV)."""
    passes = []
    for j in range(max(k, chain_depth)):
        if j < chain_depth:
            outputs = "all" if j + 1 < chain_depth else "index" if j < k else "none"
            passes.append(MTPPass(j, own=True, outputs=outputs, drafts=j < k))
        else:
            passes.append(MTPPass(0, own=False, span=j if chain_depth > 1 and j == chain_depth else 1))
    return passes


class MTPProposer:
    fuses_with_verification = True   # graph mode: its drafting runs in the fused step's graph (spec_decode/fused.py)

    def __init__(self, spec, model, forward, generator, device, static_shapes: bool = False):
        """forward(mtp_layer(j), rows, prev_hidden) runs MTP layer j on rows (graph or eager) -> hidden per token.
        static_shapes: graph mode, whose first pass always covers 1+k tokens per request."""
        self.model, self.spec, self.forward, self.generator, self.device = model, spec, forward, generator, device
        self.static_shapes = static_shapes

    @classmethod
    def check(cls, model_config, spec) -> None:
        if model_config.num_nextn_predict_layers == 0:
            raise ValueError("speculative_config: method 'mtp' needs a checkpoint with MTP layers "
                             "(num_nextn_predict_layers = 0 in its config.json)")

    @classmethod
    def num_kv_caches(cls, model_config, spec) -> int:
        """One per MTP layer the drafts use (graph mode and DeepSeek-V3 use one)."""
        return max(1, min(model_config.num_nextn_predict_layers, spec.num_speculative_tokens))

    @classmethod
    def lookahead_slots(cls, spec) -> int:
        return spec.num_speculative_tokens   # passes 1..k-1 write up to k-1 slots past the verified ones

    def graph_shapes(self) -> list[tuple[str, int]]:
        """The unfused steps' graphs: each own layer's pass over 1 + the drafts verified (one layer: at the
        accepted index; chained: every output, GraphRunner.indexed; for a fixed k only, as adaptive k would add
        a graph per layer and k: it runs them eagerly), and one-token passes of layer 0 for the depths past the
        own layers."""
        chained, verified = self._chain_depth() > 1, self.spec.verified_draft_counts
        first = ([] if chained and len(verified) > 1 else
                 [(mtp_layer(j), 1 + v) for j in range(self._chain_depth()) for v in verified])
        shared_depths = self.spec.num_speculative_tokens > self._chain_depth() + chained
        return first + ([(mtp_layer(0), 1)] if shared_depths else [])

    def next_k(self, scheduled) -> int:
        """Drafts this step proposes (the scheduler's policy set one k for every request: adaptive.py)."""
        return max((s.num_next_drafts for s in scheduled if s.samples), default=0)

    def propose(self, scheduled, hidden, offsets, new_tokens) -> list[tuple]:
        """Per request, (next drafts, their distributions [k, V] or None for argmax drafts); (None, None) for one
        that did not sample this step. new_tokens: what each request emitted this step."""
        return self._run_passes(scheduled, hidden, offsets, new_tokens, self.next_k(scheduled))

    def _run_passes(self, scheduled, hidden, offsets, new_tokens, k: int) -> list[tuple]:
        verified = len(scheduled[0].draft_token_ids) if scheduled else 0
        static = self.static_shapes and all(s.decodes(verified) for s in scheduled)
        # One row per request, the same for every own layer: its positions whose next token is now known, from
        # the step's first. sources: the main hidden state fed at each row token; last: where each request's
        # accepted position lands in the flat layout.
        # Request "a" at 5, pending t5, drafts [d6, d7], d6 accepted, e7 emitted: row tokens [d6, e7] at 5, 6.
        rows, sources, last = [], [], []
        for i, s in enumerate(scheduled):
            accepted = len(new_tokens[i]) - 1 if s.samples else 0
            own = s.num_new_tokens + accepted   # positions s.start.. whose next token is now known
            row_tokens = (s.req.all_token_ids + new_tokens[i])[s.start + 1:s.start + own + 1]
            if static:   # vllm-ascend's static shapes: 1+k tokens (their KV written), run at the accepted index
                row_tokens = row_tokens + [row_tokens[-1]] * (1 + verified - own)
            last.append(len(sources) + own - 1)
            rows.append(Row(row_tokens, s.start, s.req.block_ids))
            sources.extend(range(offsets[i], offsets[i] + len(row_tokens)))
        main = hidden[sources]
        chained = self._chain_depth() > 1   # (graph mode: the own layers' graphs compute every output)
        drafting = [i for i, s in enumerate(scheduled) if s.samples] if k else []
        reqs = [scheduled[i].req for i in drafting]
        draft_positions = [r.num_tokens + len(new_tokens[i]) for i, r in zip(drafting, reqs)]
        accepted_at = [scheduled[i].start + scheduled[i].num_new_tokens + len(new_tokens[i]) - 2 for i in drafting]
        known = [s.req.all_token_ids + new_tokens[i] for i, s in enumerate(scheduled)]
        # the tokens each drafting request has generated past its output by each depth (its processors read them)
        generated = [new_tokens[i] for i in drafting] if any(r.params.processes_logits for r in reqs) else None
        drafts, draft_probs, depth_hidden, chain_hidden = [], [], [], main   # (own layer j > 0: j-1's outputs)
        for j, p in enumerate(mtp_passes(k, self._chain_depth())):
            if p.own:   # depth j+1 at position t: embedding of token t+j+1, main or depth j's hidden state at t
                if 0 < j <= k:
                    for i, d in zip(drafting, drafts[j - 1].tolist()):
                        known[i] = known[i] + [d]
                step_rows = [self._chain_row(t, r, j, s.samples) for t, r, s in zip(known, rows, scheduled)]
                if p.outputs == "all":
                    chain_hidden = self.forward(mtp_layer(j), step_rows, chain_hidden)
                    prev_hidden = chain_hidden[[last[i] for i in drafting]]
                elif p.outputs == "index":
                    index = None if static and chained else last
                    out = self.forward(mtp_layer(j), step_rows, chain_hidden, output_index=index)
                    prev_hidden = (out[last] if index is None else out)[drafting]
                else:   # KV only (an indexed graph still outputs one token per row)
                    self.forward(mtp_layer(j), step_rows, chain_hidden,
                                 output_index=last if static and not chained else [])
            else:   # layer 0, `span` tokens up to the next position, fed the previous depths' drafts and outputs
                tokens = torch.stack(drafts[-p.span:], dim=1).tolist()
                step_rows = [Row(t, at + j - p.span + 1, scheduled[i].req.block_ids)
                             for i, t, at in zip(drafting, tokens, accepted_at)]
                inputs = torch.stack(depth_hidden[-p.span:], dim=1).flatten(0, 1)
                outputs = [p.span * (n + 1) - 1 for n in range(len(drafting))] if p.span > 1 else None
                prev_hidden = self.forward(mtp_layer(0), step_rows, inputs, output_index=outputs)
            if not p.drafts:
                continue
            if generated is not None and j:
                generated = [g + [d] for g, d in zip(generated, drafts[-1].tolist())]
            token, probs = self._draft(p.layer, prev_hidden, reqs, [q + j for q in draft_positions], generated)
            drafts.append(token)
            draft_probs.append(probs)
            depth_hidden.append(prev_hidden)
        if not drafting:
            return [(None, None)] * len(scheduled)
        drafts = torch.stack(drafts, dim=1).tolist()   # (one k for the whole step: adaptive.py)
        probs = torch.stack(draft_probs, dim=1) if draft_probs[0] is not None else [None] * len(drafting)
        found = dict(zip(drafting, zip(drafts, probs)))
        return [found.get(i, (None, None)) for i in range(len(scheduled))]

    def _chain_depth(self) -> int:
        """The depths run with the checkpoint's own layers, chained as trained: min(k, MTP layers), k the most
        drafts a step may make; 1 when only layer 0 runs."""
        k = self.spec.num_speculative_tokens
        return max(1, min(k, self.model.num_mtp_layers))

    @staticmethod
    def _chain_row(known: list[int], row: Row, j: int, samples: bool) -> Row:
        """Own layer j's row: the tokens of `row` shifted by j+1. A request that drafted fewer than j depths
        this step does not know its last ones: they repeat the last known token (KV only: no draft reads it
        this step, and a later step reads its KV as the chain would have left it, a guess, deterministic)."""
        tokens = known[row.start + 1 + j:row.start + 1 + j + len(row.token_ids)]
        missing = len(row.token_ids) - len(tokens)
        if missing and not samples:
            raise RuntimeError("MTP chain: a prompt chunk ends too close to the prompt's end "
                               "(Scheduler.min_last_chunk)")
        return Row(tokens + known[-1:] * missing, row.start, row.block_ids)

    def num_passes(self, scheduled) -> int:
        """The MTP passes propose() runs for this step (the plan's length)."""
        return len(mtp_passes(self.next_k(scheduled), self._chain_depth()))

    def min_last_chunk(self) -> int:
        """Prompt tokens the last chunk of a prompt must hold: own layer j at position p reads token p+j+1,
        known for a chunk only inside the prompt, so the last positions must come with the sampled token."""
        return self._chain_depth()

    def _draft(self, layer, hidden, reqs, positions, generated=None):
        """Drafts one token per request, and the distribution it was drawn from over the whole vocabulary.
        With a draft vocabulary the head scores only its tokens: drafts are mapped back to token ids and the
        distribution is zero elsewhere (exactly what was sampled from, so verification stays lossless).
        generated: per request, the tokens past its output before this draft (its processors read them)."""
        logits = self.model.mtp_logits(layer, hidden, restricted=True)
        vocab = self.model.draft_vocab
        if generated is not None:
            logits = processors.process(logits.float(), [processors.histories(r, [g])[0]
                                                         for r, g in zip(reqs, generated)],
                                        vocab, self.model.config.vocab_size, drafting=True)
        if self.spec.draft_sampling == "greedy" or all(r.params.greedy for r in reqs):
            token = logits.argmax(-1)   # one-hot drafts: no distribution to keep
            return (token if vocab is None else vocab[token]), None
        probs = request_probs(logits, reqs, None, self.device)
        # a seeded request's draft gets the noise its slot will be verified with (coupled verification:
        # spec_decode/verify.py)
        noise = draw([r.seed for r in reqs], positions, 1, probs.shape[-1], "exponential", TARGET_NOISE, self.generator,
                     self.device, [r.params.greedy for r in reqs])
        token = sample(probs, noise[:, 0])
        if vocab is None:
            return token, probs
        full = probs.new_zeros(probs.shape[0], self.model.config.vocab_size).index_copy_(1, vocab, probs)
        return vocab[token], full
