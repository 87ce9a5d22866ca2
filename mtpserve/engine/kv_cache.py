"""Paged KV cache bookkeeping: fixed-size blocks of latent slots, handed out per request, and the prefix cache.

Every main layer and every MTP layer has its own cache tensor, but they share one block table per
request (position p of a request lives in the same slot in every layer). The tensors themselves are
owned by the model runner; this class only decides which blocks belong to whom.

Prefix cache (vLLM's automatic prefix caching, keyed for MTP): a full block whose KV is computed is known by
the hash of its parent block's hash, its tokens, the `lookahead` tokens after it and the request's cache_salt.
The tokens after it, because MTP layer j's KV at position p is computed from the token at p+1+j: a block's MTP
KV is the one another request needs only if the tokens after the block are the same too. A hit then reuses a
block's main and MTP KV whole, and nothing is recomputed but the tokens past the hit. Block size 4, one MTP
layer (lookahead 1):
    cached:  [5 6 7 8 | 9 10 11 12 | 13]   block 0 = h(-, 5 6 7 8, 9), block 1 = h(b0, 9 10 11 12, 13)
    new:     [5 6 7 8 | 9 10 11 12 | 14]   hits block 0; computes from position 4 (block 1's MTP KV at
                                           position 7 was computed with 13 after it)
Blocks are reference-counted; a block nobody holds keeps its KV and its hash until it is needed for another
(evicted least recently used first).
"""
from collections import OrderedDict, deque

from mtpserve.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, lookahead: int = 0):
        """lookahead: tokens after a block its KV depends on (the MTP layers' chain depth; 0 without MTP)."""
        self.num_blocks = num_blocks      # usable blocks; the runner allocates one more as the null block
        self.block_size = block_size
        self.enable_caching, self.lookahead = enable_caching, lookahead
        self.free_blocks: deque[int] = deque(range(num_blocks))   # holding no cached KV
        self.evictable: OrderedDict[int, None] = OrderedDict()   # cached, held by nobody, oldest first
        self.ref_counts = [0] * num_blocks
        self.cached: dict[int, int] = {}      # block hash -> block
        self.hash_of: dict[int, int] = {}     # block -> its hash (blocks in `cached`)
        self.num_queries = self.num_hits = 0  # prompt tokens looked up / found (cumulative)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, req: Request, num_slots: int) -> int:
        return max(0, -(-num_slots // self.block_size) - len(req.block_ids))

    def allocate(self, req: Request, num_slots: int) -> bool:
        """Makes req own enough blocks for `num_slots` positions (KV + lookahead). False if short."""
        need = self.blocks_needed(req, num_slots)
        if need > self.num_free_blocks:
            return False
        req.block_ids.extend(self._take() for _ in range(need))
        return True

    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of.pop(block)]
        self.ref_counts[block] = 1
        return block

    def free(self, req: Request) -> None:
        """Releases req's blocks; its full computed blocks stay cached (the tail ones are evicted first)."""
        self.cache_blocks(req)
        for block in reversed(req.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self.hash_of:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        req.block_ids, req.block_hashes = [], []

    def slot(self, req: Request, position: int) -> int:
        return req.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    # ---- the prefix cache ----
    def _hash(self, parent: int | None, tokens: list[int], i: int, salt: str | None) -> int:
        b = self.block_size
        return hash((parent, tuple(tokens[i * b:(i + 1) * b]), tuple(tokens[(i + 1) * b:(i + 1) * b + self.lookahead]),
                     salt))

    def take_cached_prefix(self, req: Request) -> int:
        """A request about to compute its tokens from the start takes the longest run of cached blocks of them
        (at least one token is left to compute: the step after samples from its hidden state); returns the
        tokens it hit."""
        if not self.enable_caching or req.block_ids or req.params.prompt_logprobs is not None:
            return 0   # (prompt logprobs need every prompt position computed)
        hashes = self.cached_run(req)
        blocks = [self.cached[h] for h in hashes]
        for block in blocks:
            self.evictable.pop(block, None)
            self.ref_counts[block] += 1
        req.block_ids, req.block_hashes = blocks, hashes
        req.num_computed_tokens = len(blocks) * self.block_size
        self.num_queries += req.num_tokens
        self.num_hits += req.num_computed_tokens
        return req.num_computed_tokens

    def cached_run(self, req: Request) -> list[int]:
        """The hashes of the longest run of req's first blocks that is cached."""
        tokens, salt, hashes = req.all_token_ids, req.params.cache_salt, []
        for i in range((len(tokens) - max(self.lookahead, 1)) // self.block_size if self.enable_caching else 0):
            h = self._hash(hashes[-1] if hashes else None, tokens, i, salt)
            if h not in self.cached:
                break
            hashes.append(h)
        return hashes

    def cache_blocks(self, req: Request) -> None:
        """Registers req's full blocks whose KV is computed and whose following tokens are known."""
        if not self.enable_caching:
            return
        b = self.block_size
        full = min(req.num_computed_tokens, req.num_tokens - self.lookahead, len(req.block_ids) * b) // b
        tokens = req.all_token_ids if full > len(req.block_hashes) else []
        for i in range(len(req.block_hashes), full):
            h = self._hash(req.block_hashes[-1] if req.block_hashes else None, tokens, i, req.params.cache_salt)
            req.block_hashes.append(h)
            block = req.block_ids[i]
            if h not in self.cached and block not in self.hash_of:   # (a duplicate of a cached block stays plain)
                self.cached[h], self.hash_of[block] = block, h

    def reset(self) -> None:
        """Forgets every cached block (blocks in use keep their KV, uncached)."""
        self.free_blocks.extend(self.evictable)
        self.evictable.clear()
        self.cached.clear()
        self.hash_of.clear()
