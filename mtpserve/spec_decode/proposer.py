"""One interface for every drafter (MTP, n-gram; an EAGLE head or a draft model would be a third).

The engine and the runner never ask which drafter runs: they ask it what differs between drafters. The
verification of drafts (spec_decode/verify.py) is the same for all of them.

    class Proposer(Protocol):
        fuses_with_verification: bool       # graph mode: verify + draft in one graph (spec_decode/fused.py)
        @classmethod check(model_config, spec)       # refuses a checkpoint it cannot draft for
        @classmethod num_kv_caches(model_config, spec) -> int   # KV caches of its own (per layer it runs)
        @classmethod lookahead_slots(spec) -> int    # KV slots its passes write past the verified tokens
        propose(scheduled, hidden, offsets, new_tokens) -> per request (next drafts | None, their probs | None)
        num_passes(scheduled) -> int        # model passes propose() runs (data-parallel ranks agree on them)
        min_last_chunk() -> int             # prompt tokens the last chunk of a chunked prompt must keep
        graph_shapes() -> list[(Pass, tokens per request)]   # graphs it runs, to compile at start-up
"""
from mtpserve.spec_decode.mtp import MTPProposer
from mtpserve.spec_decode.ngram import NgramProposer

PROPOSERS = {"mtp": MTPProposer, "ngram": NgramProposer}


def proposer_class(spec):
    """The drafter class of a SpeculativeConfig (None: no speculation)."""
    return None if spec is None else PROPOSERS[spec.method]


def make_proposer(spec, model, forward, generator, device, static_shapes: bool):
    """forward(pass, rows, prev_hidden, output_index): the runner's forward (for drafters that run a model).
    static_shapes: graph mode (a drafter's passes keep the shapes its graphs were compiled for)."""
    cls = proposer_class(spec)
    return None if cls is None else cls(spec, model=model, forward=forward, generator=generator, device=device,
                                        static_shapes=static_shapes)
