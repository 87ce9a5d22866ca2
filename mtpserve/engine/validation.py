"""A request's checks before it enters the engine: a ValueError that names the field and the limit."""
import dataclasses

from mtpserve.sampling.grammar import GrammarState, compiler_for
from mtpserve.sampling_params import SamplingParams


def prepare_params(engine, params: SamplingParams) -> SamplingParams:
    """A copy of params with what the engine adds: the ids min_tokens masks (EOS unless ignore_eos, and
    stop_token_ids), bad_words tokenised (with and without a leading space, as vLLM), and logprobs turned on
    (hidden) when best_of > n ranks completions by them."""
    vocab = engine.model_config.vocab_size
    for name, ids in (("logit_bias", [int(t) for t in params.logit_bias or {}]),
                      ("allowed_token_ids", params.allowed_token_ids or [])):
        if any(t >= vocab for t in ids):
            raise ValueError(f"{name}: token ids must be below the vocabulary size {vocab}")
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else engine.eos_token_ids)
    bad_words = []
    if params.bad_words:
        if engine.tokenizer is None:
            raise ValueError("bad_words: this model has no tokenizer")
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = engine.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in bad_words:
                    bad_words.append(ids)
    hidden = params.best_of is not None and params.best_of > params.n and params.logprobs is None
    if params.structured_outputs is not None:   # (refused here if it does not compile; cached for the request)
        grammar_compiler(engine).compile(params.structured_outputs)
    return dataclasses.replace(params, all_stop_token_ids=frozenset(stop_ids), bad_words_token_ids=bad_words,
                               logprobs=0 if hidden else params.logprobs, hidden_logprobs=hidden)


def grammar_compiler(engine):
    """The engine's structured-outputs compiler (sampling/grammar.py), made on first use."""
    if engine.grammars is None:
        engine.grammars = compiler_for(engine.model_config, engine.tokenizer)
    return engine.grammars


def grammar_state(engine, params: SamplingParams):
    """A new request's matcher (None without structured outputs)."""
    if params.structured_outputs is None:
        return None
    return GrammarState(grammar_compiler(engine).compile(params.structured_outputs))


def check_request(engine, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams,
                  data_parallel_rank: int | None) -> tuple[list[int], int]:
    """-> (the prompt's token ids, truncated to params.truncate_prompt_tokens; max_tokens resolved against
    max_model_len)."""
    dp = engine.config.data_parallel_size
    if data_parallel_rank is not None and not (isinstance(data_parallel_rank, int) and 0 <= data_parallel_rank < dp):
        raise ValueError(f"data_parallel_rank = {data_parallel_rank!r}: must be in [0, data_parallel_size = {dp})")
    vocab = engine.model_config.vocab_size
    if params.top_k > vocab:
        raise ValueError(f"top_k = {params.top_k}: must be -1 (off) or at most the vocabulary size {vocab}")
    if any(t >= vocab for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids: ids must be below the vocabulary size {vocab}")
    token_ids = prompt_tokens(engine.tokenizer, vocab, prompt, prompt_token_ids)
    if params.truncate_prompt_tokens is not None:
        token_ids = token_ids[-params.truncate_prompt_tokens:]
    room = engine.max_model_len - len(token_ids)
    if room <= 0:
        raise ValueError(f"prompt: {len(token_ids)} tokens, at or over max_model_len = {engine.max_model_len}")
    if params.max_tokens is not None and params.max_tokens > room:
        raise ValueError(f"max_tokens = {params.max_tokens}: prompt ({len(token_ids)} tokens) + max_tokens "
                         f"exceeds max_model_len = {engine.max_model_len}")
    slots = len(token_ids) + (params.max_tokens or room) + engine.max_step_overshoot
    blocks, block_size = engine.block_manager.num_blocks, engine.config.block_size
    if -(-slots // block_size) > blocks:
        raise ValueError(f"max_tokens: prompt + max_tokens ({slots} KV slots with lookahead) would not fit in "
                         f"the KV cache ({blocks} blocks of {block_size})")
    return token_ids, params.max_tokens or room


def prompt_tokens(tokenizer, vocab: int, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
    if prompt_token_ids is None:
        if prompt is None:
            raise ValueError("prompt: give a prompt or prompt_token_ids")
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
        prompt_token_ids = tokenizer.encode(prompt)
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt: empty prompt")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_token_ids: ids {bad[:5]} outside the vocabulary [0, {vocab})")
    return list(prompt_token_ids)
