"""`mtpserve bench scaling`: how a checkpoint lays out over N devices, from its config.json alone.

For tensor parallelism (TP=N, what mtpserve runs today) and for data-parallel attention with expert parallelism
(DP=N, EP=N: vllm-ascend's deployment), per device: weight bytes, KV bytes per token and the tokens
of KV that fit, and the bytes each device sends per decode step. Parameter counts follow the model code
(model/parallel.py says what is split); FP8 counts DeepSeek's FP8 tensors (every linear weight but the
router, embedding and head) at one byte.
"""
import json
import os

from mtpserve.config import ModelConfig

GIB = 2 ** 30
DEEPSEEK_V3 = dict(num_nextn_predict_layers=1)   # ModelConfig's defaults are DeepSeek-V3's numbers


def parameter_groups(cfg: ModelConfig) -> dict:
    """Parameters by how tensor parallelism treats them: split over TP ranks or replicated, and experts apart
    (EP splits those by expert). Norms are left out (a few MB)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q = h * heads * cfg.qk_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank * heads * cfg.qk_head_dim
    attn_split = q + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) + heads * cfg.v_head_dim * h
    attn_replicated = h * cfg.kv_cache_dim + (h * cfg.q_lora_rank if cfg.q_lora_rank else 0)
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) + cfg.num_nextn_predict_layers
    dense_layers = layers - moe_layers
    experts = moe_layers * (cfg.n_routed_experts or 0) * 3 * h * cfg.moe_intermediate_size
    shared = moe_layers * 3 * h * cfg.moe_intermediate_size * (cfg.n_shared_experts or 0)
    return dict(
        split=layers * attn_split + dense_layers * 3 * h * cfg.intermediate_size + shared,
        replicated_fp8=layers * attn_replicated + cfg.num_nextn_predict_layers * 2 * h * h,   # + eh_proj
        router=moe_layers * (cfg.n_routed_experts or 0) * h,
        vocab=2 * cfg.vocab_size * h,   # embedding + output head (MTP layers share them)
        experts=experts)


def expert_devices_reached(cfg: ModelConfig, devices: int) -> int:
    """The most devices one token's experts can be on: k experts, within topk_group of n_group groups (DeepSeek's
    group-limited routing), the experts partitioned contiguously over the devices."""
    k = cfg.num_experts_per_tok or 0
    if cfg.n_group and cfg.n_group > 1 and cfg.topk_group:
        return min(k, devices, cfg.topk_group * max(1, devices // cfg.n_group))
    return min(k, devices)


def layouts(cfg: ModelConfig, devices: int, memory_gib: float, fp8: bool, batch_per_device: int,
            memory_utilization: float = 0.9) -> list[dict]:
    g = parameter_groups(cfg)
    w = 1 if fp8 else 2                            # bytes of a (quantizable) linear weight
    kv_per_token = (cfg.num_hidden_layers + cfg.num_nextn_predict_layers) * cfg.kv_cache_dim * 2   # bf16 latent
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) + cfg.num_nextn_predict_layers
    h = cfg.hidden_size
    usable = memory_gib * GIB * memory_utilization
    out = []
    for name, split_by, experts_by in (("TP", devices, devices), ("DP+EP", 1, devices)):
        weights = ((g["split"] * w + g["vocab"] * 2) / split_by + g["replicated_fp8"] * w + g["router"] * 4
                   + g["experts"] * w / experts_by)
        if name == "TP":   # two all-reduces of [batch, hidden] bf16 per layer; ring: 2 (N-1)/N of it sent
            sent = batch_per_device * layers * 2 * h * 2 * 2 * (devices - 1) / devices
        else:              # each token's hidden state to its experts' devices and back (all-to-all)
            sent = batch_per_device * moe_layers * expert_devices_reached(cfg, devices) * h * 2 * 2 * (devices - 1) / devices
        # all-gather + reduce-scatter (what mtpserve's EP does): every token to every device and back
        gathered = batch_per_device * moe_layers * h * 2 * 2 * (devices - 1) if name == "DP+EP" else 0
        kv_tokens = max(0.0, usable - weights) / kv_per_token
        out.append(dict(layout=f"{name}={devices}", weight_gib=weights / GIB, kv_bytes_per_token=kv_per_token,
                        kv_tokens_per_device=kv_tokens, fits=weights < usable,
                        sent_mib_per_step=sent / 2 ** 20, gathered_mib_per_step=gathered / 2 ** 20,
                        batch_per_device=batch_per_device,
                        # TP: every device sees the same batch; DP+EP: every device's batch reaches the experts
                        tokens_per_expert_per_step=(batch_per_device * (devices if name == "DP+EP" else 1)
                                                    * (cfg.num_experts_per_tok or 0) / (cfg.n_routed_experts or 1)),
                        experts_per_device=(cfg.n_routed_experts or 0) / experts_by))
    return out


def load_config(spec: str) -> ModelConfig:
    """'deepseek-v3' or a checkpoint directory / config.json path."""
    if spec == "deepseek-v3":
        return ModelConfig(**DEEPSEEK_V3)
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    with open(path) as f:
        return ModelConfig.from_dict(json.load(f))


def table(cfg: ModelConfig, device_counts: list[int], memory_gib: float, fp8: bool, batch: int) -> list[str]:
    g = parameter_groups(cfg)
    total = sum(g.values())
    lines = [f"{total / 1e9:.1f}B parameters (experts {g['experts'] / 1e9:.1f}B), weights in "
             f"{'FP8' if fp8 else 'BF16'}, {memory_gib:.0f} GiB per device (90% usable), batch {batch} per device "
             f"in decode.", "",
             "| layout | weights / device (GiB) | KV / token (KiB) | KV tokens / device | routed experts / device "
             "| sent / device / decode step (MiB) | DP+EP by all-gather + reduce-scatter (MiB) | tokens / expert / step |",
             "|---|---|---|---|---|---|---|---|"]
    for n in device_counts:
        for row in layouts(cfg, n, memory_gib, fp8, batch):
            kv = f"{row['kv_tokens_per_device']:,.0f}" if row["fits"] else "does not fit"
            gathered = f"{row['gathered_mib_per_step']:.1f}" if row["gathered_mib_per_step"] else "—"
            lines.append(f"| {row['layout']} | {row['weight_gib']:.1f} | {row['kv_bytes_per_token'] / 1024:.1f} | {kv} "
                         f"| {row['experts_per_device']:.0f} | {row['sent_mib_per_step']:.1f} | {gathered} "
                         f"| {row['tokens_per_expert_per_step']:.1f} |")
    return lines
