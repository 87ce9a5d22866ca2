"""Configuration: the model's (read from an HF config.json) and the engine's."""
import json
import os
from dataclasses import dataclass, field, fields

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")


@dataclass
class ModelConfig:
    """DeepSeek-V2/V3 architecture; field names are the HF config.json names."""
    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int | None = 256
    n_shared_experts: int | None = 1
    num_experts_per_tok: int | None = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    attention_bias: bool = False
    rope_interleave: bool = True
    bos_token_id: int | None = 0
    eos_token_id: int | list | None = 1
    torch_dtype: str | None = None
    quantization_config: dict | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the compressed latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (bool(self.n_routed_experts) and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        if "rope_scaling" not in d and isinstance(d.get("rope_parameters"), dict):
            rp = dict(d["rope_parameters"])  # transformers >= 5 writes rope_parameters
            d.setdefault("rope_theta", rp.pop("rope_theta", 10000.0))
            kind = rp.get("rope_type", rp.get("type", "default"))
            d["rope_scaling"] = None if kind == "default" else rp
        if d.get("model_type") == "deepseek_v2":  # fields V2 configs lack, with V2's meaning
            d.setdefault("scoring_func", "softmax")
            d.setdefault("topk_method", "greedy")
            d.setdefault("n_group", 1)
            d.setdefault("topk_group", 1)
            d.setdefault("routed_scaling_factor", 1.0)
            d.setdefault("norm_topk_prob", False)
        if d.get("num_mtp_layers") is not None:
            d.setdefault("num_nextn_predict_layers", d["num_mtp_layers"])
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise ValueError(f"model: no config.json in {path!r}")
        with open(config_file) as f:
            return cls.from_dict(json.load(f))

    def validate(self) -> None:
        def refuse(name, why):
            raise ValueError(f"config field {name!r} = {getattr(self, name)!r}: {why}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            refuse("model_type", f"supported: {SUPPORTED_MODEL_TYPES}")
        if self.hidden_act != "silu":
            refuse("hidden_act", "only 'silu' is supported")
        if self.scoring_func not in ("sigmoid", "softmax"):
            refuse("scoring_func", "supported: 'sigmoid', 'softmax'")
        if self.topk_method not in ("noaux_tc", "group_limited_greedy", "greedy"):
            refuse("topk_method", "supported: 'noaux_tc', 'group_limited_greedy', 'greedy'")
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                refuse("n_group", f"must divide n_routed_experts={self.n_routed_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                refuse("topk_group", f"must be in [1, n_group={self.n_group}]")
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                refuse("num_experts_per_tok", f"must be in [1, n_routed_experts={self.n_routed_experts}]")
            if self.topk_method == "noaux_tc" and self.n_routed_experts // self.n_group < 2:
                refuse("n_group", "noaux_tc scores a group by its top-2 experts: needs >= 2 experts per group")
            if self.moe_layer_freq < 1:
                refuse("moe_layer_freq", "must be >= 1")
        if self.qk_rope_head_dim % 2:
            refuse("qk_rope_head_dim", "must be even")
        if self.num_nextn_predict_layers < 0:
            refuse("num_nextn_predict_layers", "must be >= 0")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            if kind not in ("yarn", "default"):
                refuse("rope_scaling", "only YaRN rope scaling is supported")
        q = self.quantization_config
        if q is not None and q.get("quant_method") != "fp8":
            refuse("quantization_config", "only block-wise 'fp8' checkpoints are supported")


def check_int_in_range(field: str, value, low: int, high: int | None, what: str = "") -> None:
    """ValueError naming the field and the limits unless value is an int (not a bool) in [low, high]."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        limits = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{field} = {value!r}: must be an integer {limits}" + (f" ({what})" if what else ""))


@dataclass
class SpeculativeConfig:
    method: str = "mtp"                     # "mtp" (alias "deepseek_mtp") | "ngram" (prompt lookup, spec_decode/ngram.py)
    num_speculative_tokens: int = 1         # k: drafts per step (the most, when adaptive), 1..16
    draft_sampling: str = "probabilistic"   # "probabilistic": drafts sampled from the MTP's distribution | "greedy":
                                            # argmax drafts, treated as one-hot (vllm-ascend's shortcut); both lossless
    verification: str = "token"             # "token": token-wise rejection sampling | "block": block verification
    scorer: str = "mqa"                     # "mqa": one row of 1+k tokens per request | "batch_expansion": 1+k rows
    synthetic_acceptance: float | None = None  # measurement mode only (bench); never lossless
    allow_lossy_measurement: bool = False      # the explicit opt-in synthetic_acceptance needs (bench sets it)
    draft_vocab_size: int | None = None      # drafts over the N most frequent tokens only (spec_decode/draft_vocab.py)
    prompt_lookup_max: int | None = None     # ngram: the longest suffix looked up (4 when not given)
    prompt_lookup_min: int | None = None     # ngram: the shortest (1 when not given)
    adaptive: bool | None = None             # mtp: k in [0, num_speculative_tokens] chosen each step (spec_decode/
                                             # adaptive.py); the default for mtp, false: always k drafts
    fused_graph_step: bool = True            # mtp: a decode step verifies, accepts, drafts in one function
                                             # (spec_decode/fused.py; compiled in graph mode)

    @property
    def verified_draft_counts(self) -> list[int]:
        """How many drafts a decode step may verify (graph shapes to compile): k, or any of 0..k when adaptive."""
        k = self.num_speculative_tokens
        return list(range(k + 1)) if self.adaptive else [k]

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeculativeConfig | None":
        if d is None:
            return None
        if isinstance(d, str):
            d = json.loads(d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**d)
        if cfg.method == "deepseek_mtp":
            cfg.method = "mtp"
        choices = {"method": ("mtp", "ngram"), "draft_sampling": ("probabilistic", "greedy"),
                   "verification": ("token", "block"), "scorer": ("mqa", "batch_expansion")}
        for name, allowed in choices.items():
            if getattr(cfg, name) not in allowed:
                raise ValueError(f"speculative_config.{name} = {getattr(cfg, name)!r}: must be one of {allowed}")
        if not isinstance(cfg.num_speculative_tokens, int) or not 1 <= cfg.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer in [1, 16]")
        if cfg.synthetic_acceptance is not None and not 0.0 <= cfg.synthetic_acceptance <= 1.0:
            raise ValueError("speculative_config.synthetic_acceptance must be in [0, 1]")
        if cfg.synthetic_acceptance is not None and cfg.allow_lossy_measurement is not True:
            raise ValueError("speculative_config.synthetic_acceptance: a benchmark measurement mode whose output is "
                             "NOT the model's (drafts pass by coin flip); it needs \"allow_lossy_measurement\": true "
                             "(mtpserve bench --synthetic-acceptance sets it)")
        if cfg.adaptive is None:
            cfg.adaptive = cfg.method == "mtp" and cfg.synthetic_acceptance is None
        for name in ("adaptive", "fused_graph_step"):
            if not isinstance(getattr(cfg, name), bool):
                raise ValueError(f"speculative_config.{name} = {getattr(cfg, name)!r}: must be true or false")
        if cfg.adaptive and cfg.method != "mtp":
            raise ValueError("speculative_config.adaptive: only for method 'mtp'")
        if cfg.adaptive and cfg.synthetic_acceptance is not None:
            raise ValueError("speculative_config.adaptive: not with synthetic_acceptance")
        only_for = {"draft_vocab_size": "mtp", "prompt_lookup_max": "ngram", "prompt_lookup_min": "ngram"}
        for name, method in only_for.items():
            if getattr(cfg, name) is not None and cfg.method != method:
                raise ValueError(f"speculative_config.{name}: only for method {method!r}, not {cfg.method!r}")
        if cfg.draft_vocab_size is not None:
            check_int_in_range("speculative_config.draft_vocab_size", cfg.draft_vocab_size, 1, None,
                               "at most the vocabulary size")
        if cfg.method == "ngram":
            cfg.prompt_lookup_max = 4 if cfg.prompt_lookup_max is None else cfg.prompt_lookup_max
            cfg.prompt_lookup_min = 1 if cfg.prompt_lookup_min is None else cfg.prompt_lookup_min
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                check_int_in_range(f"speculative_config.{name}", getattr(cfg, name), 1, 64)
            if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
                raise ValueError(f"speculative_config.prompt_lookup_min = {cfg.prompt_lookup_min}: must be at most "
                                 f"prompt_lookup_max = {cfg.prompt_lookup_max}")
        return cfg


@dataclass
class EngineConfig:
    model: str                                # HF DeepSeek-V3 checkpoint directory (None in LLM: the shipped model)
    dtype: str = "auto"                       # "auto": bf16 on CUDA; the CPU: a bf16 checkpoint's bf16, else fp32
    device: str = "auto"                      # "cpu" | "cuda" | "auto" (cuda when available)
    max_num_seqs: int = 64                    # requests running at once
    max_num_batched_tokens: int = 2048        # tokens per step, prompt chunks included
    max_model_len: int | None = None          # None: the model's max_position_embeddings
    block_size: int = 16                      # tokens per KV-cache block
    num_kv_blocks: int | None = None          # None -> sized from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.2     # of free memory (CUDA) / of total RAM (CPU), capped by need
    enforce_eager: bool | None = None         # None: graph mode where it starts at once (engine/setup.py)
    graph_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])   # graph mode's sizes (CPU:
    #                                          a graph each up to 8 rows, one with a dynamic batch above)
    compile_in_background: bool = False       # graph mode, CPU: ready at once; each graph compiled when first needed
    #                                          (the default on the CPU in one process)
    speculative: SpeculativeConfig | None = None   # speculative_config (a dict in LLM / from_kwargs); None: off
    seed: int = 0                             # the engine's random stream (unseeded requests)
    skip_tokenizer_init: bool = False         # token ids in and out only
    tensor_parallel_size: int = 1             # ranks, one process each (model/parallel.py, executor/)
    data_parallel_size: int = 1               # engine cores (scheduler + KV cache each), one rank each
    enable_expert_parallel: bool = False      # routed experts partitioned over all ranks (not split by TP)
    nnodes: int = 1                           # multi-node: the ranks are split evenly over the nodes
    node_rank: int = 0                        # this node (0 runs the engine)
    master_addr: str = "127.0.0.1"            # node 0's address (rendezvous)
    master_port: int | None = None            # None: a free port (single node)
    quantization: str | None = None           # "fp8"/"int8": weights in memory; "none": dequantize; None: the checkpoint's
    overlap: bool = False                     # a model thread runs each step while the engine finishes the one before
    enable_prefix_caching: bool = True        # full blocks of computed KV reused by requests with the same prefix
    cpu_threads: int | None = None            # torch threads per rank on the CPU (None: the node's cores / its ranks)


def eos_token_ids(model_config: ModelConfig, tokenizer) -> set[int]:
    """The ids that end a request: the config's EOS ids and the tokenizer's."""
    ids = set(model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
