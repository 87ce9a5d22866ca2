"""Speculative-decoding counters, named as vLLM names them."""
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("mtpserve")


@dataclass
class SpecDecodeMetrics:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)   # verifications with a draft there
    log_interval_s: float = 10.0
    _last_log: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.accepted_per_position = [0] * self.num_speculative_tokens
        self.drafted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: `num_drafts` drafts checked, the first `num_accepted` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1
        for pos in range(num_drafts):
            self.drafted_per_position[pos] += 1

    def as_dict(self) -> dict:
        return dict(
            num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens, accepted_per_position=list(self.accepted_per_position),
            drafted_per_position=list(self.drafted_per_position),
            acceptance_rate=self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            mean_acceptance_length=1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0)

    def maybe_log(self) -> bool:
        """Logs the counters every log_interval_s; True when it did."""
        now = time.monotonic()
        if now - self._last_log < self.log_interval_s or not self.num_drafts:
            return False
        self._last_log = now
        m = self.as_dict()
        per_pos = ", ".join(f"{a / d:.3f}" if d else "-"
                            for a, d in zip(self.accepted_per_position, self.drafted_per_position))
        logger.info("SpecDecoding metrics: mean acceptance length %.2f, accepted %d/%d draft tokens "
                    "(%.1f%%), drafts %d, per-position acceptance [%s]", m["mean_acceptance_length"],
                    self.num_accepted_tokens, self.num_draft_tokens, 100 * m["acceptance_rate"],
                    self.num_drafts, per_pos)
        return True
