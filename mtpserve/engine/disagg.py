"""Prefill/decode disaggregation (the seed's scheme 1).

The prefill engine runs the prompt through the main model and the MTP module, samples the first token and
drafts the first k tokens. It hands the decode engine everything the next step needs: the main KV cache,
the MTP KV cache (latents only: kv_lora_rank + qk_rope_head_dim values per token per layer), the first
token, and the drafts with their probabilities. The decode engine copies the KV into blocks of its own and
continues the request as if it had prefilled it itself. Here the two engines live in one process and the
hand-off is a plain object; between machines it is what would be sent.
"""
from dataclasses import dataclass

import torch

from mtpserve.engine.engine import LLMEngine
from mtpserve.engine.request import Request, RequestStatus
from mtpserve.sampling_params import SamplingParams


@dataclass
class PrefillHandoff:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int]          # the first token (more if the prefill engine ran further)
    kv: list[torch.Tensor]               # per cache (main layers, then MTP layers): [num_computed, kv_dim]
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None
    generator_state: torch.Tensor | None  # a seeded request's RNG continues where prefill left it
    finish_reason: str | None = None      # set when the request already ended at its first token


def single_process(engine: LLMEngine) -> None:
    if engine.config.data_parallel_size != 1:
        raise ValueError(f"data_parallel_size = {engine.config.data_parallel_size}: in-process disaggregation "
                         "moves one process's KV cache; use data_parallel_size = 1")
    if engine.config.tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size = {engine.config.tensor_parallel_size}: in-process disaggregation "
                         "moves one process's KV cache; use tensor_parallel_size = 1")


def prefill(engine: LLMEngine, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
            params: SamplingParams) -> PrefillHandoff:
    """Runs `request_id` on the prefill engine until it has its first token, then exports and frees it."""
    single_process(engine)
    if params.n != 1:
        raise ValueError("n: disaggregated prefill hands over one sequence per request; use n = 1")
    engine.add_request(request_id, prompt, prompt_token_ids, params)
    req = engine.requests[request_id]
    while not req.output_token_ids and not req.is_finished:
        engine.step()
    kv = []
    if not req.is_finished:
        slots = torch.tensor([engine.block_manager.slot(req, p) for p in range(req.num_computed_tokens)])
        kv = [cache.view(-1, cache.shape[-1])[slots.to(cache.device)].cpu() for cache in engine.runner.kv_caches]
    handoff = PrefillHandoff(request_id, req.prompt, list(req.prompt_token_ids), params, list(req.output_token_ids),
                             kv, list(req.draft_token_ids), req.draft_probs,
                             req.generator.get_state() if req.generator is not None else None, req.finish_reason)
    engine.abort_request(request_id)
    return handoff


def add_prefilled(engine: LLMEngine, h: PrefillHandoff) -> None:
    """Continues a request prefilled elsewhere: its KV is copied into this engine's blocks."""
    single_process(engine)
    if h.finish_reason is not None:
        raise ValueError(f"handoff: request {h.request_id!r} already finished ({h.finish_reason}) at prefill")
    if len(engine.scheduler.running) >= engine.config.max_num_seqs:
        raise RuntimeError("decode engine: max_num_seqs requests are already running")
    k = engine.config.speculative.num_speculative_tokens if engine.config.speculative else 0
    if len(h.draft_token_ids) not in (0, k):
        raise ValueError(f"handoff: {len(h.draft_token_ids)} drafts, this engine verifies num_speculative_tokens={k}")
    if len(h.kv) != len(engine.runner.kv_caches):
        raise ValueError(f"handoff: {len(h.kv)} KV caches, this engine has {len(engine.runner.kv_caches)} "
                         "(both engines need the same model, speculative method and num_speculative_tokens)")
    engine.add_request(h.request_id, h.prompt, h.prompt_token_ids, h.params)
    req: Request = engine.requests[h.request_id]
    engine.scheduler.waiting.remove(req)
    num_computed = h.kv[0].shape[0]
    lookahead = len(h.draft_token_ids) + engine.num_lookahead_slots + 1
    if not engine.block_manager.allocate(req, num_computed + lookahead):
        engine.abort_request(h.request_id)
        raise RuntimeError("decode engine: no free KV blocks for the handed-off request")
    slots = torch.tensor([engine.block_manager.slot(req, p) for p in range(num_computed)], dtype=torch.long)
    for cache, kv in zip(engine.runner.kv_caches, h.kv):
        cache.view(-1, cache.shape[-1])[slots.to(cache.device)] = kv.to(cache.device, cache.dtype)
    req.output_token_ids = list(h.output_token_ids)
    req.num_computed_tokens = num_computed
    req.draft_token_ids, req.draft_probs = list(h.draft_token_ids), h.draft_probs
    if h.generator_state is not None:
        req.generator.set_state(h.generator_state)
    req.status = RequestStatus.RUNNING
    engine.scheduler.running.append(req)
