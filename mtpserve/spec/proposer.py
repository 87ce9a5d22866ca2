"""MTP drafting (DeepSeek-V3's predict phase).

Pass 0 runs MTP layer 0 over every position whose main-model hidden state was computed this step and whose
next token is now known (a prompt chunk; or the pending token plus the accepted drafts), with the tokens
shifted by one. That fills the MTP KV cache exactly where the main cache is valid, and its output at the
last position gives draft 1. Passes 1..k-1 run one token each, at the next position, fed draft j and the
previous pass's output hidden state; pass j uses MTP layer j if the checkpoint has it, else layer 0
(DeepSeek-V3 ships one layer, so all passes share it and its cache). Slots written past the accepted length
are never read before being overwritten.
"""
import torch

from mtpserve.runner.batch import Row, build_batch
from mtpserve.sampling.sampler import draw, logits_to_probs, sample, sampling_tensors


class MTPProposer:
    def __init__(self, model, spec, mtp_caches, block_size, device, generator):
        self.model, self.spec, self.caches = model, spec, mtp_caches
        self.block_size, self.device, self.generator = block_size, device, generator

    def propose(self, scheduled, hidden, offsets, results) -> None:
        """Sets results[i].next_drafts (and next_draft_probs) for every request that sampled this step."""
        rows, hidden_idx, drafting = [], [], []
        for i, s in enumerate(scheduled):
            accepted = len(results[i].new_token_ids) - 1 if s.samples else 0
            valid = s.num_new_tokens + accepted
            tokens = s.req.all_token_ids + results[i].new_token_ids
            rows.append(Row(tokens[s.start + 1:s.start + valid + 1], s.start, s.req.block_ids))
            hidden_idx.extend(range(offsets[i], offsets[i] + valid))
            if s.samples:
                drafting.append(i)
        input_ids, positions, meta = build_batch(rows, self.block_size, self.device)
        out = self.model.mtp_forward(0, input_ids, positions, hidden[hidden_idx], meta, self.caches[0])
        if not drafting:
            return
        last = meta.query_start_loc[1:] - 1
        prev_hidden = out[last[drafting]]
        reqs = [scheduled[i].req for i in drafting]
        token, probs = self._draft(0, prev_hidden, reqs)
        drafts, draft_probs = [token], [probs]
        next_pos = [rows[i].start + len(rows[i].token_ids) for i in drafting]
        for j in range(1, self.spec.num_speculative_tokens):
            layer = j if j < len(self.caches) else 0
            step_rows = [Row([t], p, scheduled[i].req.block_ids)
                         for i, t, p in zip(drafting, drafts[-1].tolist(), next_pos)]
            input_ids, positions, meta = build_batch(step_rows, self.block_size, self.device)
            prev_hidden = self.model.mtp_forward(layer, input_ids, positions, prev_hidden, meta, self.caches[layer])
            token, probs = self._draft(layer, prev_hidden, reqs)
            drafts.append(token)
            draft_probs.append(probs)
            next_pos = [p + 1 for p in next_pos]
        drafts = torch.stack(drafts, dim=1).tolist()
        for n, i in enumerate(drafting):
            results[i].next_drafts = drafts[n]
            if draft_probs[0] is not None:
                results[i].next_draft_probs = torch.stack([p[n] for p in draft_probs])

    def _draft(self, layer, hidden, reqs):
        logits = self.model.mtp_logits(layer, hidden)
        if self.spec.draft_sampling == "greedy":
            return logits.argmax(-1), None
        probs = logits_to_probs(logits, *sampling_tensors(reqs, None, self.device))
        noise = draw([r.generator for r in reqs], (probs.shape[-1],), "exponential", self.generator, self.device,
                     [r.params.greedy for r in reqs])
        return sample(probs, noise), probs
