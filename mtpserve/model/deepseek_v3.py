"""DeepSeek-V3 (and V2): decoder stack, LM head and the MTP modules.

Parameter names follow the HF checkpoint: `model.*` and `lm_head.*` for the main model; MTP module i is
`mtp_layers.{i}.*` here and `model.layers.{num_hidden_layers + i}.*` in a checkpoint (see loader.py).
Under tensor parallelism (`tp`, model/parallel.py) each rank builds its shard; every block ends in one
all-reduce per sub-layer, and logits are gathered whole on every rank. Under expert parallelism (`ep`) each
rank builds only its routed experts.
"""
import torch
from torch import nn

from mtpserve.config import ModelConfig
from mtpserve.model import cpu_kernels
from mtpserve.model.attention import AttentionMetadata, MLAttention, dense_metadata
from mtpserve.model.fp8 import weight_of
from mtpserve.model.layers import MLP, RMSNorm, RotaryEmbedding, by_columns, linear
from mtpserve.model.moe import MoE
from mtpserve.model.parallel import ExpertParallel, TensorParallel, VocabParallelEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TensorParallel,
                 ep: ExpertParallel):
        super().__init__()
        self.tp = tp
        self.self_attn = MLAttention(cfg, rotary, tp)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg, tp, ep)
        else:
            self.mlp = MLP(cfg.hidden_size, tp.divide(cfg.intermediate_size, "intermediate_size"))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, meta, kv_cache):
        x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x), positions, meta, kv_cache))
        return x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, head: nn.Linear):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = head


class MTPLayer(DecoderLayer):
    """One MTP module: x = eh_proj([enorm(embed(t[p+1])), hnorm(h[p])]) -> decoder block -> shared head."""

    def __init__(self, cfg, layer_idx, rotary, embed_tokens: VocabParallelEmbedding, lm_head: nn.Linear,
                 tp: TensorParallel, ep: ExpertParallel):
        super().__init__(cfg, layer_idx, rotary, tp, ep)
        self.vocab_size = cfg.vocab_size
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.embed_tokens = embed_tokens          # shared with the main model unless the checkpoint differs
        self.shared_head = SharedHead(cfg, lm_head)
        self.draft_head: torch.Tensor | None = None   # the head's rows for a draft vocabulary (set_draft_vocab)
        self.draft_columns: torch.Tensor | None = None  # TP: the gathered draft columns that are not padding

    def forward(self, input_ids, prev_hidden, positions, meta, kv_cache, output_index=None):
        """output_index (one token per request, or none): only those tokens' outputs are wanted. The others
        then only write their KV; attention and MoE run for the wanted tokens alone (exact: nothing else reads
        them)."""
        x = linear(torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(prev_hidden)], dim=-1),
                   weight_of(self.eh_proj))
        if output_index is None or kv_cache is None or len(output_index) == x.shape[0]:   # (all wanted)
            return super().forward(x, positions, meta, kv_cache)
        self.self_attn.write_kv(self.input_layernorm(x), positions, meta.slot_mapping, kv_cache)
        if len(output_index) == 0:   # the KV alone
            return x[:0]
        return super().forward(x[output_index], positions[output_index], meta.select(output_index), kv_cache)

    def logits(self, hidden: torch.Tensor, restricted: bool = False) -> torch.Tensor:
        """Over the whole vocabulary, or (restricted) over the draft vocabulary's tokens only, if one is set."""
        restricted = restricted and self.draft_head is not None
        weight = self.draft_head if restricted else self.shared_head.head.weight
        logits = self.tp.all_gather_last(linear(self.shared_head.norm(hidden), weight)).float()
        if restricted:
            return logits if self.draft_columns is None else logits[..., self.draft_columns]
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size]


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, ep: ExpertParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, tp, ep) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel(), ep: ExpertParallel | None = None):
        super().__init__()
        ep = ep or ExpertParallel()
        self.config, self.tp, self.ep = cfg, tp, ep
        self.rotary = RotaryEmbedding(cfg)
        self.model = Backbone(cfg, self.rotary, tp, ep)
        self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_rows(cfg.vocab_size), bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp_layers = nn.ModuleList(
            MTPLayer(cfg, cfg.num_hidden_layers + i, self.rotary, self.model.embed_tokens, self.lm_head, tp, ep)
            for i in range(cfg.num_nextn_predict_layers))
        self.draft_vocab: torch.Tensor | None = None   # token ids the MTP drafts from (None: all)

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp_layers)

    def fuse_for_inference(self) -> "DeepseekV3ForCausalLM":
        """Fewer, larger GEMMs: projections of the same input share one weight, experts are stacked. The
        parameters become views of the fused tensors (same names and values), so this is for inference only.
        fp32 weights on the CPU are then stored by columns (layers.by_columns)."""
        for name, m in self.named_modules():
            if hasattr(m, "fuse") and ".experts." not in name:   # MoE.fuse stacks its experts itself
                m.fuse()
        embedding = self.model.embed_tokens.weight   # (an embedding reads rows: a tied head stays row by row)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.weight.is_contiguous() and m.weight is not embedding:
                m.weight = nn.Parameter(by_columns(m.weight.detach()), requires_grad=False)
        if embedding.device.type == "cpu" and embedding.dtype in (torch.bfloat16, torch.float32):   # few-row products
            cpu_kernels.load()
        return self

    def set_attention_mode(self, mode: str) -> None:
        if mode not in ("auto", "absorbed", "expanded"):
            raise ValueError(f"attention mode {mode!r}: must be 'auto', 'absorbed' or 'expanded'")
        for m in self.modules():
            if isinstance(m, MLAttention):
                m.mode = mode

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor] | None) -> torch.Tensor:
        """Flat batch -> final-normed hidden states [N, hidden]. kv_caches: one per main layer (or None)."""
        if meta.mask is None:
            meta.prepare(positions)
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, meta, None if kv_caches is None else kv_caches[i])
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(linear(hidden, self.lm_head.weight)).float()
        vocab = self.config.vocab_size
        return logits if logits.shape[-1] == vocab else logits[..., :vocab]

    def mtp_forward(self, depth: int, input_ids, positions, prev_hidden, meta: AttentionMetadata,
                    kv_cache: torch.Tensor | None, output_index: torch.Tensor | None = None) -> torch.Tensor:
        """MTP module `depth` on a flat batch; returns its block output (before shared_head.norm), for every
        token or only for `output_index`."""
        if meta.mask is None:
            meta.prepare(positions)
        return self.mtp_layers[depth](input_ids, prev_hidden, positions, meta, kv_cache, output_index)

    def mtp_logits(self, depth: int, hidden: torch.Tensor, restricted: bool = False) -> torch.Tensor:
        """[N, vocab]; restricted and a draft vocabulary set: [N, len(self.draft_vocab)] (column j scores token
        self.draft_vocab[j])."""
        return self.mtp_layers[depth].logits(hidden, restricted)

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Drafting scores only these tokens: each MTP head keeps a copy of their rows (layers sharing one head
        share the copy). Under tensor parallelism a rank copies the rows it holds, padded to the most any rank
        holds; the gathered columns are then ordered by rank, and draft_vocab lists the tokens in that order."""
        tp, rows = self.tp, self.tp.vocab_rows(self.config.vocab_size)
        owner = token_ids.cpu() // rows
        order = owner.argsort(stable=True)
        counts = torch.bincount(owner, minlength=tp.size)
        width = int(counts.max())
        local = token_ids.cpu()[owner == tp.rank] - tp.rank * rows
        self.draft_vocab = token_ids[order.to(token_ids.device)]
        columns = torch.cat([r * width + torch.arange(int(c)) for r, c in enumerate(counts.tolist())])
        copies = {}
        for layer in self.mtp_layers:
            head = layer.shared_head.head.weight
            if id(head) not in copies:
                copy = head.new_zeros(width, head.shape[1])
                copy[:len(local)] = head.index_select(0, local.to(head.device))
                copies[id(head)] = by_columns(copy)
            layer.draft_head = copies[id(head)]
            layer.draft_columns = None if tp.size == 1 else columns.to(head.device)

    # Dense [B, T] causal batches without a cache: training and reference checks.
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        meta, positions = dense_metadata(b, t, input_ids.device)
        return self(input_ids.flatten(), positions, meta, None).view(b, t, -1)

    def mtp_forward_dense(self, depth: int, input_ids: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        meta, positions = dense_metadata(b, t, input_ids.device)
        out = self.mtp_forward(depth, input_ids.flatten(), positions, prev_hidden.reshape(b * t, -1), meta, None)
        return out.view(b, t, -1)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
