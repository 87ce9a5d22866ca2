"""A CPU graph of a fixed batch called straight into inductor's compiled C++, without the Python around it.

Between a step's arguments and the compiled C++, the code dynamo made fetches each weight from its module and reads
the table's width, and AOT's and inductor's wrappers pass the list on (~0.1 ms a call at batch 1: docs/history.md).
That list is the same every call but for the step's inputs and the table's width:
    step args  [ids, positions, seq_lens, slots, table[:, :5]]
    C++ inputs [w0, w1, ..., ids, positions, seq_lens, slots, table[:, :5], ..., 5]
    plan       constants [w0, w1, ...], tensors {slot of ids: arg 0, ...}, sizes {last slot: arg 4, dim 1}
direct_caller reads the plan from two warm-up calls at different widths (through inductor's CompiledFxGraph) and
checks that the direct call returns what the graph did; anything it cannot place keeps the usual call.
"""
from dataclasses import dataclass

import torch
from torch._inductor import output_code


@dataclass
class DirectCall:
    run: object          # the compiled C++ entry: list of inputs -> list of outputs
    inputs: list         # the inputs of the first call (weights stay, the rest is replaced)
    tensors: list        # (input slot, step arg index)
    sizes: list          # (input slot, step arg index, dim)
    outputs: object      # output index, or a tuple of output indexes and None

    def __post_init__(self):
        # inductor's wrapper around the C++ (`g` in the module it wrote) makes a tensor of each int input and a
        # handle of each input; called here with its C++ function, the ints' tensors are made once
        cells = dict(zip(self.run.__code__.co_freevars, self.run.__closure__ or ()))
        self.entry = cells["f"].cell_contents if set(cells) == {"f"} else None
        if self.entry is not None:
            self.inputs = [a if isinstance(a, torch.Tensor) else torch.tensor(a) for a in self.inputs]
        self.size_tensors = {}

    def __call__(self, *args):
        inputs = self.inputs.copy()
        for slot, j in self.tensors:
            inputs[slot] = args[j]
        for slot, j, dim in self.sizes:
            size = args[j].shape[dim]
            if self.entry is not None:
                if size not in self.size_tensors:
                    self.size_tensors[size] = torch.tensor(size)
                size = self.size_tensors[size]
            inputs[slot] = size
        if self.entry is None:
            outs = self.run(inputs)
        else:
            handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(inputs)
            outs = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(self.entry(handles))
        if isinstance(self.outputs, int):
            return outs[self.outputs]
        return tuple(None if k is None else outs[k] for k in self.outputs)


def _capture(fn, args: list):
    """Calls fn(*args) -> (the compiled graphs it called, each with its inputs and outputs; what fn returned)."""
    calls, call = [], output_code.CompiledFxGraph.__call__

    def spy(graph, inputs):
        calls.append([graph, list(inputs)])   # (the C++ entry empties the list it is given)
        outs = call(graph, inputs)
        calls[-1].append(outs)
        return outs
    output_code.CompiledFxGraph.__call__ = spy
    try:
        result = fn(*args)
    finally:
        output_code.CompiledFxGraph.__call__ = call
    return calls, result


def _arg_index(t, args: list) -> int | None:
    return next((j for j, a in enumerate(args) if a is t), None)


def _plan(inputs_a: list, inputs_b: list, args_a: list, args_b: list):
    """-> (tensor slots, size slots) or None where an input is neither a constant, a step arg nor one's size."""
    tensors, sizes = [], []
    for slot, (a, b) in enumerate(zip(inputs_a, inputs_b)):
        if isinstance(a, torch.Tensor):
            j = _arg_index(a, args_a)
            if j is not None and _arg_index(b, args_b) == j:
                tensors.append((slot, j))
            elif j is not None or a is not b:
                return None
        elif type(a) is int and a != b:   # (equal in both calls: a size fixed for this graph)
            dims = [(j, d) for j, t in enumerate(args_a) if isinstance(t, torch.Tensor)
                    for d in range(t.dim()) if t.shape[d] == a and args_b[j].shape[d] == b]
            if not dims:
                return None
            sizes.append((slot, *dims[0]))
        elif type(a) is not int and a is not b:
            return None
    return tensors, sizes


def direct_caller(fn, args_a: list, args_b: list) -> DirectCall | None:
    """fn (the code dynamo made for a step) called directly, args_a and args_b the step's args at two table widths
    (one where the table has one width); None where its call is not one compiled graph taking and returning only
    what the plan places."""
    with torch.inference_mode():
        (calls_a, result_a), (calls_b, _) = _capture(fn, args_a), _capture(fn, args_b)
    if len(calls_a) != 1 or len(calls_b) != 1 or len(calls_a[0][1]) != len(calls_b[0][1]):
        return None
    graph, inputs_a, outs_a = calls_a[0]
    plan = _plan(inputs_a, calls_b[0][1], args_a, args_b)
    results = result_a if isinstance(result_a, tuple) else (result_a,)
    places = [None if r is None else next((k for k, o in enumerate(outs_a) if o is r), -1) for r in results]
    if plan is None or -1 in places or len(outs_a) != sum(k is not None for k in places):
        return None   # (an output the wrappers make or change: an input mutation, a view)
    direct = DirectCall(graph.current_callable, inputs_a, *plan,
                        tuple(places) if isinstance(result_a, tuple) else places[0])
    with torch.inference_mode():
        again = direct(*args_a)
    same = all(x is y or torch.equal(x, y) for x, y in zip(again if isinstance(again, tuple) else (again,), results))
    return direct if same else None
