"""What a prefill engine hands a decode engine, in vllm-ascend's two schemes, and how each side makes or takes it.

Scheme 1 ("drafts"): the prefill side ran the MTP prefill pass and drafting; it ships the main and MTP latent
KV of every computed position, the first token and the k drafts (with their distribution when sampled). The
decode side's first step verifies them like any other.

Scheme 2 ("hidden"): the prefill side ships the main KV, the MTP KV of every position but the last (whose MTP
input, the first token, was only known after the prefill) and the main model's hidden state there. The decode
side runs that last MTP pass as it takes the request in (KV only, fed the hidden state), so that the request is
then one like any other whose prompt was computed here, without drafts: its first step is an ordinary step
(padded to 1+k tokens like any decode row with fewer drafts than the others, runner/model_runner.py).

A seeded request needs no RNG state: its draws are keyed on its seed and token positions (sampling/sampler.py),
so the decode side continues its random stream from the seed alone.
"""
from dataclasses import dataclass, field

import torch

from mtpserve.engine.outputs import detokenize_incrementally
from mtpserve.model.attention import write_slots
from mtpserve.request import Request
from mtpserve.sampling_params import SamplingParams
from mtpserve.step import ScheduledRequest

SCHEMES = ("drafts", "hidden")


@dataclass
class Handoff:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | None         # (in-process hand-offs; a server takes the decode request's own)
    output_token_ids: list[int]           # the first token
    kv: list[torch.Tensor]                # per cache (main layers, then MTP layers): [positions, kv_dim]
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None
    finish_reason: str | None = None      # set when the request already ended at its first token
    last_hidden: torch.Tensor | None = None   # scheme 2: hidden state at the last prompt position
    identity: dict = field(default_factory=dict)   # what the decode engine must match (engine_identity)


def engine_identity(engine) -> dict:
    """What two engines must share for a hand-off to continue exactly: model shape, KV layout and dtype, and
    the drafts they verify. (The block size may differ: KV travels per position.)"""
    cfg, spec = engine.model_config, engine.config.speculative
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                kv_cache_dim=cfg.kv_cache_dim, num_kv_caches=len(engine.runner.kv_caches),
                kv_dtype=str(engine.runner.kv_caches[0].dtype).removeprefix("torch."),
                speculative_method=spec.method if spec else None,
                num_speculative_tokens=spec.num_speculative_tokens if spec else 0)


def check_identity(engine, theirs: dict) -> None:
    mine = engine_identity(engine)
    for key, value in mine.items():
        if theirs.get(key) != value:
            raise ValueError(f"handoff: {key} = {theirs.get(key)!r} on the prefill side, {value!r} here (both sides "
                             "need the same model, dtype, speculative method and num_speculative_tokens)")


def export_handoff(engine, req: Request, scheme: str = "drafts") -> Handoff:
    """The hand-off of a request whose prompt the engine has computed (its first token sampled). Reads the KV
    of its blocks (which the caller keeps from being reused meanwhile)."""
    if scheme not in SCHEMES:
        raise ValueError(f"mtp_handoff = {scheme!r}: must be one of {SCHEMES}")
    if scheme == "hidden" and req.last_hidden is None:
        raise ValueError("mtp_handoff = 'hidden': the prefill engine kept no hidden state (add the request "
                         "with hold_kv=True, and export it at its first token)")
    computed = req.num_computed_tokens
    slots = torch.tensor([engine.block_manager.slot(req, p) for p in range(computed)], dtype=torch.long)
    num_main = engine.model_config.num_hidden_layers
    kv = []
    for i, cache in enumerate(engine.runner.kv_caches):
        n = computed if i < num_main or scheme == "drafts" else computed - 1   # (scheme 2: the last MTP slot
        kv.append(cache.view(-1, cache.shape[-1])[slots[:n].to(cache.device)].cpu())   # is the decoder's)
    drafts = list(req.draft_token_ids) if scheme == "drafts" else []
    return Handoff(req.request_id, req.prompt, list(req.prompt_token_ids), req.params, list(req.output_token_ids),
                   kv, drafts, req.draft_probs if drafts else None,
                   req.finish_reason if req.finish_reason == "stop" else None,
                   req.last_hidden.cpu() if scheme == "hidden" else None, engine_identity(engine))


def import_handoff(engine, h: Handoff, request_id: str | None = None, params: SamplingParams | None = None) -> None:
    """Continues a request prefilled elsewhere: its KV goes into blocks of this engine and it waits to be
    scheduled like a request that computed its prompt here (preempted, it recomputes from scratch)."""
    check_identity(engine, h.identity)
    if h.finish_reason is not None:
        raise ValueError(f"handoff: request {h.request_id!r} already finished ({h.finish_reason}) at prefill")
    k = engine.config.speculative.num_speculative_tokens if engine.config.speculative else 0
    if len(h.draft_token_ids) > k:
        raise ValueError(f"handoff: {len(h.draft_token_ids)} drafts, this engine verifies at most "
                         f"num_speculative_tokens={k}")
    if len(h.kv) != len(engine.runner.kv_caches):
        raise ValueError(f"handoff: {len(h.kv)} KV caches, this engine has {len(engine.runner.kv_caches)}")
    rid = request_id or h.request_id
    p = params or h.params
    for name in ("logprobs", "prompt_logprobs"):   # (the hand-off carries tokens and KV, not scores)
        if getattr(p, name) is not None:
            raise ValueError(f"{name}: not supported with a prefill/decode hand-off")
    engine.add_request(rid, h.prompt, h.prompt_token_ids, p)
    req: Request = engine.requests[rid]
    if len(h.output_token_ids) >= req.max_tokens:
        engine.abort_request(rid)
        raise ValueError(f"max_tokens = {req.max_tokens}: the prefill side's first token already completes it")
    computed = h.kv[0].shape[0]
    lookahead = max(len(h.draft_token_ids), k) + engine.num_lookahead_slots + 1
    if not engine.block_manager.allocate(req, computed + lookahead):
        engine.abort_request(rid)
        raise RuntimeError("decode engine: no free KV blocks for the handed-off request")
    slots = torch.tensor([engine.block_manager.slot(req, p) for p in range(computed)], dtype=torch.long)
    for cache, kv in zip(engine.runner.kv_caches, h.kv):
        write_slots(cache, slots[:kv.shape[0]].to(cache.device), kv.to(cache.device))
    if h.last_hidden is not None and engine.runner.mtp_caches:
        run_last_mtp_pass(engine, req, h.last_hidden, h.output_token_ids[0])
    for token in h.output_token_ids:
        req.output_token_ids.append(token)
        if engine.tokenizer is not None:
            detokenize_incrementally(engine.tokenizer, req)
    req.num_computed_tokens = computed
    req.draft_token_ids, req.draft_probs = list(h.draft_token_ids), h.draft_probs


def run_last_mtp_pass(engine, req: Request, hidden: torch.Tensor, first_token: int) -> None:
    """Scheme 2: the MTP pass at the last prompt position that the prefill side left, as the step that computed
    that position and sampled the first token would have run it, drafting none (KV only). Prompt [t0 .. t4],
    first token t5: the step ScheduledRequest(req, start=4, num_new_tokens=1, []) emitted [t5]; MTP row [t5] at
    4, fed the shipped hidden state at 4. (Before the first token is appended, so that the step samples.)"""
    step = ScheduledRequest(req, req.num_tokens - 1, 1, [])
    with torch.inference_mode():
        engine.runner.proposer.propose([step], hidden.to(engine.device, engine.dtype)[None], [0, 1], [[first_token]])

