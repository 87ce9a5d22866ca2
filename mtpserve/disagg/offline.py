"""Prefill/decode disaggregation between two engines in one process (either scheme, as plain objects).

`prefill` runs a request on one engine until its first token (with the MTP prefill and the first drafts) and
returns the hand-off; `add_prefilled` continues it on another. Between servers the same hand-off travels over
a KV connector (connector.py).
"""
from mtpserve.disagg.handoff import Handoff, export_handoff, import_handoff
from mtpserve.engine.engine import LLMEngine
from mtpserve.sampling_params import SamplingParams

PrefillHandoff = Handoff


def single_process(engine: LLMEngine) -> None:
    """Hand-offs move one process's KV cache between steps: refused under tensor or data parallelism and overlap."""
    for name in ("data_parallel_size", "tensor_parallel_size"):
        if getattr(engine.config, name) != 1:
            raise ValueError(f"{name} = {getattr(engine.config, name)}: disaggregated prefill/decode moves one "
                             f"process's KV cache; use {name} = 1")
    if engine.config.overlap:   # (an import would take blocks that the step in flight may still write)
        raise ValueError("overlap: disaggregated prefill/decode moves KV between steps; turn overlap off")


def prefill(engine: LLMEngine, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
            params: SamplingParams, scheme: str = "drafts") -> Handoff:
    """Runs `request_id` on the prefill engine until it has its first token, then exports and frees it."""
    single_process(engine)
    if params.n != 1 or (params.best_of or 1) > 1:
        raise ValueError("n: disaggregated prefill hands over one sequence per request; use n = best_of = 1")
    engine.add_request(request_id, prompt, prompt_token_ids, params, hold_kv=True)
    req = engine.requests[request_id]
    while not req.output_token_ids and not req.is_finished:
        engine.step()
    handoff = export_handoff(engine, req, scheme)
    engine.abort_request(request_id)
    engine.release_kv(request_id)
    return handoff


def add_prefilled(engine: LLMEngine, handoff: Handoff) -> None:
    """Continues a request prefilled elsewhere: its KV is copied into this engine's blocks."""
    single_process(engine)
    import_handoff(engine, handoff)
