"""The flat varlen batch: query tokens of all rows concatenated, plus the attention metadata."""
import torch

from mtpserve.model.attention import ABSORB_MAX_QUERY_LEN, AttentionMetadata
from mtpserve.step import Row


def build_batch(rows: list[Row], block_size: int, device, split: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Index arithmetic in Python lists, then one tensor each: a decode step's batch is a few dozen numbers,
    and per-op costs (not the arithmetic) would dominate if it were done with tensor ops. split: rows of a few
    query tokens and longer ones attend apart (AttentionMetadata.parts)."""
    max_query_len = max(len(r.token_ids) for r in rows)
    max_blocks = max(len(r.block_ids) for r in rows)
    input_ids, positions, slots, query_start_loc, seq_lens, tables = [], [], [], [0], [], []
    token_row, token_col, query_pos = [], [], []
    for i, r in enumerate(rows):
        n = len(r.token_ids)
        pos = range(r.start, r.start + n)
        input_ids += r.token_ids
        positions += pos
        slots += r.slots(block_size)
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(r.start + n)
        tables.append(r.block_ids + [0] * (max_blocks - len(r.block_ids)))
        token_row += [i] * n
        token_col += range(n)
        query_pos.append(list(pos) + [-1] * (max_query_len - n))

    def tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    meta = AttentionMetadata(query_start_loc=tensor(query_start_loc), seq_lens=tensor(seq_lens),
                             slot_mapping=tensor(slots), block_tables=tensor(tables),
                             max_query_len=max_query_len, max_seq_len=max(seq_lens),
                             token_row=tensor(token_row), token_col=tensor(token_col),
                             causal=all(r.start == 0 and len(r.token_ids) == max_query_len for r in rows))
    if split and max_query_len > ABSORB_MAX_QUERY_LEN:   # (never in a decode step)
        short = [i for i, r in enumerate(rows) if len(r.token_ids) <= ABSORB_MAX_QUERY_LEN]
        long = [i for i, r in enumerate(rows) if len(r.token_ids) > ABSORB_MAX_QUERY_LEN]
        if short:
            meta.parts = [(tensor([t for i in kind for t in range(query_start_loc[i], query_start_loc[i + 1])]),
                           build_batch([rows[i] for i in kind], block_size, device, split=False)[2])
                          for kind in (short, long)]
            for _, part in meta.parts:
                part.slot_mapping = None   # the whole batch's KV is written once, before the parts attend
    return tensor(input_ids), tensor(positions), meta.set_mask(tensor(query_pos))
