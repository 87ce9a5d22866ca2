"""Per-request sampling parameters (vLLM's names and defaults)."""
import math
from dataclasses import dataclass, field

from mtpserve.sampling.grammar import StructuredOutputsParams

MAX_LOGPROBS = 20   # vLLM's default max_logprobs


def _as_float(x) -> float:
    """x as a float; an integer too large for one is infinite (so that the range checks refuse it)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None            # >= n: best_of completions run, the n of highest cumulative logprob kept
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                       # -1 or 0: off
    min_p: float = 0.0                    # drops tokens below min_p x the most likely one's probability
    repetition_penalty: float = 1.0       # > 1: prompt and output tokens' logits divided (positive) / multiplied
    frequency_penalty: float = 0.0        # subtracted x the token's count in the output
    presence_penalty: float = 0.0         # subtracted once if the token is in the output
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    max_tokens: int | None = 16           # None: up to max_model_len
    min_tokens: int = 0                   # EOS and stop token ids masked until this many tokens are out
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None           # the sampled token's logprob and this many top ones, per output token
    prompt_logprobs: int | None = None    # the same for every prompt token after the first
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last this many tokens
    structured_outputs: StructuredOutputsParams | dict | None = None   # a grammar the output follows
    cache_salt: str | None = None         # prefix-cache blocks are shared only between requests of one salt
    # set by the engine when the request is added (validation.prepare_params), not by callers:
    all_stop_token_ids: frozenset = field(default=frozenset(), repr=False)   # min_tokens masks these
    bad_words_token_ids: list = field(default_factory=list, repr=False)      # bad_words, tokenised
    hidden_logprobs: bool = field(default=False, repr=False)   # computed only to rank best_of, not returned

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Some logits processor acts on this request's distributions (sampling/processors.py)."""
        return self.penalizes or self.processes_on_host

    @property
    def penalizes(self) -> bool:
        """Repetition, frequency or presence penalties (the fused decode step applies them too)."""
        return bool(self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty)

    @property
    def processes_on_host(self) -> bool:
        """Processors only the host applies, row by row: its decode steps take the separate path."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids
                    or self.min_tokens or self.structured_outputs is not None)

    def validate(self) -> None:
        def bad(name, why):
            raise ValueError(f"{name} = {getattr(self, name)!r}: {why}")

        def number(name, ok, why):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(_as_float(value)):
                bad(name, why)
        if not isinstance(self.n, int) or self.n < 1 or self.n > 128:
            bad("n", "must be an integer in [1, 128]")
        if self.best_of is not None and (not isinstance(self.best_of, int) or not self.n <= self.best_of <= 128):
            bad("best_of", f"must be an integer in [n = {self.n}, 128]")
        number("temperature", lambda x: 0 <= x < math.inf, "must be a finite number >= 0")
        number("top_p", lambda x: 0 < x <= 1, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**31:
            bad("top_k", "must be -1 (off), 0 (off) or a positive integer below 2^31")
        number("min_p", lambda x: 0 <= x <= 1, "must be in [0, 1]")
        number("repetition_penalty", lambda x: 0 < x <= 100, "must be in (0, 100]")
        number("frequency_penalty", lambda x: -2 <= x <= 2, "must be in [-2, 2]")
        number("presence_penalty", lambda x: -2 <= x <= 2, "must be in [-2, 2]")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict)
                or not all(_token_id(t) and isinstance(b, (int, float)) and not isinstance(b, bool)
                           and -100 <= _as_float(b) <= 100 for t, b in self.logit_bias.items())):
            bad("logit_bias", "must map token ids to numbers in [-100, 100]")
        if self.allowed_token_ids is not None and (not isinstance(self.allowed_token_ids, list)
                                                   or not self.allowed_token_ids
                                                   or not all(_token_id(t) for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of token ids")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or not all(isinstance(w, str) and w for w in self.bad_words)):
            bad("bad_words", "must be a list of non-empty strings")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be a positive integer")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be an integer in [0, max_tokens = {self.max_tokens}]")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63 - 128):
            bad("seed", "must be an integer in [-2^63, 2^63 - 128)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not _token_id(t) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.truncate_prompt_tokens is not None and (not isinstance(self.truncate_prompt_tokens, int)
                                                        or self.truncate_prompt_tokens < 1):
            bad("truncate_prompt_tokens", "must be a positive integer")
        if self.structured_outputs is not None and self.ignore_eos:
            bad("ignore_eos", "cannot be true with structured_outputs (the output ends where the grammar does)")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            bad("cache_salt", "must be a non-empty string")


def _token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0
