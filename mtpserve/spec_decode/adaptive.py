"""Adaptive speculation length: each step the engine picks how many tokens to draft, k in [0, max], for the
step after it, to maximise the expected tokens per second.

    tokens per second (k) = E[tokens per request | k] / seconds per step (batch size, k)

E[tokens | k] = 1 + sum_{i=1..k} prod_{j<i} c_j, with c_j the acceptance of draft position j given every
earlier one was accepted, counted (exponentially decayed) over the drafts verified so far, from a prior worth a
few drafts: for position 1 a fixed guess, for a deeper one the acceptance estimated at the position before (a
position that only a larger k drafts is reached rarely while a smaller k is in use, and a fixed guess below
the measured ones would keep that k looking worse than the data has a chance to show), and
for a request with r tokens left before max_tokens, capped at r (its drafts past r - 1 buy nothing). The
seconds per step of the k in use are the median of its last steps timed at that batch size (linear in the batch
size between measured sizes), seeded by a calibration at start-up and refreshed by the steps the engine runs;
another k is priced relative to it, by the ratio of their costs measured side by side (at calibration, then by
the probes below against the in-use steps just before them, at the same batch size), since this machine's speed
drifts within minutes, and a server's steps cost more than the calibration's (HTTP and streaming share the CPU). A step
is timed as the engine's whole step() call: the forward and the engine's own work on it (detokenising what it
emitted grows with k; the forward alone rose more slowly with k than the engine's throughput did); behind a
server, until the next step starts (engine/step_timing.py: the loop's streaming and stats between steps).
Every ``probe_every`` steps three steps draft a neighbouring k (one more, one fewer, in turn), so that the
costs and the acceptance of the k that could overtake the best stay measured: without it, a k given up on early
(k = 0 verifies nothing) is never reconsidered; a k two away is reached through its neighbour. (Three: the first
verifies the old k's drafts; the second verifies and drafts the probed k, but runs right after a switch, which
makes it slower than a steady step (see observe); the third is the one a cost is timed on.)
Each draft past the first must also buy DRAFT_PREMIUM more tokens per second than the k one fewer: a larger k
spreads the progress of requests started together (as many as 1+k tokens a step for a request whose drafts are
accepted, one for another), so a batch that runs to completion spends more steps at a shrinking batch size, which
the rate of one step does not see (measured at batch 64, 32 prompt + 64 output tokens, four runs each: the steady
steps of k = 3 cost 1.65x those of k = 1 for 1.62x the tokens, a tie, while whole runs of k = 3 were 10-12% slower:
the last requests of k = 3 finished 14-20 steps after the first, taking a third of the run, k = 1's 7-12 steps
after; about 5% per draft). A batch of one has no such spread: the premium is DRAFT_PREMIUM * (1 - 1/batch). The
first draft pays none: measured at batch 64 in lockstep, whole runs of k = 1 were 3-7% faster than no speculation
while its steady steps were 7% ahead (a spread of one token at most per step costs less than this machine's noise
shows), and a premium there kept the engine at k = 0. Behind a server there is none: arrivals refill the batch
instead of leaving it to drain, and what its users see is each request's time per token, which a step's rate
measures (serving, concurrency 16: with the premium the engine drafted 1 where fixed k = 3 gave an 8% lower
TPOT).
k = 0 is plain decoding: an eager decode step drafting nothing runs no MTP pass; it keeps the main hidden states
of the positions it verified, and the next step that drafts writes their MTP KV (no attention, experts or head
needed), so that the caches are whole when drafting resumes; a step drafting fewer tokens than the checkpoint has
own MTP layers leaves the deeper ones owed the same way (spec_decode/mtp_owed.py; graph mode writes them KV only,
MTPProposer._exact_depth), so that a step drafting k costs about what fixed k's does. Whatever k is picked,
verification is lossless: only the number of drafts changes.
"""
import bisect
import itertools
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field


PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.8, 4.0   # position 1's prior: a guess worth 4 drafts (deeper: the one before)
# (0.8: below the 85-90% DeepSeek-V3 reports for its MTP module's first draft; a worse drafter is found out within
# a few dozen drafts. With 0.6 a fresh server priced k = 1, 2, 3 within 2% of each other and spent its first
# workload learning: concurrency 1, three cold starts, TPOT median 9.7 ms against 8.6 with 0.8, fixed k = 3 9.0.)
DECAY = 0.995                                # per verified draft: the counts follow a drifting workload
DRAFT_PREMIUM = 0.05                         # each draft must raise the expected tokens/s by 5% (see above)
                                             # (a batch of B: 5% * (1 - 1/B))
SWITCH_MARGIN = 0.02                         # keep the current k unless another is 2% better (no flapping)
TIMED_STEPS = 9                              # step times kept per (k, batch size); their median is the cost
PROBE_EVERY = 32                             # three steps in this many draft a k other than the best one
PROBE_STEPS = 3
# Graph mode with the fused step: a step that switches k runs the fused graph of the larger k (fused.py:
# switching down it drops drafts, switching up it pads them with guesses), or, where that cannot be, the slower
# separate graphs; so there a switch must promise more, and probes come less often.
FUSED_SWITCH_MARGIN, FUSED_PROBE_EVERY = 0.05, 96


@dataclass
class AdaptiveK:
    max_k: int
    reached: list[float] = field(default_factory=list)    # per position j: drafts verified with 0..j-1 accepted
    accepted: list[float] = field(default_factory=list)   # ... and accepted at j (both decayed counts, no prior)
    timed: dict = field(default_factory=dict)             # k -> {batch size: recent step seconds}
    relative: dict = field(default_factory=dict)          # (k, larger k) -> {size class: recent cost ratios, larger / k}
    last_in_use: deque = field(default_factory=lambda: deque(maxlen=4))   # (k, batch, seconds) of the last steps
    last_steady: tuple | None = None                      # (batch, k) of the step before, if it was steady
    current: int | None = None
    forced: int | None = None                             # (calibration) k to use whatever the rates say
    choices: list[int] = field(default_factory=list)      # steps that drafted each k (k = 0..max_k)
    steps: int = 0                                        # choices made (every probe_every-th one probes)
    switch_margin: float = SWITCH_MARGIN
    probe_every: int = PROBE_EVERY
    draft_premium: float = DRAFT_PREMIUM                  # (0 behind a server: engine/step_timing.py)

    def __post_init__(self):
        if not self.reached:
            self.forget_acceptance()
        self.choices = self.choices or [0] * (self.max_k + 1)

    def forget_acceptance(self) -> None:
        self.reached, self.accepted = [0.0] * self.max_k, [0.0] * self.max_k

    # ---- what was measured ----
    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        for j in range(min(num_drafts, num_accepted + 1)):   # positions reached
            self.reached[j] = self.reached[j] * DECAY + 1
            self.accepted[j] = self.accepted[j] * DECAY + (num_accepted > j)

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        if self.current is not None and k != self.current:   # a probe: priced against the k in use, timed just before
            before = [s for used, b, s in self.last_in_use if used == self.current and b == batch]
            if before:   # (not the in-use k's median at this size: it may hold times from minutes ago, when a
                in_use = statistics.median(before)   # server's steps ran at a third of their cost under load)
                ratio = seconds / in_use if k > self.current else in_use / seconds
                self.relative.setdefault((min(k, self.current), max(k, self.current)), {}).setdefault(
                    size_class(batch), deque(maxlen=TIMED_STEPS)).append(ratio)
        else:
            self.last_in_use.append((k, batch, seconds))
        self.timed.setdefault(k, {}).setdefault(batch, deque(maxlen=TIMED_STEPS)).append(seconds)

    def relate_costs(self, min_steps: int = 3) -> None:
        """Seeds the cost ratios of every pair of k from the step costs timed so far (the calibration), at the
        batch sizes both were timed at in at least min_steps steps (a size its batch passed through once while
        requests finished holds one noisy time)."""
        for k, larger in itertools.combinations(sorted(self.timed), 2):
            sizes = [b for b, t in self.timed[k].items() if len(t) >= min_steps and
                     len(self.timed[larger].get(b, ())) >= min_steps]
            if sizes:
                self.relative[(k, larger)] = {
                    size_class(b): deque([at_batch(self.timed[larger], b) / at_batch(self.timed[k], b)],
                                         maxlen=TIMED_STEPS) for b in sizes}

    @property
    def step_seconds(self) -> dict:
        """k -> {batch size: seconds per step} (the median of the recent steps)."""
        return {k: {b: statistics.median(t) for b, t in by_batch.items()} for k, by_batch in self.timed.items()}

    # ---- the choice ----
    def acceptance(self) -> list[float]:
        out, prior = [], PRIOR_ACCEPTANCE
        for a, r in zip(self.accepted, self.reached):
            prior = (a + PRIOR_WEIGHT * prior) / (r + PRIOR_WEIGHT)
            out.append(prior)
        return out

    def expected_tokens(self, k: int, room: int | None = None) -> float:
        """Tokens a request gets from a step verifying k drafts; room: the most it may still take."""
        total, reach = 1.0, 1.0
        for c in self.acceptance()[:k if room is None else min(k, room - 1)]:
            reach *= c
            total += reach
        return total

    def seconds(self, batch: int, k: int) -> float | None:
        """Step seconds at this batch size. For the k in use, the median of its recent steps (at_batch); for
        another, the cost of the k in use times their ratio, as last measured side by side (a probe against the
        steps just before it, or the calibration): a machine's speed drifts (a shared host's by half within
        minutes, measured), and a cost timed minutes ago, compared with one timed now, would let the drift decide."""
        if self.current is not None and k != self.current:
            ratio = self.cost_ratio(min(k, self.current), max(k, self.current), batch)
            in_use = at_batch(self.timed.get(self.current), batch)
            if ratio and in_use:   # (one ratio per pair, so that the two see each other alike: no flapping)
                return (ratio if k > self.current else 1 / ratio) * in_use
        return at_batch(self.timed.get(k), batch)

    def cost_ratio(self, k: int, larger: int, batch: int) -> float | None:
        """cost(larger) / cost(k): the product of the neighbouring pairs' ratios between them, which the probes
        keep measuring (they draft one more or one fewer), else the pair's own (the calibration's). A pair two
        apart priced by its own ratio kept the calibration's, while its links moved with a server's load: with k = 3
        in use k = 1 looked as good as 3, with k = 1 in use 2 looked best, and the engine went round in a circle."""
        product = 1.0
        for a in range(k, larger):
            link = ratio_at(self.relative.get((a, a + 1)), batch)
            if link is None:
                return ratio_at(self.relative.get((k, larger)), batch)
            product *= link
        return product

    def rates(self, batch: int, rooms: list[int] | None = None) -> list[float]:
        """Expected tokens per second (per request) for k = 0..max_k; rooms: the requests' tokens left before
        max_tokens. A step with more drafts does more work than one with fewer, so its cost is taken as at least
        theirs (noisy or stale timings must not make a bigger k look cheaper)."""
        rooms = Counter(rooms or [])   # (rooms past max_k + 1 are all alike: plan_drafts clips them)
        out, most = [], 0.0
        for k in range(self.max_k + 1):
            s = self.seconds(batch, k)
            most = max(most, s or 0.0)
            tokens = (sum(n * self.expected_tokens(k, room) for room, n in rooms.items()) / rooms.total()
                      if rooms else self.expected_tokens(k))
            out.append(tokens / most if s is not None else 0.0)
        return out

    def rate(self, batch: int, k: int, rooms: list[int] | None = None) -> float:
        return self.rates(batch, rooms)[k]

    def choose(self, batch: int, rooms: list[int] | None = None) -> int:
        """k for the next step of a batch of this size (rooms: its requests' tokens left after this step)."""
        premium = self.draft_premium * (1 - 1 / batch)
        values = [r * (1 - premium) ** max(k - 1, 0) for k, r in enumerate(self.rates(batch, rooms))]
        best = max(range(self.max_k + 1), key=lambda k: values[k])
        if self.current is not None and values[self.current] * (1 + self.switch_margin) >= values[best]:
            best = self.current
        self.current = best
        k = best
        self.steps += 1
        if self.max_k and self.steps % self.probe_every >= self.probe_every - PROBE_STEPS:
            neighbours = [n for n in (best + 1, best - 1) if 0 <= n <= self.max_k]   # in turn
            k = neighbours[self.steps // self.probe_every % len(neighbours)]
        self.choices[k] += 1
        return k


def at_batch(by_batch: dict | None, batch: int) -> float | None:
    """The median of the values kept at this batch size, or interpolated linearly between the nearest sizes
    kept; outside them, extrapolated along the line through the smallest and the largest (two neighbouring sizes,
    say 15 and 16, would let their noise set the slope, even a falling one). None when nothing is kept."""
    if not by_batch:
        return None
    if batch in by_batch:
        return statistics.median(by_batch[batch])
    sizes = sorted(by_batch)
    if len(sizes) == 1:
        return statistics.median(by_batch[sizes[0]])
    if sizes[0] < batch < sizes[-1]:
        i = bisect.bisect_left(sizes, batch)
        lo, hi = sizes[i - 1], sizes[i]
    else:
        lo, hi = sizes[0], sizes[-1]
    v_lo, v_hi = statistics.median(by_batch[lo]), statistics.median(by_batch[hi])
    return max(v_lo + (v_hi - v_lo) * (batch - lo) / (hi - lo), 1e-9)


def size_class(batch: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ...: cost ratios change slowly with the batch size, and probes come at
    whatever size the batch has, so they are pooled by class (a size seen once would keep one noisy ratio)."""
    return batch.bit_length()


def ratio_at(by_class: dict | None, batch: int) -> float | None:
    """The median ratio of this batch size's class; between classes that have one, interpolated linearly in the
    class (the ratio moves from launch-bound to compute-bound as the batch grows: at batch 32, between ratios
    kept at 16 and 64, the nearest one alone was a third off); outside them, the nearest class's."""
    if not by_class:
        return None
    c = size_class(batch)
    if c in by_class:
        return statistics.median(by_class[c])
    lower, higher = [x for x in by_class if x < c], [x for x in by_class if x > c]
    if not lower or not higher:
        return statistics.median(by_class[max(lower) if lower else min(higher)])
    lo, hi = max(lower), min(higher)
    r_lo, r_hi = statistics.median(by_class[lo]), statistics.median(by_class[hi])
    return r_lo + (r_hi - r_lo) * (c - lo) / (hi - lo)


def describe(policy: AdaptiveK, batch: int) -> str:
    """The policy's view at this batch size, for the log."""
    rates = ", ".join(f"{k}: {r:.0f}" for k, r in enumerate(policy.rates(batch)))
    accept = ", ".join(f"{c:.2f}" for c in policy.acceptance())
    return (f"adaptive speculation: k = {policy.current} at batch {batch}; expected tokens/s by k {{{rates}}}, "
            f"acceptance by position [{accept}], steps by k {policy.choices}")


def make_policy(max_k: int, fused_step: bool) -> AdaptiveK:
    """The policy for an engine; fused_step: graph mode runs steps that keep k as one fused graph."""
    if fused_step:
        return AdaptiveK(max_k, switch_margin=FUSED_SWITCH_MARGIN, probe_every=FUSED_PROBE_EVERY)
    return AdaptiveK(max_k)


def plan_drafts(policy: AdaptiveK, scheduled) -> int:
    """Picks k for this step's drafting (the next step's verification) and sets it on every request."""
    if policy.forced is not None:
        k = policy.forced
    elif any(s.req.hold_kv for s in scheduled):   # (a prefill side's hand-off carries every draft and MTP KV)
        k = policy.max_k
    else:   # (a request sampling this step takes at least one token in it)
        rooms = [s.req.max_tokens - len(s.req.output_token_ids) - s.samples for s in scheduled]
        k = policy.choose(len(scheduled), [min(r, policy.max_k + 1) for r in rooms if r > 0])
    for s in scheduled:
        s.num_next_drafts = k
    return k


def steady_batch(scheduled, k: int) -> int | None:
    """The batch size if this is a steady decode step (every request verifies k drafts and drafts k), the shape
    the cost table is keyed on; else None. (Asked before the step's tokens are taken.)"""
    if all(s.samples and s.num_new_tokens == 1 and len(s.draft_token_ids) == k for s in scheduled):
        return len(scheduled)
    return None


def observe(policy: AdaptiveK, steady: int | None, results, k: int, seconds: float) -> None:
    """Acceptance of the drafts verified this step; the step's time when it was steady (steady_batch) and so was
    the step before it, at the same batch size and k. (The first steady step after a switch of k runs slower than
    the steady ones after it, measured in graph mode at batch 1: a fused k = 0 step 2.6-3.1 ms against 2.2 ms,
    k = 1 3.1-3.8 against 2.8-3.1; the switch step ran other code over other weights, and the caches are cold.
    Timing it made every k's cost look like what it costs next to a switch.)"""
    for r in results:
        if not isinstance(r, Exception) and r.num_drafts:
            policy.observe_verification(r.num_drafts, r.num_accepted)
    settled = steady is not None and policy.last_steady == (steady, k)
    policy.last_steady = None if steady is None else (steady, k)
    if settled:
        policy.observe_step(steady, k, seconds)
