"""How many drafts a step proposes: a fixed k (FixedK), or adaptive k in [0, max_k] (AdaptiveK), chosen when the
scheduler plans the step as the k with the most expected tokens per second (uncalibrated: max_k):
    rate(k, batch) = E[tokens | k] / seconds(k, batch),    E[tokens | k] = 1 + c1 + c1*c2 + ... + c1*...*ck
c_j: acceptance of draft j once 1..j-1 were accepted (decayed counts over a prior). seconds: calibration.py's table,
linear in the batch (a machine slowing down slows every k alike: the choice stays). Acceptance [0.8, 0.5], at
batch 1 {0: 1.0, 1: 1.1, 2: 1.2} ms: E = [1, 1.8, 2.2] -> rate = [1.00, 1.64, 1.83] -> k = 2."""
import bisect
import itertools
import logging
import operator
from dataclasses import dataclass, field

from mtpserve.step import StepPlan

logger = logging.getLogger("mtpserve")

PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.8, 4.0   # DeepSeek-V3 reports 85-90% for its MTP module's first draft
DECAY = 0.995                               # per verified draft: the counts follow a drifting workload
SWITCH_MARGIN = 0.02                        # the k in use stays unless another rates 2% better
EXPLORE_EVERY = 64                          # a step drafting one more than the best (k = 0 alone never learns)


@dataclass
class FixedK:
    """Every step drafts max_k (no speculation: max_k = 0)."""
    max_k: int
    adapts = False

    def plan(self, scheduled) -> StepPlan:
        k = self.choose_for(scheduled)
        for s in scheduled:
            s.num_next_drafts = k
        steady = self.adapts and all(s.decodes(k) for s in scheduled)   # (the shape adaptive k's table is keyed on)
        return StepPlan(scheduled, k, len(scheduled) if steady else None)

    def choose_for(self, scheduled) -> int:
        return self.max_k

    def observe(self, plan: StepPlan, results, seconds: float) -> None: ...

    def log(self, batch: int) -> None: ...

    def metrics(self) -> dict:
        return {}


@dataclass
class AdaptiveK(FixedK):
    adapts = True
    table: dict = field(default_factory=dict)       # k -> {batch size: calibrated step seconds}
    reached: list[float] = field(default_factory=list)    # per position j: drafts verified with 0..j-1 accepted
    accepted: list[float] = field(default_factory=list)   # ... and accepted at j
    current: int | None = None
    forced: int | None = None                       # (calibration) the k to draft, whatever the rates say
    choices: list[int] = field(default_factory=list)     # steps that drafted each k
    last_step: tuple | None = None                  # (batch, k, seconds) of the last steady step

    def __post_init__(self):
        self.reached, self.accepted = self.reached or [0.0] * self.max_k, self.accepted or [0.0] * self.max_k
        self.choices = self.choices or [0] * (self.max_k + 1)

    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        for j in range(min(num_drafts, num_accepted + 1)):   # the positions reached
            self.reached[j] = self.reached[j] * DECAY + 1
            self.accepted[j] = self.accepted[j] * DECAY + (num_accepted > j)

    def observe(self, plan: StepPlan, results, seconds: float) -> None:
        for r in results:
            if not isinstance(r, Exception) and r.num_drafts:
                self.observe_verification(r.num_drafts, r.num_accepted)
        if plan.steady_batch is not None:   # (calibration.py reads it)
            self.last_step = (plan.steady_batch, plan.num_next_drafts, seconds)

    def acceptance(self) -> list[float]:
        out, prior = [], PRIOR_ACCEPTANCE
        for a, r in zip(self.accepted, self.reached):
            prior = (a + PRIOR_WEIGHT * prior) / (r + PRIOR_WEIGHT)
            out.append(prior)
        return out

    def expected_tokens(self) -> list[float]:
        """Tokens a request gets from a step verifying k drafts, k = 0..max_k: [1, 1 + c1, 1 + c1 + c1*c2, ...]."""
        return list(itertools.accumulate(itertools.accumulate(self.acceptance(), operator.mul), initial=1.0))

    def seconds(self, batch: int, k: int) -> float:
        return at_batch(self.table[k], batch)

    def rates(self, batch: int, rooms: list[int] | None = None) -> list[float]:
        """Expected tokens per second per request, k = 0..max_k (rooms: the requests' tokens left, as many as a
        step may give: drafts past room - 1 add nothing). A bigger k costs at least what a smaller one does
        (noise must not make it look cheaper)."""
        tokens, rooms = self.expected_tokens(), rooms or [self.max_k + 1]
        out, most = [], 0.0
        for k in range(self.max_k + 1):
            most = max(most, self.seconds(batch, k))
            out.append(sum(tokens[min(k, room - 1)] for room in rooms) / len(rooms) / most)
        return out

    def choose(self, batch: int, rooms: list[int] | None = None) -> int:
        best = self.max_k
        if self.table:
            rates = self.rates(batch, rooms)
            best = max(range(self.max_k + 1), key=rates.__getitem__)
            if self.current is not None and rates[self.current] * (1 + SWITCH_MARGIN) >= rates[best]:
                best = self.current
        self.current = best
        k = min(best + 1, self.max_k) if sum(self.choices) % EXPLORE_EVERY == EXPLORE_EVERY - 1 else best
        self.choices[k] += 1
        return k

    def choose_for(self, scheduled) -> int:
        if self.forced is not None:
            return self.forced
        rooms = [s.req.max_tokens - len(s.req.output_token_ids) - s.samples for s in scheduled]
        return self.choose(len(scheduled), [r for r in rooms if r > 0])

    def log(self, batch: int) -> None:
        logger.info("adaptive speculation: k = %s at batch %d; expected tokens/s by k %s, acceptance by position %s, "
                    "steps by k %s", self.current, batch, [round(r) for r in self.rates(batch)] if self.table
                    else "uncalibrated", [round(c, 2) for c in self.acceptance()], self.choices)

    def metrics(self) -> dict:
        return {"draft_steps_by_k": list(self.choices)}


def at_batch(by_batch: dict, batch: int) -> float:
    """Linear between the nearest sizes timed; outside them, along the line through the smallest and largest."""
    if batch in by_batch or len(by_batch) == 1:
        return by_batch.get(batch) or next(iter(by_batch.values()))
    sizes = sorted(by_batch)
    i = bisect.bisect_left(sizes, batch)
    lo, hi = (sizes[i - 1], sizes[i]) if 0 < i < len(sizes) else (sizes[0], sizes[-1])
    return max(by_batch[lo] + (by_batch[hi] - by_batch[lo]) * (batch - lo) / (hi - lo), 1e-9)


def make_policy(spec) -> FixedK:   # spec: the SpeculativeConfig (None: no speculation)
    return FixedK(0) if spec is None else (AdaptiveK if spec.adaptive else FixedK)(spec.num_speculative_tokens)
