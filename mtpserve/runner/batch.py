"""The flat varlen batch: query tokens of all rows concatenated, plus the attention metadata."""
from dataclasses import dataclass

import torch

from mtpserve.model.attention import AttentionMetadata


@dataclass
class Row:
    """Consecutive query tokens of one request, starting at `start`; `block_ids` is its block table."""
    token_ids: list[int]
    start: int
    block_ids: list[int]


def build_batch(rows: list[Row], block_size: int, device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    query_lens = [len(r.token_ids) for r in rows]
    max_blocks = max(len(r.block_ids) for r in rows)
    input_ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.long)
    positions = torch.cat([torch.arange(r.start, r.start + len(r.token_ids)) for r in rows])
    block_tables = torch.tensor([r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in rows], dtype=torch.long)
    row_of_token = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(query_lens))
    slot_mapping = block_tables[row_of_token, positions // block_size] * block_size + positions % block_size
    seq_lens = [r.start + n for r, n in zip(rows, query_lens)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(device),
        seq_lens=torch.tensor(seq_lens).to(device),
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    positions = positions.to(device)
    return input_ids.to(device), positions, meta.prepare(positions)
