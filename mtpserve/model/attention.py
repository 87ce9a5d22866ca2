"""Multi-head latent attention (MLA) over a paged cache of compressed latents.

The cache of one layer is a tensor [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]: per token the normalized
latent c and the rotated shared rope key. A batch is flat (all query tokens of all requests concatenated);
`AttentionMetadata` says which tokens belong to which request, where their KV goes and how long each request's KV is
after this step. Slot -1 means "do not keep": it lands in the last row of the cache, in a block never handed out.

Two exact forms of the same attention:
- expanded: keys/values are expanded per head from the latent (cheap when many queries share the keys);
- absorbed: W_UK is folded into the queries and W_UV applied after, so attention runs on the latent itself
  (DeepSeek's decode form: no per-head K/V is ever built).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mtpserve.config import ModelConfig
from mtpserve.model import cpu_kernels
from mtpserve.model.ops import opaque_op
from mtpserve.model.fp8 import apply_linear, weight_of
from mtpserve.model.layers import RMSNorm, RotaryEmbedding, linear, share_storage, softmax_scale
from mtpserve.model.parallel import TensorParallel

ABSORB_MAX_QUERY_LEN = 8  # "auto" uses the absorbed form up to this many query tokens per request


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor   # [B+1] cumulative query lengths
    seq_lens: torch.Tensor          # [B] KV length of each request after this step
    slot_mapping: torch.Tensor | None   # [N] cache slot (block * block_size + offset) of each query token; -1:
                                        # drop; None: this batch's KV is in the cache already
    block_tables: torch.Tensor      # [B, max_blocks] physical block ids
    max_query_len: int
    max_seq_len: int
    # Built once per forward by `prepare`, shared by all layers:
    token_row: torch.Tensor | None = None   # [N] request of each token
    token_col: torch.Tensor | None = None   # [N] index of each token inside its request's query block
    mask: torch.Tensor | None = None        # [B, 1, max_q, max_kv] True = may attend
    causal: bool = False                    # the mask is plain causal: every row's queries are all its keys
    keys_buffer: torch.Tensor | None = None  # eager only: gathered cache blocks, reused layer after layer
    # A batch mixing decode rows (a few query tokens) with prompt chunks: (flat token indices, metadata) of each
    # kind, attending apart. Together every row would be padded to the longest chunk and take the expanded
    # form: rows [t5 d6] and [p0 .. p31] would both run 32 query positions (docs/history.md has the A/B).
    parts: list[tuple[torch.Tensor, "AttentionMetadata"]] | None = None

    def select(self, index: torch.Tensor) -> "AttentionMetadata":
        """Metadata for one query token per request (`index`: one flat token index per request, in request
        order), attending to the same KV, which the caller has written already: each token keeps its mask row."""
        batch = self.seq_lens.shape[0]
        mask = self.mask.squeeze(1)[self.token_row[index], self.token_col[index]].view(batch, 1, 1, -1)
        return AttentionMetadata(torch.arange(batch + 1, device=index.device), self.seq_lens, None,
                                 self.block_tables, 1, self.max_seq_len, mask=mask)

    def prepare(self, positions: torch.Tensor) -> "AttentionMetadata":
        device = positions.device
        num_tokens = positions.shape[0]
        qsl = self.query_start_loc
        query_lens = qsl[1:] - qsl[:-1]
        self.token_row = torch.repeat_interleave(torch.arange(len(query_lens), device=device), query_lens,
                                                 output_size=num_tokens)
        self.token_col = torch.arange(num_tokens, device=device) - qsl[:-1][self.token_row]
        query_pos = torch.full((len(query_lens), self.max_query_len), -1, dtype=torch.long, device=device)
        query_pos[self.token_row, self.token_col] = positions
        self.causal = (self.max_query_len == self.max_seq_len and num_tokens == len(query_lens) * self.max_query_len
                       and not torch.compiler.is_compiling() and bool((self.seq_lens == self.max_seq_len).all()))
        return self.set_mask(query_pos)

    def set_mask(self, query_pos: torch.Tensor) -> "AttentionMetadata":
        """query_pos: [B, max_q] position of each query token, -1 for padding."""
        key_idx = torch.arange(self.max_seq_len, device=query_pos.device)
        mask = (key_idx[None, None, :] <= query_pos[:, :, None]) & (key_idx[None, None, :] < self.seq_lens[:, None, None])
        mask[..., 0] |= ~mask.any(-1)  # padding rows attend to one key instead of none (no NaN); dropped later
        self.mask = mask.unsqueeze(1)
        return self


def gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor, meta: "AttentionMetadata") -> torch.Tensor:
    """kv_cache[blocks]. Eagerly, into one buffer that every layer of the forward reuses: a fresh multi-MB
    tensor per layer costs more in page faults than the copy itself on the CPU."""
    if torch.compiler.is_compiling():
        return gather_cache_blocks(kv_cache, blocks)
    shape = (blocks.shape[0], *kv_cache.shape[1:])
    if meta.keys_buffer is None or meta.keys_buffer.shape != shape or meta.keys_buffer.dtype != kv_cache.dtype:
        meta.keys_buffer = kv_cache.new_empty(shape)
    return torch.index_select(kv_cache, 0, blocks, out=meta.keys_buffer)


def write_slots(kv_cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """kv [N, D] into cache slots (block * block_size + offset; -1: the padding block's last row), indexing the
    cache itself, not a flat view of it: a graph writing one cache twice (MTP layer 0 at depths 1 and 3) then updates
    it in place; through a view, inductor copies the whole cache for the first write."""
    block_size = kv_cache.shape[1]
    kv_cache[slots.div(block_size, rounding_mode="floor"), slots.remainder(block_size)] = kv.to(kv_cache.dtype)


def cached_keys(kv_cache: torch.Tensor, meta: "AttentionMetadata", dtype: torch.dtype) -> torch.Tensor:
    """Each request's cached latent KV, [B, max_seq_len, r + rope], from its blocks."""
    batch = meta.seq_lens.shape[0]
    tables = meta.block_tables[:, :-(-meta.max_seq_len // kv_cache.shape[1])]
    keys = gather_blocks(kv_cache, tables.flatten(), meta).view(batch, -1, kv_cache.shape[-1])
    return keys[:, :meta.max_seq_len].to(dtype)


@opaque_op("gather_cache_blocks(Tensor kv_cache, Tensor blocks) -> Tensor",
           lambda kv_cache, blocks: kv_cache.new_empty((blocks.shape[0], *kv_cache.shape[1:])),
           as_aten=(torch.ops.aten.index_select.default, lambda kv_cache, blocks: (kv_cache, 0, blocks)))
def gather_cache_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """kv_cache[blocks] as one opaque op in graphs: ATen copies whole blocks, where inductor's generated
    gather indexes element by element (and may gather again for each consumer of the keys)."""
    return kv_cache.index_select(0, blocks)


SMALL_BMM_ROWS = 64   # up to this many rows in all (batch x rows), a CPU graph's bmm is a fused reduction


def small_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm, except for a small bf16/fp16 product in a CPU graph (a verify step's attention at small batch):
    a broadcast product summed over the shared dimension, which inductor fuses with its neighbours into one
    kernel. fp32 products go to MKL, as fp32 linears do (the A/Bs are in docs/history.md)."""
    if a.dtype != torch.float32 and few_rows_in_cpu_graph(a, a.shape[0] * a.shape[1]):
        return (a.unsqueeze(-1) * b.unsqueeze(1)).sum(2)
    return torch.bmm(a, b)


def few_rows_in_cpu_graph(t: torch.Tensor, rows) -> bool:
    """Compiling a CPU graph over at most SMALL_BMM_ROWS rows, where products and reductions written as broadcast
    sums fuse into inductor's kernels (statically_known_true: a graph with a dynamic batch counts as many rows)."""
    return torch.compiler.is_compiling() and t.device.type == "cpu" and statically_known_true(rows <= SMALL_BMM_ROWS)


def dense_metadata(batch: int, seq_len: int, device) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for a [batch, seq_len] causal batch with no cache (training, references)."""
    positions = torch.arange(seq_len, device=device).repeat(batch)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, device=device) * seq_len,
        seq_lens=torch.full((batch,), seq_len, device=device),
        slot_mapping=torch.empty(0, dtype=torch.long, device=device),
        block_tables=torch.empty(batch, 0, dtype=torch.long, device=device),
        max_query_len=seq_len, max_seq_len=seq_len)
    return meta.prepare(positions), positions


class MLAttention(nn.Module):
    """Under tensor parallelism a rank holds num_attention_heads / tp heads (their q, kv_b rows and o_proj
    columns) and the whole latent projection; its output is a partial sum, completed by the caller's all-reduce."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.num_heads = tp.divide(cfg.num_attention_heads, "num_attention_heads")
        self.adds_o_bias = tp.rank == 0   # a row-parallel bias is added once, not once per rank
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        h = cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_cache_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=cfg.attention_bias)
        self.scale = softmax_scale(cfg)
        self.rotary = [rotary]  # a list, so the shared module is not registered once per layer
        self.mode = "auto"       # "auto" | "absorbed" | "expanded"
        # set by fuse() for inference: the two projections of x as one GEMM; W_UK, W_UV stored [heads, out, in]
        self.x_proj: torch.Tensor | None = None
        self.w_uk_t: torch.Tensor | None = None   # [H, r, nope]
        self.w_uv: torch.Tensor | None = None     # [H, v, r]

    @torch.no_grad()
    def fuse(self) -> None:
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        if first.bias is None and self.kv_a_proj_with_mqa.bias is None:
            self.x_proj = share_storage([first, self.kv_a_proj_with_mqa])
        w_uk, w_uv = self._absorbed_weights()
        self.w_uk_t, self.w_uv = w_uk.transpose(1, 2).contiguous(), w_uv.contiguous()

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w_kv[:, :self.nope_dim], w_kv[:, self.nope_dim:]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x -> (queries [N, H * qk_head_dim], kv_a output [N, r + rope])."""
        if self.x_proj is not None:
            q, kv_a = linear(x, self.x_proj).split([self.x_proj.shape[0] - self.kv_a_proj_with_mqa.weight.shape[0],
                                                       self.kv_a_proj_with_mqa.weight.shape[0]], dim=-1)
        else:
            q = apply_linear(self.q_proj if self.q_lora_rank is None else self.q_a_proj, x)
            kv_a = apply_linear(self.kv_a_proj_with_mqa, x)
        if self.q_lora_rank is not None:
            q = apply_linear(self.q_b_proj, self.q_a_layernorm(q))
        return q, kv_a

    def latent_kv(self, kv_a: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What the cache keeps per token: the normalized latent and the rotated shared rope key."""
        latent, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(latent), self.rotary[0](positions, k_pe)], dim=-1)

    def write_kv(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_cache: torch.Tensor) -> None:
        kv = self.latent_kv(linear(x, weight_of(self.kv_a_proj_with_mqa), self.kv_a_proj_with_mqa.bias), positions)
        write_slots(kv_cache, slot_mapping, kv)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor | None) -> torch.Tensor:
        """x: [N, hidden] flat tokens. kv_cache None: keys are this batch's own tokens (dense batches)."""
        n = x.shape[0]
        q, kv_a = self._project(x)
        q = q.view(n, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = self.rotary[0](positions, q_pe)
        if kv_cache is None:
            keys = self.latent_kv(kv_a, positions).view(meta.seq_lens.shape[0], meta.max_seq_len, -1)
            out = self._attend(q_nope, q_pe, meta, keys)
        else:
            if meta.slot_mapping is not None:   # (None: the caller wrote this batch's KV already)
                kv_new = self.latent_kv(kv_a, positions)
                write_slots(kv_cache, meta.slot_mapping, kv_new)
            if meta.parts:   # decode rows and prompt chunks attend apart (AttentionMetadata.parts)
                out = q_nope.new_empty(n, self.num_heads, self.v_dim)
                for tokens, part in meta.parts:
                    out[tokens] = self._attend(q_nope[tokens], q_pe[tokens], part, kv_cache=kv_cache)
            else:
                out = self._attend(q_nope, q_pe, meta, kv_cache=kv_cache)
        return linear(out.reshape(n, self.num_heads * self.v_dim), weight_of(self.o_proj),
                      self.o_proj.bias if self.adds_o_bias else None)

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata,
                keys: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H, nope], [N, H, rope] queries over keys [B, max_seq_len, r + rope], or else over each request's
        blocks of kv_cache -> [N, H, v]."""
        n, batch = q_nope.shape[0], meta.seq_lens.shape[0]
        uniform = n == batch * meta.max_query_len   # every row has max_query_len tokens: a plain view

        def to_padded(t):  # [N, H, d] -> [B, H, max_q, d]
            if uniform:
                return t.view(batch, meta.max_query_len, *t.shape[1:]).transpose(1, 2)
            out = t.new_zeros(batch, meta.max_query_len, *t.shape[1:])
            out[meta.token_row, meta.token_col] = t
            return out.transpose(1, 2)

        def from_padded(t):  # [B, H, max_q, d] -> [N, H, d]
            t = t.transpose(1, 2)
            return t.reshape(n, *t.shape[2:]) if uniform else t[meta.token_row, meta.token_col]

        def gathered():  # the keys, given or copied out of the cache's blocks
            return cached_keys(kv_cache, meta, q_nope.dtype) if keys is None else keys

        absorbed = self.mode == "absorbed" or (self.mode == "auto" and meta.max_query_len <= ABSORB_MAX_QUERY_LEN)
        if absorbed:
            q_latent = self._absorb_queries(q_nope)
            query = to_padded(torch.cat([q_latent, q_pe], dim=-1))           # [B, H, max_q, r + rope]
            # One latent key/value per token, shared by every head: heads become extra query rows (MQA).
            rows = query.reshape(batch, -1, query.shape[-1])
            source, tables = (kv_cache, meta.block_tables) if keys is None else (keys, None)   # (cache: in place)
            if cpu_kernels.usable(rows, source):   # (each row's bits its own)
                out = cpu_kernels.latent_attention(rows, source, meta.mask.squeeze(1).contiguous(), self.scale,
                                                   self.kv_lora_rank, tables)
            else:
                keys = gathered()
                scores = small_bmm(rows, keys.transpose(1, 2)).float() * self.scale    # [B, H * max_q, kv]
                mask = meta.mask.expand(-1, self.num_heads, -1, -1).reshape(batch, -1, scores.shape[-1])
                probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(keys.dtype)
                out = small_bmm(probs, keys[..., :self.kv_lora_rank])
            out = out.view(batch, self.num_heads, meta.max_query_len, -1)
            return self._absorb_values(from_padded(out))
        c, k_rope = gathered().split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = F.linear(c, self.kv_b_proj.weight).view(batch, -1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, value = kv.split([self.nope_dim, self.v_dim], dim=-1)
        key = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, self.num_heads, -1)], dim=-1)
        query = to_padded(torch.cat([q_nope, q_pe], dim=-1))
        # values padded to the keys' head size [.., 32] -> [.., 48]: fused (flash) kernels need one head size
        value = F.pad(value, (0, key.shape[-1] - self.v_dim))
        out = F.scaled_dot_product_attention(query, key.transpose(1, 2), value.transpose(1, 2),
                                             attn_mask=None if meta.causal else meta.mask, is_causal=meta.causal,
                                             scale=self.scale)
        return from_padded(out[..., :self.v_dim])                              # [N, H, v]

    def _absorb_queries(self, q_nope: torch.Tensor) -> torch.Tensor:   # [N, H, nope] -> [N, H, r]
        if self.w_uk_t is None:
            return torch.einsum("nhd,hdr->nhr", q_nope, self._absorbed_weights()[0])
        return per_head(q_nope, self.w_uk_t)

    def _absorb_values(self, out: torch.Tensor) -> torch.Tensor:       # [N, H, r] -> [N, H, v]
        if self.w_uv is None:
            return torch.einsum("nhr,hvr->nhv", out, self._absorbed_weights()[1])
        return per_head(out, self.w_uv)


def per_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, H, in] times each head's weight [H, out, in] -> [N, H, out]."""
    if cpu_kernels.usable(x, weight):
        return cpu_kernels.bf16_bmm(x.transpose(0, 1), weight).transpose(0, 1)
    return small_bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)
