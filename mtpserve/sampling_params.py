"""Per-request sampling parameters (vLLM's names and defaults)."""
import math
from dataclasses import dataclass


def _as_float(x) -> float:
    """x as a float; an integer too large for one is infinite (so that the range checks refuse it)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                       # -1 or 0: off
    max_tokens: int | None = 16           # None: up to max_model_len
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None         # prefix-cache blocks are shared only between requests of one salt

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(name, why):
            raise ValueError(f"{name} = {getattr(self, name)!r}: {why}")
        if not isinstance(self.n, int) or self.n < 1 or self.n > 128:
            bad("n", "must be an integer in [1, 128]")
        if not isinstance(self.temperature, (int, float)) or not 0 <= _as_float(self.temperature) < math.inf:
            bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < _as_float(self.top_p) <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**31:
            bad("top_k", "must be -1 (off), 0 (off) or a positive integer below 2^31")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be a positive integer")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63 - 128):
            bad("seed", "must be an integer in [-2^63, 2^63 - 128)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            bad("cache_salt", "must be a non-empty string")
