"""A request's state inside the engine, and the vLLM-shaped outputs handed to callers."""
import enum
import time
from dataclasses import dataclass, field

import torch

from mtpserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                                  # resolved against max_model_len
    seed: int | None = None                          # params.seed + index: keys this completion's draws
    index: int = 0                                   # which of the parent's n completions
    parent_id: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0                     # tokens whose main and MTP KV is valid
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # prefix-cache hashes of its first full blocks
    num_cached_tokens: int = 0                       # prompt tokens the prefix cache held when it was admitted
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None          # [k, V] when drafts were sampled
    text: str = ""
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    error: str | None = None                         # why the engine failed it (finish_reason "error")
    dp_rank: int = 0                                 # the data-parallel rank (engine core) that runs it
    # prefill/decode disaggregation (mtpserve/disagg/)
    hold_kv: bool = False                            # prefill side: finished, its KV blocks wait to be pulled
    last_hidden: torch.Tensor | None = None          # prefill side: hidden state at the last prompt position
    logprobs: list = field(default_factory=list)      # per output token {token: Logprob} (params.logprobs set)
    prompt_logprobs: list = field(default_factory=list)   # per prompt token: None, then {token: Logprob}
    grammar: object = None                           # structured outputs: its GrammarState (sampling/grammar.py)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


def request_seed(params: SamplingParams, index: int) -> int | None:
    """The seed of completion `index` of a seeded request (None: unseeded, the engine's generator)."""
    return None if params.seed is None else params.seed + index


@dataclass
class Logprob:
    """vLLM's: a token's log-probability under the target model, its rank (1 = most likely), its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None   # per token: the sampled one and the top params.logprobs
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None   # set when the engine failed the request (its finish_reason is "error")
    num_cached_tokens: int = 0   # prompt tokens found in the prefix cache
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # None for the first prompt token
