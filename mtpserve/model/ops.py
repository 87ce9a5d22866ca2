"""Ops that graphs call as one opaque call (inductor does not look inside them), registered with the dispatcher
directly: a call costs ~3 us, against ~10 us for a torch.library.custom_op, whose Python wrappers run on every
call (a decode step makes a dozen or more; docs/history.md)."""
import logging

import torch

from mtpserve.model import cpu_kernels

_library = torch.library.Library("mtpserve", "DEF")
_as_aten: list = []   # (op, ATen op, args of the ATen call from the op's): ops that are one ATen call


def opaque_op(schema: str, fake, as_aten=None):
    """Registers fn as mtpserve::<schema>, for every device; fake(*args) gives its output's shape to graphs.
    as_aten: (ATen op, fn of the op's args giving the ATen op's) when fn is that one call: graphs then call the
    ATen kernel itself from C++, not fn in Python (register_graph_lowerings). Returns the op (called like fn)."""
    def register(fn):
        name = schema.split("(")[0]
        _library.define(schema)
        _library.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"mtpserve::{name}", fake, lib=_library)
        op = getattr(torch.ops.mtpserve, name)
        if as_aten is not None:
            _as_aten.append((op.default, *as_aten))
        return op
    return register


def register_graph_lowerings():
    """Before graphs compile: each op declared as_aten lowers to its ATen call (inductor's fallback kernel),
    which the C++ wrapper calls through the dispatcher with no Python in between (inductor warns that such ATen
    ops have no C shim of their own: expected here, so those warnings are dropped). Returns a graph pass that
    changes nothing, for inductor's post_grad_custom_post_pass: its uuid puts these lowerings in inductor's
    cache key (a graph cached without them would call the Python kernels), and our kernels' sources (a graph
    cached before a kernel's schema changed would call it with the old arguments)."""
    from torch._inductor import lowering
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class LoweringsKey(CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return ("mtpserve as_aten: " + ", ".join(f"{op} -> {aten_op}" for op, aten_op, _ in _as_aten)
                    + f"; kernels {cpu_kernels.sources_digest()}")

    if not all(op in lowering.lowerings for op, _, _ in _as_aten):   # (once per process)
        aten_ops = {aten_op for _, aten_op, _ in _as_aten}
        logging.getLogger("torch._inductor.ir").addFilter(
            lambda record: not (record.args and record.args[0] in aten_ops and "c-shim" in record.msg))
        for op, aten_op, aten_args in _as_aten:
            call = lowering.fallback_handler(aten_op, add_to_fallback_set=False)
            lowering.register_lowering(op, type_promotion_kind=None)(
                lambda *args, call=call, aten_args=aten_args: call(*aten_args(*args)))
    return LoweringsKey()
