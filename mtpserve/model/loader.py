"""Loading HF DeepSeek-V2/V3 safetensors checkpoints (single file or sharded; bf16/fp16/fp32 or block FP8).

The model is built on the meta device and each parameter is read from the checkpoint straight into its final
dtype, one at a time; under tensor parallelism each rank reads only its slices (`safe_open(...).get_slice`), so
a rank never reads, or holds, the whole checkpoint.
"""
import json
import os
import re

import torch
from safetensors import safe_open

from mtpserve.config import ModelConfig
from mtpserve.model.checkpoint import hf_name
from mtpserve.model.deepseek_v3 import DeepseekV3ForCausalLM
from mtpserve.model.int8 import quantize_rows as quantize_int8, set_int8
from mtpserve.model.fp8 import Fp8Weight, from_tiles, keeps_fp8, quantize_rows, set_fp8
from mtpserve.model.parallel import ExpertParallel, TensorParallel, VocabParallelEmbedding, shard_kind, shard_slices

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_SHARED_IN_MTP = ("embed_tokens.weight", "shared_head.head.weight")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def our_name(key: str, num_hidden_layers: int) -> str:
    """Checkpoint key -> our parameter name (inverse of checkpoint.hf_name)."""
    m = _LAYER_KEY.match(key)
    if m and int(m.group(1)) >= num_hidden_layers:
        return f"mtp_layers.{int(m.group(1)) - num_hidden_layers}.{m.group(2)}"
    return key


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(path, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"model: no model.safetensors or model.safetensors.index.json in {path!r}")


def quantize_fp8_blockwise(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 weight, weight_scale_inv [ceil(out/b0), ceil(in/b1)]) as DeepSeek ships them."""
    b0, b1 = block
    out_dim, in_dim = w.shape
    padded = torch.zeros(-(-out_dim // b0) * b0, -(-in_dim // b1) * b1, dtype=torch.float32)
    padded[:out_dim, :in_dim] = w.float()
    tiles = padded.view(padded.shape[0] // b0, b0, padded.shape[1] // b1, b1)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale[:, None, :, None]).view_as(padded)[:out_dim, :in_dim]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_fp8_blockwise(w: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
                             offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """w: a float8 weight, or a slice of one starting at (row, column) `offset` of the full tensor, whose
    block scales are `scale_inv` (the full tensor's)."""
    rows = (torch.arange(w.shape[0]) + offset[0]) // block[0]
    cols = (torch.arange(w.shape[1]) + offset[1]) // block[1]
    return w.float() * scale_inv.float()[rows][:, cols]


class LoadStats:
    """What a load read: checkpoint bytes (only this rank's slices) and tensors."""

    def __init__(self):
        self.bytes_read = 0
        self.tensors = 0


def _read_raw(f, key: str, index: tuple | None, stats: LoadStats) -> torch.Tensor:
    """This rank's part of checkpoint tensor `key` (all of it when index is None), as stored."""
    sl = f.get_slice(key)
    t = sl[index] if index is not None else sl[:]
    stats.bytes_read += t.numel() * t.element_size()
    stats.tensors += 1
    return t


def _scale_of(f, key: str, keys: set) -> torch.Tensor:
    scale_key = key.removesuffix("weight") + "weight_scale_inv"
    if scale_key not in keys:
        raise ValueError(f"checkpoint: FP8 tensor {key} has no {scale_key}")
    return f.get_tensor(scale_key)


def _slice_start(index: tuple | None) -> tuple[int, int]:
    """Where a slice begins in the full weight (row, column)."""
    starts = [s.start or 0 for s in index or ()] + [0, 0]
    return starts[0], starts[1]


def _block(cfg: ModelConfig) -> tuple[int, int]:
    return tuple((cfg.quantization_config or {}).get("weight_block_size", (128, 128)))


def _read_slice(f, key: str, keys: set, index: tuple | None, cfg: ModelConfig, stats: LoadStats):
    """This rank's part of checkpoint tensor `key`, float8 dequantized."""
    t = _read_raw(f, key, index, stats)
    if t.dtype == torch.float8_e4m3fn:
        t = dequantize_fp8_blockwise(t, _scale_of(f, key, keys), _block(cfg), _slice_start(index))
    return t


def _read_fp8(f, key: str, keys: set, index: tuple | None, cfg: ModelConfig, stats: LoadStats,
              device) -> Fp8Weight:
    """This rank's slice of `key` in FP8: as stored when FP8; else quantized now, each of this rank's rows in full
    (one scale per row and 128 columns, as the one-process model has them), then cut to this rank's columns."""
    if f.get_slice(key).get_dtype() == "F8_E4M3":
        w = from_tiles(_read_raw(f, key, index, stats), _scale_of(f, key, keys), _slice_start(index), _block(cfg))
    else:
        rows = quantize_rows(_read_raw(f, key, None if index is None else index[:1], stats))
        columns = (slice(None), *(index or ())[1:])
        w = from_tiles(rows.data[columns], rows.scale, (0, _slice_start(index)[1]), (1, rows.block))
    return Fp8Weight(w.data.to(device, copy=True), w.scale.to(device), w.block)


MAP_WINDOW = 32 * 2 ** 20   # bytes read through one mapping of a checkpoint file before it is reopened


def _checkpoint_tensors(path: str, stats: LoadStats):
    """Yields (open file, key, the file's keys) for every checkpoint tensor. safetensors memory-maps a file, and
    the pages a rank touches count as resident while it stays mapped: the file is reopened (unmapped) after
    every MAP_WINDOW bytes read (stats.bytes_read, counted by the caller), so they stay bounded."""
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            keys = sorted(f.keys())
        key_set, done = set(keys), 0
        while done < len(keys):
            with safe_open(file, framework="pt") as f:
                window_start = stats.bytes_read
                while done < len(keys) and stats.bytes_read - window_start < MAP_WINDOW:
                    yield f, keys[done], key_set
                    done += 1


def load_model(path: str, dtype: torch.dtype = torch.float32, device="cpu", cfg: ModelConfig | None = None,
               tp: TensorParallel = TensorParallel(), stats: LoadStats | None = None,
               quantization: str | None = None, ep: ExpertParallel | None = None) -> DeepseekV3ForCausalLM:
    """Builds the model (this rank's shard under tensor parallelism, its experts under expert parallelism) on
    the meta device, then gives each parameter its checkpoint slice in its final dtype, one tensor at a time:
    peak memory is the shard plus one tensor. The MoE router stays float32 (routing is sensitive). quantization
    "fp8": linear weights stay (or, from an unquantized checkpoint, become) FP8 in memory (model/fp8.py); "int8":
    they become int8 with a scale per row (model/int8.py; an FP8 checkpoint's are dequantized first); None: all in
    `dtype`."""
    if quantization not in (None, "fp8", "int8"):
        raise ValueError(f"quantization = {quantization!r}: must be 'fp8', 'int8' or None")
    cfg = cfg or ModelConfig.from_pretrained(path)
    stats = stats if stats is not None else LoadStats()
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg, tp, ep)
    params = dict(model.named_parameters(remove_duplicate=False))
    owners = {name: model.get_submodule(name.rsplit(".", 1)[0]) for name in params}
    shared_in_mtp = {n for n in params if n.startswith("mtp_layers.") and n.endswith(_SHARED_IN_MTP)}
    optional = set(shared_in_mtp) | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    loaded, unexpected, bad_shape, mtp_copies = set(), [], [], {}
    with torch.no_grad():
        for f, key, keys in _checkpoint_tensors(path, stats):
            if key.endswith("weight_scale_inv") or key.endswith("rotary_emb.inv_freq"):
                continue
            name = our_name(key, cfg.num_hidden_layers)
            if name not in params and name not in shared_in_mtp:
                if not _other_ranks_expert(name, ep):
                    unexpected.append(key)
                continue
            full = tuple(f.get_slice(key).get_shape())
            kind = None if _EXPERT.search(name) and model.ep.size > 1 else shard_kind(name)   # (whole experts)
            try:
                index = shard_slices(kind, full, tp)
            except ValueError:
                index = None   # not divisible: reported as a wrong shape below
            expected = _full_shape(kind, tuple(params[name].shape), tp, cfg.vocab_size)
            if full != expected:
                bad_shape.append(f"{key}: checkpoint {full}, model {expected}")
                loaded.add(name)   # reported once, as wrongly shaped
                continue
            if quantization == "fp8" and keeps_fp8(name):
                set_fp8(owners[name], _read_fp8(f, key, keys, index, cfg, stats, device))
                loaded.add(name)
                continue
            if quantization == "int8" and keeps_fp8(name):   # (the same modules as FP8)
                set_int8(owners[name], quantize_int8(_read_slice(f, key, keys, index, cfg, stats).to(device), dtype))
                loaded.add(name)
                continue
            wanted = torch.float32 if ".mlp.gate." in name else dtype
            # (a copy: safetensors hands out views of the memory-mapped file; the slice gets memory of
            # its own and only its pages of the file are ever touched)
            t = _read_slice(f, key, keys, index, cfg, stats).to(device=device, dtype=wanted, copy=True)
            if kind == "vocab" and t.shape[0] < params[name].shape[0]:   # the last rank's padding rows
                t = torch.cat([t, t.new_zeros(params[name].shape[0] - t.shape[0], *t.shape[1:])])
            if name in shared_in_mtp:
                mtp_copies[name] = t   # decided below, once the main model's copy is loaded
                continue
            _set_param(owners[name], name.rsplit(".", 1)[1], t)
            loaded.add(name)
        missing = sorted(hf_name(n, cfg.num_hidden_layers) for n in set(params) - loaded - optional)
        if missing or unexpected or bad_shape:
            lines = [f"missing: {missing}"] * bool(missing) + [f"unexpected: {sorted(unexpected)}"] * bool(unexpected)
            raise ValueError(f"checkpoint {path!r} does not match the config:\n  "
                             + "\n  ".join(lines + [f"wrong shape: {bad_shape}"] * bool(bad_shape)))
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        for name, t in mtp_copies.items():
            _use_mtp_copy(model, name, t)
    model.rotary.cos, model.rotary.sin = torch.empty(0, device=device), torch.empty(0, device=device)
    model.rotary.reset_tables()
    return model


def _other_ranks_expert(name: str, ep: ExpertParallel | None) -> bool:
    """Expert parallelism: a routed expert another rank holds (never read here)."""
    return bool(_EXPERT.search(name)) and ep is not None and ep.size > 1


def _full_shape(kind: str | None, local: tuple, tp: TensorParallel, vocab: int) -> tuple:
    """The whole tensor's shape, from this rank's shard of it."""
    if kind is None or tp.size == 1:
        return local
    if kind == "column":
        return (local[0] * tp.size, *local[1:])
    if kind == "row":
        return (local[0], local[1] * tp.size)
    return (vocab, *local[1:])


def _set_param(module: torch.nn.Module, attr: str, t: torch.Tensor) -> None:
    setattr(module, attr, torch.nn.Parameter(t, requires_grad=False))


def cast_model(model: DeepseekV3ForCausalLM, dtype: torch.dtype) -> DeepseekV3ForCausalLM:
    """Casts weights to `dtype`; the MoE router and the rope tables stay float32 (routing is sensitive)."""
    for name, p in model.named_parameters():
        if ".mlp.gate." not in name:
            p.data = p.data.to(dtype)
    return model


def _use_mtp_copy(model: DeepseekV3ForCausalLM, name: str, t: torch.Tensor) -> None:
    """An MTP layer's own embed/head (this rank's rows): kept shared when equal to the main model's, else its
    own module."""
    layer = model.mtp_layers[int(name.split(".")[1])]
    if name.endswith("embed_tokens.weight"):
        if not torch.equal(layer.embed_tokens.weight, t):
            with torch.device("meta"):
                own = VocabParallelEmbedding(model.config.vocab_size, t.shape[1], model.tp)
            _set_param(own, "weight", t)
            layer.embed_tokens = own
    elif not torch.equal(layer.shared_head.head.weight, t):
        head = torch.nn.Linear(t.shape[1], t.shape[0], bias=False, device="meta")
        _set_param(head, "weight", t)
        layer.shared_head.head = head


def load_tokenizer(path: str):
    """The checkpoint's tokenizer (transformers), or None when it ships none."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) and not os.path.isfile(
            os.path.join(path, "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
