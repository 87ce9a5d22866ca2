"""MTP drafting (DeepSeek-V3's predict phase).

Pass 0 runs MTP layer 0 over every position whose main-model hidden state was computed this step and whose
next token is now known (a prompt chunk; or the pending token plus the accepted drafts), with the tokens
shifted by one. That fills the MTP KV cache exactly where the main cache is valid, and its output at the
last position gives draft 1. Pass j uses MTP layer j if the checkpoint has it, else layer 0. A shared layer
(DeepSeek-V3 ships one, so all passes share it and its cache) runs one token at the next position, fed draft j
and the previous pass's output hidden state. A layer of its own runs as it was trained: over the same
positions as pass 0, fed the previous depth's outputs there and the tokens shifted by j+1 (the last one being
draft j), which also fills its own cache where it belongs (every step runs it, so its cache stays whole;
graph mode too, where the fused step chains it in its graph, spec_decode/fused.py). A decode step that drafts
fewer depths than the checkpoint has own layers (adaptive k) runs the chain only as deep as it drafts; the
deeper own layers write their KV fed the main model's hidden states (MTPProposer._exact_depth). One drafting
none (adaptive k = 0) still runs layer 0 over its positions, KV only, so the caches are whole when drafting
resumes. Slots written past the accepted length are never read before being overwritten.
"""
import torch

from mtpserve.sampling import processors
from mtpserve.sampling.sampler import TARGET_NOISE, draw, request_probs, sample
from mtpserve.step import Row


def decode_exact_depth(k: int, chain_depth: int) -> int:
    """The own layers a decode step drafting k tokens runs as trained (MTPProposer._exact_depth; the fused
    graphs use the same rule)."""
    return max(1, min(k, chain_depth))


class MTPProposer:
    fuses_with_verification = True   # graph mode: its drafting runs in the fused step's graph (spec_decode/fused.py)

    def __init__(self, spec, model, forward, generator, device, static_shapes: bool = False):
        """forward(what, rows, prev_hidden) runs "mtp{layer}" on rows (graph or eager) -> hidden per token.
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
                 [(f"mtp{j}", 1 + v) for j in range(self._chain_depth()) for v in verified])
        shared_depths = self.spec.num_speculative_tokens > self._chain_depth() + chained
        return first + ([("mtp0", 1)] if shared_depths else [])

    def next_k(self, scheduled) -> int:
        """Drafts this step proposes (the engine's policy set one k for every request: adaptive.plan_drafts)."""
        return max((s.num_next_drafts for s in scheduled if s.samples), default=0)

    def propose(self, scheduled, hidden, offsets, new_tokens) -> list[tuple]:
        """Per request, (next drafts, their distributions [k, V] or None for argmax drafts); (None, None) for one
        that did not sample this step. new_tokens: what each request emitted this step."""
        drafts = self._run_passes(scheduled, hidden, offsets, new_tokens, self.next_k(scheduled))
        for s in scheduled:   # (only now: a step that raised is run again, engine._execute_isolating)
            if s.samples:
                s.req.mtp_prefix_hidden = None
        return drafts

    def _run_passes(self, scheduled, hidden, offsets, new_tokens, k: int) -> list[tuple]:
        verified = len(scheduled[0].draft_token_ids) if scheduled else 0
        static = self.static_shapes and all(
            s.samples and s.num_new_tokens == 1 and len(s.draft_token_ids) == verified for s in scheduled)
        handed_over = any(s.samples and s.req.mtp_prefix_hidden is not None for s in scheduled)
        # One row per request, the same for every own layer: its positions whose next token is now known, from
        # the step's first (a hand-over, disagg scheme 2: from the prompt's last, fed the hidden state it came
        # with, appended after this step's in `source`). sources: the main hidden state fed at each row token;
        # last: where each request's accepted position lands in the flat layout.
        # Request "a" at 5, pending t5, drafts [d6, d7], d6 accepted, e7 emitted: row tokens [d6, e7] at 5, 6.
        source, rows, sources, last, drafting = [hidden], [], [], [], []
        num_source = len(hidden)
        for i, s in enumerate(scheduled):
            accepted = len(new_tokens[i]) - 1 if s.samples else 0
            own = s.num_new_tokens + accepted   # positions s.start.. whose next token is now known
            tokens = s.req.all_token_ids + new_tokens[i]
            prefix = s.req.mtp_prefix_hidden if s.samples else None
            first = s.start - (prefix is not None)
            row_tokens = tokens[first + 1:s.start + own + 1]
            if static:   # vllm-ascend's static shapes: 1+k tokens (their KV written), run at the accepted index
                row_tokens = row_tokens + [row_tokens[-1]] * (1 + verified - own - (s.start - first))
            row_sources = list(range(offsets[i], offsets[i] + len(row_tokens) - (s.start - first)))
            if prefix is not None:
                source.append(prefix.unsqueeze(0).to(hidden.dtype))
                row_sources = [num_source] + row_sources
                num_source += 1
            last.append(len(sources) + s.start + own - 1 - first)
            rows.append(Row(row_tokens, first, s.req.block_ids))
            sources.extend(row_sources)
            if s.samples and k:   # (k = 0: the pass only fills the MTP cache, for when drafting resumes)
                drafting.append(i)
        # A checkpoint with its own layer for depth j+1 runs it as trained: over the same positions as depth 1,
        # fed depth j's outputs there (chained). That needs every output of the previous pass, not just the last.
        # Its cache must be whole wherever a later step attends: every step writes each own layer of the chain
        # (prompt chunks and steps that draft fewer depths too: those write its KV only, fed the main hidden
        # states, unless a deeper own layer needs its outputs). In graph mode only the fused step has the chain
        # in a graph: other steps run chained passes eagerly.
        chain_depth = self._chain_depth()
        chain = chain_depth > 1
        exact_depth = self._exact_depth(scheduled, k, handed_over)
        source = torch.cat(source) if len(source) > 1 else hidden
        first_outputs = None if exact_depth > 1 else last if drafting or self.static_shapes else []
        out = self.forward("mtp0", rows, source[sources], output_index=first_outputs)
        none = [(None, None)] * len(scheduled)
        if not drafting and not chain:   # the pass just filled the MTP cache
            return none
        reqs = [scheduled[i].req for i in drafting]
        draft_positions = [scheduled[i].req.num_tokens + len(new_tokens[i]) for i in drafting]
        prev_hidden = out[[last[i] for i in drafting]] if exact_depth > 1 else out[drafting]
        drafts, draft_probs, depth_hidden = [], [], [prev_hidden]
        # the tokens each drafting request has generated past its output by each depth (its processors read them)
        generated = ([new_tokens[i] for i in drafting] if any(r.params.processes_logits for r in reqs)
                     else None)
        if drafting:
            token, probs = self._draft(0, prev_hidden, reqs, draft_positions, generated)
            drafts, draft_probs = [token], [probs]
        next_pos = [scheduled[i].start + len(new_tokens[i]) + scheduled[i].num_new_tokens - 1
                    for i in drafting]
        if chain:   # every request's rows, prompt chunks too: they fill the own layers' caches at their positions
            chain_hidden = out   # (one output per row token of the layer before, in order)
            known = [s.req.all_token_ids + new_tokens[i] for i, s in enumerate(scheduled)]
        num_layers = self.model.num_mtp_layers
        for j in range(1, max(k, chain_depth)):
            layer = j if j < num_layers else 0
            if chain and layer == j:   # depth j+1 at position p: embedding of t[p+j+1], depth j's output at p
                if j <= k:
                    for i, d in zip(drafting, drafts[j - 1].tolist()):
                        known[i] = known[i] + [d]
                step_rows = [self._chain_row(t, r, j, scheduled[i].samples)
                             for i, (t, r) in enumerate(zip(known, rows))]
                if j >= exact_depth:   # its KV only, fed the main hidden states
                    self.forward(f"mtp{layer}", step_rows, source[sources], output_index=[])
                    continue
                if j + 1 < exact_depth:   # a deeper own layer reads every output of this one
                    chain_hidden = self.forward(f"mtp{layer}", step_rows, chain_hidden)
                    prev_hidden = chain_hidden[[last[i] for i in drafting]]
                elif j < k:   # the last own layer: its KV everywhere, its outputs only where a draft is read
                    # (graph mode: every output, as the chain's graphs compute them)
                    out = self.forward(f"mtp{layer}", step_rows, chain_hidden, output_index=None if static else last)
                    prev_hidden = (out[last] if static else out)[drafting]
                else:   # not drafted at this depth this step: its KV only
                    self.forward(f"mtp{layer}", step_rows, chain_hidden, output_index=[])
            else:   # a shared layer: one token at the next position, fed the previous pass's last output
                # (the first depth past a checkpoint's own layers also covers the positions those depths drafted
                # at, which layer 0's cache holds nothing for yet: as if layer 0 had drafted every depth)
                span = j if chain and j == num_layers else 1
                tokens = torch.stack(drafts[-span:], dim=1).tolist()
                step_rows = [Row(t, p - span + 1, scheduled[i].req.block_ids)
                             for i, t, p in zip(drafting, tokens, next_pos)]
                inputs = torch.stack(depth_hidden[-span:], dim=1).flatten(0, 1)
                outputs = [span * (n + 1) - 1 for n in range(len(drafting))] if span > 1 else None
                prev_hidden = self.forward(f"mtp{layer}", step_rows, inputs, output_index=outputs)
            if j >= k:
                continue
            if generated is not None:
                generated = [g + [d] for g, d in zip(generated, drafts[-1].tolist())]
            token, probs = self._draft(layer, prev_hidden, reqs, [p + j for p in draft_positions], generated)
            drafts.append(token)
            draft_probs.append(probs)
            depth_hidden.append(prev_hidden)
            next_pos = [p + 1 for p in next_pos]
        if not drafting:
            return none
        drafts = torch.stack(drafts, dim=1).tolist()   # (one k for the whole step: adaptive.plan_drafts)
        probs = torch.stack(draft_probs, dim=1) if draft_probs[0] is not None else [None] * len(drafting)
        found = dict(zip(drafting, zip(drafts, probs)))
        return [found.get(i, (None, None)) for i in range(len(scheduled))]

    def _exact_depth(self, scheduled, k: int, handed_over: bool) -> int:
        """The own layers this step runs as trained (chained, each fed the outputs of the one before); the deeper
        own layers only write their KV, fed the main model's hidden states instead of the previous layer's
        outputs. A decode step runs as many as it drafts (decode_exact_depth; the fused graphs use the same rule):
        an adaptive engine drafting one token runs layer 0 at the accepted index only (as fixed k = 1 does). The
        KV written so is not what the chain would write, and a later step drafting more depths reads it: its
        drafts differ (deterministically), its verification stays lossless. Steps with prompt chunks (or a
        handed-over hidden state) run every own layer as trained: a prompt's KV is read by every later step."""
        prompt = handed_over or any(not s.samples or s.num_new_tokens > 1 for s in scheduled)
        return self._chain_depth() if prompt else decode_exact_depth(k, self._chain_depth())

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
            raise RuntimeError("MTP chain: a prompt chunk ends too close to the prompt's end (Scheduler.min_last_chunk)")
        return Row(tokens + known[-1:] * missing, row.start, row.block_ids)

    def num_passes(self, scheduled) -> int:
        """The MTP passes propose() runs for this step: k when a request drafts, and at least the chained own
        layers (every step writes them, to keep their caches whole)."""
        return max(self.next_k(scheduled), self._chain_depth())

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
        # a seeded request's draft gets the noise its slot will be verified with (coupled verification, spec_decode/verify.py)
        noise = draw([r.seed for r in reqs], positions, 1, probs.shape[-1], "exponential", TARGET_NOISE, self.generator,
                     self.device, [r.params.greedy for r in reqs])
        token = sample(probs, noise[:, 0])
        if vocab is None:
            return token, probs
        full = probs.new_zeros(probs.shape[0], self.model.config.vocab_size).index_copy_(1, vocab, probs)
        return vocab[token], full
