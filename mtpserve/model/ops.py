"""Ops that graphs call as one opaque call (inductor does not look inside them), registered with the dispatcher
directly: a call costs ~3 us, against ~10 us for a torch.library.custom_op, whose Python wrappers run on every
call (a decode step makes a dozen or more; docs/history.md)."""
import torch

_library = torch.library.Library("mtpserve", "DEF")


def opaque_op(schema: str, fake):
    """Registers fn as mtpserve::<schema>, for every device; fake(*args) gives its output's shape to graphs.
    Returns the op (called like fn)."""
    def register(fn):
        name = schema.split("(")[0]
        _library.define(schema)
        _library.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"mtpserve::{name}", fake, lib=_library)
        return getattr(torch.ops.mtpserve, name)
    return register
