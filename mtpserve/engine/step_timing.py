"""How the engine times its steps for adaptive speculation (spec_decode/adaptive.py): the step() call alone
(offline), or, behind a server, until the next step starts (`apart`, set by AsyncEngine: the loop's streaming
and stats between steps cost a step too)."""
import time
from dataclasses import dataclass

from mtpserve.spec_decode import adaptive


@dataclass
class StepTiming:
    policy: adaptive.AdaptiveK
    apart: bool = False
    pending: tuple | None = None   # (apart) the last step's observation, waiting for the next step to start

    def behind_a_server(self) -> None:
        """Steps are timed until the next one starts, and a draft need not buy the premium that pays for a batch
        left to drain (adaptive.py): a server's arrivals refill its batch."""
        self.apart = True
        self.policy.draft_premium = 0.0

    def step_started(self, now: float) -> None:
        """A step starts: the one before it is timed until now."""
        if self.pending is not None:
            steady, results, k, started = self.pending
            self.pending = None
            adaptive.observe(self.policy, steady, results, k, now - started)

    def step_done(self, steady: int | None, results, k: int, started: float, more_steps: bool) -> None:
        """A step's acceptance and time (adaptive.observe); apart, its time once the next step starts, when one
        follows at once (more_steps: requests are left)."""
        if self.apart and more_steps:
            self.pending = (steady, results, k, started)
        else:
            adaptive.observe(self.policy, steady, results, k, time.perf_counter() - started)

    def untimed(self) -> None:
        """The next step may follow an idle wait (an abort): the last step's acceptance counts, its time not."""
        if self.pending is not None:
            _, results, k, _ = self.pending
            self.pending = None
            adaptive.observe(self.policy, None, results, k, 0.0)
