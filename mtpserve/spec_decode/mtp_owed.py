"""MTP KV that decode steps left unwritten, and the main hidden states kept to write it later.

An MTP layer writes the KV of position p from its inputs there alone (the embedding of the token its depth
reads and the hidden state fed at p); no attention runs for it. So a decode step whose drafts read no layer past
depth d can skip the passes of the own layers from d on: it keeps the main model's hidden states of the
positions it verified, and the next step that runs such a layer starts its rows that much earlier, fed those
hidden states (what the skipped pass would have been fed). An eager adaptive engine drafting none skips every
MTP pass, so k = 0 costs what no speculation does; one drafting one token over a checkpoint with two own layers
skips the second. (spec_decode/mtp.py, MTPProposer._written_depth.)
"""
from dataclasses import dataclass, field

import torch

MAX_OWED = 64   # positions a request may owe the MTP caches (their main hidden states kept until written)


@dataclass
class OwedKV:
    since: list[int | None]     # per own MTP layer: the first position whose KV is missing (None: none missing)
    first: int                  # the position of the first hidden state kept
    hidden: list[torch.Tensor]  # main hidden states of positions first.. (one tensor per step)
    count: int                  # positions kept

    def row_start(self, layer: int, start: int) -> int:
        """Where this step's rows of `layer` start (`start`: the step's first position)."""
        return start if self.since[layer] is None else self.since[layer]

    def hidden_from(self, position: int) -> torch.Tensor:
        return torch.cat(self.hidden)[position - self.first:]


def owed_kv(req, start: int, num_layers: int) -> OwedKV | None:
    """What a decoding request owes just before position `start`: a hand-over's last prompt position (its
    hidden state came with the KV, disagg scheme 2: every layer owes it), or what earlier steps skipped. None
    when nothing is owed, or what is kept is stale (a preempted request starts over)."""
    if req.mtp_prefix_hidden is not None:
        return OwedKV([start - 1] * num_layers, start - 1, [req.mtp_prefix_hidden.unsqueeze(0)], 1)
    owed = req.mtp_owed
    return owed if owed is not None and owed.first + owed.count == start else None


def after_step(owed: OwedKV | None, start: int, written: int, num_layers: int,
               new_hidden: torch.Tensor) -> OwedKV | None:
    """The request's debt after a step that wrote the own layers below `written` (each from where it was owed)
    and verified the positions start.. (their main hidden states `new_hidden`: a view of the eager step's own
    output, kept as it is; graph mode, whose outputs are reused buffers, writes every layer at every step)."""
    if written == num_layers:
        return None
    since = [None] * written + [start if owed is None or owed.since[j] is None else owed.since[j]
                                for j in range(written, num_layers)]
    first = since[-1]   # (the deepest layer is owed longest: a step writing a layer writes the ones before it)
    kept = [] if first == start else owed.hidden if first == owed.first else [owed.hidden_from(first)]
    return OwedKV(since, first, kept + [new_hidden], start + len(new_hidden) - first)


@dataclass
class LayerRows:
    """One own layer's rows this step, flat: a row per request, the index in `source` (MTPProposer._run_passes)
    of the main hidden state at each of its positions, and where each request's accepted position lands."""
    rows: list = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)   # per request: its first token in the flat layout

    def add(self, row, sources: list[int], last_in_row: int) -> None:
        self.offsets.append(len(self.sources))
        self.last.append(len(self.sources) + last_in_row)
        self.rows.append(row)
        self.sources.extend(sources)

    def inputs(self, before: "LayerRows", outputs: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """What this chained layer is fed: the outputs of the layer before where it ran, the main hidden states
        at the positions this layer owed and the one before did not (as a step skipping it would have fed it)."""
        skips = [prev.start - row.start for row, prev in zip(self.rows, before.rows)]
        if not any(skips):
            return outputs
        index = []
        for n, (row, skip) in enumerate(zip(self.rows, skips)):
            index += [len(outputs) + x for x in self.sources[self.offsets[n]:self.offsets[n] + skip]]
            index += range(before.offsets[n], before.offsets[n] + len(row.token_ids) - skip)
        return torch.cat([outputs, source])[index]
