"""A graph's inputs: static buffers of its batch, loaded with a step's rows and padding rows.

Two decode rows of q = 3 tokens (a pending token and 2 drafts) at positions 7 and 12, block size 4, a table of
4 blocks, loaded into the graph of 4 rows (the next graph size):
    input_ids    [t7 d8 d9 | u12 e13 e14 | 0 0 0 | 0 0 0]
    positions    [7 8 9 | 12 13 14 | 0 0 0 | 0 0 0]
    seq_lens     [10 | 15 | 0 | 0]                    (0: a padding row, which attends to nothing)
    slot_mapping [s7 s8 s9 | s12 s13 s14 | -1 -1 -1 | -1 -1 -1]   (-1: no KV written)
    block_tables [[b0 b1 b2 0] [c0 c1 c2 c3] [0 0 0 0] [0 0 0 0]], cut to the bucket's columns
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch._dynamo

from mtpserve.step import Row, flat_rows


@dataclass
class StaticInputs:
    """A graph's input buffers (B rows of q tokens), copied into before each run."""
    input_ids: torch.Tensor                     # [B * q]
    positions: torch.Tensor                     # [B * q]
    seq_lens: torch.Tensor                      # [B]  (0: a padding row)
    slot_mapping: torch.Tensor                  # [B * q]  (-1: no KV written)
    block_tables: torch.Tensor                  # [B, max blocks]; a graph sees the first `bucket` columns
    prev_hidden: torch.Tensor | None = None     # MTP passes: the hidden state fed at each token [B * q, H]
    output_index: torch.Tensor | None = None    # MTP passes over 1+k tokens: the one token per row to output [B]
    sampling: list[torch.Tensor] | None = None  # fused steps: the sampled step's further inputs (else [])

    def __post_init__(self):
        # the five index buffers written through numpy views of host tensors (on the CPU the buffers themselves)
        index = self.index_buffers()
        self.host = [t.numpy() for t in (index if index[0].device.type == "cpu" else [t.cpu() for t in index])]
        self.cached_args = {}

    @classmethod
    def allocate(cls, batch: int, q: int, max_blocks: int, device) -> "StaticInputs":
        long = dict(dtype=torch.long, device=device)
        return cls(torch.zeros(batch * q, **long), torch.zeros(batch * q, **long), torch.zeros(batch, **long),
                   torch.full((batch * q,), -1, **long), torch.zeros(batch, max_blocks, **long))

    def index_buffers(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, self.seq_lens, self.slot_mapping, self.block_tables]

    def load(self, rows: list[Row], q: int, bucket: int, block_size: int, size: int) -> list[torch.Tensor]:
        """Writes the rows, then padding rows up to `size`, into the buffers; returns the graph's inputs."""
        ids, positions, slots, seq_lens, tables = flat_rows(rows, q, bucket, block_size)
        n, (ids_np, positions_np, seq_lens_np, slots_np, tables_np) = len(rows), self.host
        for target, values, fill, per_row in ((ids_np, ids, 0, q), (positions_np, positions, 0, q),
                                              (seq_lens_np, seq_lens, 0, 1), (slots_np, slots, -1, q)):
            target[:n * per_row] = values
            target[n * per_row:size * per_row] = fill
        tables_np[:n, :bucket] = np.array(tables, dtype=np.int64).reshape(n, bucket)
        tables_np[n:size, :bucket] = 0
        if self.input_ids.device.type != "cpu":
            for buffer, host in zip(self.index_buffers(), self.host):
                buffer.copy_(torch.from_numpy(host))
        return self.args(bucket, size)

    def args(self, bucket: int, rows: int) -> list:
        """The graph's inputs: the first `rows` rows, the first `bucket` blocks of the table (views made once)."""
        if (bucket, rows) not in self.cached_args:
            self.cached_args[bucket, rows] = self.views(bucket, rows)
        return self.cached_args[bucket, rows]

    def views(self, bucket: int, rows: int) -> list:
        size = len(self.seq_lens)
        cut = lambda t: t if t is None or rows == size else t[:len(t) // size * rows]  # noqa: E731
        tail = self.sampling if self.sampling is not None else [self.prev_hidden, self.output_index]
        return [cut(self.input_ids), cut(self.positions), cut(self.seq_lens), cut(self.slot_mapping),
                self.block_tables[:rows, :bucket]] + [cut(t) for t in tail]

    def compiling_args(self, bucket: int, rows: int, fewest_rows: int | None = None) -> list:
        """args() with the table's width marked dynamic, and with fewest_rows the batch too, from that many rows
        to all (the inputs a graph is compiled with)."""
        args, size = self.views(bucket, rows), len(self.seq_lens)
        for t in args if fewest_rows else []:   # (each input's rows: [B * q], [B], [B, ...])
            if t is not None:
                per_row = len(t) // rows
                torch._dynamo.mark_dynamic(t, 0, min=fewest_rows * per_row, max=size * per_row)
        # one graph for every KV bucket (a one-block table has a single bucket: dynamo specializes size 1)
        if self.block_tables.shape[1] > 1:
            torch._dynamo.mark_dynamic(args[4], 1)
        return args


def sampling_buffers(batch: int, k: int, vocab: int, device) -> list[torch.Tensor]:
    """The sampled fused step's further inputs, initially what the warm-up's padding rows run with: greedy
    (temperature, top_k, top_p, min_p), no penalties (repetition, frequency, presence, seen, counts), noise 1,
    uniform 0, no row coupled, no draft distributions."""
    return ([torch.full((batch,), v, device=device) for v in (0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0)]
            + [torch.zeros(batch, vocab, dtype=torch.bool, device=device), torch.zeros(batch, vocab, device=device),
               torch.ones(batch, 2 * k + 1, vocab, device=device), torch.zeros(batch, k, device=device),
               torch.zeros(batch, dtype=torch.bool, device=device), torch.zeros(batch, k, vocab, device=device)])
