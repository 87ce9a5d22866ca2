"""A request's checks before it enters the engine: a ValueError that names the field and the limit."""
from mtpserve.sampling_params import SamplingParams


def check_request(engine, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams,
                  data_parallel_rank: int | None) -> tuple[list[int], int]:
    """-> (the prompt's token ids, max_tokens resolved against max_model_len)."""
    dp = engine.config.data_parallel_size
    if data_parallel_rank is not None and not (isinstance(data_parallel_rank, int) and 0 <= data_parallel_rank < dp):
        raise ValueError(f"data_parallel_rank = {data_parallel_rank!r}: must be in [0, data_parallel_size = {dp})")
    vocab = engine.model_config.vocab_size
    if params.top_k > vocab:
        raise ValueError(f"top_k = {params.top_k}: must be -1 (off) or at most the vocabulary size {vocab}")
    if any(t >= vocab for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids: ids must be below the vocabulary size {vocab}")
    token_ids = prompt_tokens(engine.tokenizer, vocab, prompt, prompt_token_ids)
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
