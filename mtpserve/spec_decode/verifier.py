"""Scoring a step's drafts with the target model, the same for every drafter: greedy matching when every
request is greedy, else token-wise / block / coupled verification (spec_decode/verify.py) on the target's
distributions with each request's draws (sampling/sampler.py), or the lossy synthetic-acceptance mode."""
import torch

from mtpserve.sampling import processors
from mtpserve.sampling.sampler import ACCEPT_UNIFORM, TARGET_NOISE, draw, request_probs, sample
from mtpserve.spec_decode.verify import coupled_rows, verify_tokens
from mtpserve.step import StepResult


def stack_draft_probs(reqs, drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, k, V] draft distributions; greedy requests carry none (their drafts are argmaxes): one-hot."""
    probs = torch.zeros(*drafts.shape, vocab, device=drafts.device).scatter_(-1, drafts.unsqueeze(-1), 1.0)
    for b, r in enumerate(reqs):
        if r.draft_probs is not None:
            probs[b] = r.draft_probs
    return probs


class Verifier:
    def __init__(self, spec, model, generator: torch.Generator, device):
        self.spec, self.model, self.generator, self.device = spec, model, generator, device

    def __call__(self, idx, scheduled, hidden, offsets) -> dict:
        """Verifies the drafts of scheduled[i] for i in idx (hidden: the target's states for the step's flat
        batch, request i's from offsets[i]) -> {i: StepResult(new tokens, drafts verified, drafts accepted)}."""
        verified = {}
        for k in sorted({len(scheduled[i].draft_token_ids) for i in idx}):   # (a step may mix draft lengths)
            verified |= self._verify(k, [i for i in idx if len(scheduled[i].draft_token_ids) == k], scheduled,
                                     hidden, offsets)
        return verified

    def _verify(self, k, idx, scheduled, hidden, offsets) -> dict:
        reqs = [scheduled[i].req for i in idx]
        rows = [offsets[i] + scheduled[i].num_query_tokens - k - 1 + j for i in idx for j in range(k + 1)]
        drafts = torch.tensor([scheduled[i].draft_token_ids for i in idx], device=self.device)
        # position j of request i is processed as if drafts[:j] were generated (processors.py)
        logits = processors.process(self.model.compute_logits(hidden[rows]), [
            h for i in idx for h in processors.histories(scheduled[i].req, [scheduled[i].draft_token_ids[:j]
                                                                            for j in range(k + 1)])])
        if self.spec.synthetic_acceptance is None and all(r.params.greedy for r in reqs):
            # greedy matching: keep drafts while they equal the target's argmax, then one argmax more
            target_ids = logits.argmax(-1).view(len(idx), k + 1)
            accepted = (drafts == target_ids[:, :k]).long().cumprod(-1).sum(-1)
            return self._record(idx, target_ids, accepted, k)
        target = request_probs(logits, reqs, [k + 1] * len(idx), self.device).view(len(idx), k + 1, -1)
        seeds, positions = [r.seed for r in reqs], [r.num_tokens for r in reqs]
        greedy = [r.params.greedy for r in reqs]
        synthetic = self.spec.synthetic_acceptance is not None   # its coin flips are real even for greedy rows
        draft_probs = None
        if not synthetic and self.spec.draft_sampling == "probabilistic" and any(r.draft_probs is not None for r in reqs):
            draft_probs = stack_draft_probs(reqs, drafts, target.shape[-1])
        coupled = coupled_rows(draft_probs, self.spec.verification, [s is not None for s in seeds])
        uniforms = None
        if synthetic or not all(coupled):
            uniforms = draw(seeds, positions, k, 1, "uniform", ACCEPT_UNIFORM, self.generator, self.device,
                            None if synthetic else greedy)[..., 0]
        noise = draw(seeds, positions, k + 1, target.shape[-1], "exponential", TARGET_NOISE, self.generator,
                     self.device, greedy)
        if synthetic:
            tokens, accepted = self._synthetic(drafts, target, uniforms, noise)
        else:
            tokens, accepted = verify_tokens(drafts, draft_probs, target, uniforms, noise, self.spec.verification,
                                             coupled)
        return self._record(idx, tokens, accepted, k)

    @staticmethod
    def _record(idx, tokens, accepted, k) -> dict:
        return {i: StepResult(row[:a + 1], k, a) for i, row, a in zip(idx, tokens.tolist(), accepted.tolist())}

    def _synthetic(self, drafts, target, uniforms, noise):
        """Measurement mode (bench --synthetic-acceptance): each draft passes with a fixed probability,
        whatever the models say. Measures the machinery's cost on random weights; NOT lossless."""
        passed = (uniforms < self.spec.synthetic_acceptance).long()
        accepted = passed.cumprod(-1).sum(-1)
        extra = sample(target, noise)                       # [B, k+1]
        tokens = torch.cat([drafts, extra[:, -1:]], dim=-1)
        tokens.scatter_(1, accepted.unsqueeze(-1), extra.gather(1, accepted.unsqueeze(-1)))
        return tokens, accepted
