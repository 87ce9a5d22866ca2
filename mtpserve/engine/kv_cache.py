"""Paged KV cache bookkeeping: fixed-size blocks of latent slots, handed out per request.

Every main layer and every MTP layer has its own cache tensor, but they share one block table per
request (position p of a request lives in the same slot in every layer). The tensors themselves are
owned by the model runner; this class only decides which blocks belong to whom.
"""
from collections import deque

from mtpserve.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks      # usable blocks; the runner allocates one more as the null block
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, req: Request, num_slots: int) -> int:
        return max(0, -(-num_slots // self.block_size) - len(req.block_ids))

    def allocate(self, req: Request, num_slots: int) -> bool:
        """Makes req own enough blocks for `num_slots` positions (KV + lookahead). False if short."""
        need = self.blocks_needed(req, num_slots)
        if need > len(self.free_blocks):
            return False
        req.block_ids.extend(self.free_blocks.popleft() for _ in range(need))
        return True

    def free(self, req: Request) -> None:
        self.free_blocks.extend(req.block_ids)
        req.block_ids = []

    def slot(self, req: Request, position: int) -> int:
        return req.block_ids[position // self.block_size] * self.block_size + position % self.block_size
