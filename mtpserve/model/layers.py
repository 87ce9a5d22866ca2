"""Small building blocks: RMSNorm, DeepSeek rotary embedding (with YaRN), the gated MLP."""
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from mtpserve.config import ModelConfig
from mtpserve.model import cpu_kernels
from mtpserve.model.fp8 import Fp8Weight, weight_of
from mtpserve.model.int8 import Int8Weight, int8_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalized in fp32, cast back, then scaled (DeepSeek's order); one fused op when x is fp32 already
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None   # set by fuse(): one GEMM instead of two

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return linear(silu_and_mul(linear(x, self.gate_up)), weight_of(self.down_proj))

    @torch.no_grad()
    def fuse(self) -> None:
        """Inference only: gate and up weights become two views of one [2I, H] tensor."""
        self.gate_up = share_storage([self.gate_proj, self.up_proj])


# Up to this many rows (a decode or verify step at small batch), a CPU graph without our kernels multiplies by a
# row-major weight with one reduction per row.
FEW_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except on the CPU where our kernels are loaded (model/cpu_kernels.py: a row's bits its own at any
    number of rows, so a verify step's rows get a plain step's bits): bf16 products, int8 ones (model/int8.py), and
    the products of 1-8 rows by an fp32 weight, which is stored by columns (`by_columns`; more rows: F.linear reads
    it as it lies). Without the kernels, a bf16 graph of 1-8 rows runs one reduction per row, which inductor fuses
    into one kernel that reads the weight once."""
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, bias)
    if isinstance(weight, Fp8Weight):   # FP8 in memory: dequantized for this product only
        weight = weight.dequantize(x.dtype)
    on_cpu = x.dim() == 2 and x.device.type == "cpu"
    by_rows = on_cpu and weight.stride(-1) == 1
    rows = x.shape[0]
    if by_rows and cpu_kernels.usable(x, weight):
        out = cpu_kernels.bf16_linear(x, weight)
    elif on_cpu and weight.stride(-2) == 1 and statically_known_true(rows <= FEW_ROWS) \
            and cpu_kernels.usable(x, weight, dtype=torch.float32):
        out = cpu_kernels.fp32_columns_linear(x, weight.t())
    # (statically_known_true: a graph with a dynamic batch is never unrolled over its rows)
    elif by_rows and torch.compiler.is_compiling() and statically_known_true(0 < rows) \
            and statically_known_true(rows <= FEW_ROWS):
        out = torch.stack([(weight * x[r]).sum(-1) for r in range(rows)])
    else:
        return F.linear(x, weight, bias)
    return out if bias is None else out + bias


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


BY_COLUMNS = True   # (False: weights stay row by row, as in the checkpoint: scripts/ab_weight_layout.py's A)


def by_columns(w: torch.Tensor) -> torch.Tensor:
    """w [..., out, in], the same values stored column by column on the CPU in fp32: W = [[a, b], [c, d], [e, f]]
    lies as a c e b d f, so x @ W.T multiplies by W.T as a plain [in, out] matrix, which MKL runs faster than a
    transposed one from a few rows up (docs/history.md). Other devices and dtypes: w as it is."""
    if not BY_COLUMNS or w.device.type != "cpu" or w.dtype != torch.float32:
        return w
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)


def share_storage(linears: list[nn.Linear], dim: int = 0) -> torch.Tensor | Fp8Weight | Int8Weight:
    """Concatenates the linears' weights along `dim` and makes each weight a view of the result (the state
    dict keeps its names and no memory is duplicated). For inference: the views are not trained. FP8 and int8
    weights (all or none of them) are concatenated with their scales."""
    fused = by_columns(torch.cat([m.weight.detach() for m in linears], dim=dim))   # (FP8, int8: as they are)
    scale_name = next((n for n in ("weight_scale", "int8_scale") if getattr(linears[0], n, None) is not None), None)
    scales = torch.cat([getattr(m, scale_name) for m in linears], dim=dim) if scale_name else None
    start = 0
    for m in linears:
        size = m.weight.shape[dim]
        m.weight = nn.Parameter(fused.narrow(dim, start, size), requires_grad=False)
        if scale_name:
            setattr(m, scale_name, scales.narrow(dim, start, size))
        start += size
    if scale_name == "int8_scale":
        return Int8Weight(fused, scales)
    return Fp8Weight(fused, scales, linears[0].weight_block) if scale_name else fused


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(cfg: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    rs = cfg.rope_scaling
    base, factor = cfg.rope_theta, rs["factor"]
    original_max = rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    interpolation = extrapolation / factor
    inv_freq = interpolation * ramp + extrapolation * (1 - ramp)
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        cos_sin_scale = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        cos_sin_scale = yarn_mscale(factor)
    return inv_freq, cos_sin_scale


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(d), times YaRN's mscale(factor, mscale_all_dim)^2 when rope scaling is on."""
    scale = cfg.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.get("mscale_all_dim"):
        scale *= yarn_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
    return scale


class RotaryEmbedding(nn.Module):
    """Rotates DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... of the rope part of q and k.

    The output is laid out de-interleaved ([rotated evens, rotated odds]) — the same permutation for q
    and k, so dot products are those of the interleaved rotation (as in DeepSeek's reference code).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self._last_positions, self._last_cos, self._last_sin = None, None, None
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)computes the cos/sin tables, e.g. after the model was built on the meta device."""
        cfg, dim = self.cfg, self.cfg.qk_rope_head_dim
        if cfg.rope_scaling is not None and cfg.rope_scaling.get("type", cfg.rope_scaling.get("rope_type")) == "yarn":
            inv_freq, scale = _yarn_inv_freq(cfg, dim)
        else:
            inv_freq, scale = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim), 1.0
        device = self.cos.device
        # spare rows: draft passes may write a few slots past max_position_embeddings (never read)
        angles = torch.outer(torch.arange(cfg.max_position_embeddings + 64, dtype=torch.float32, device=device),
                             inv_freq.to(device))
        self.cos, self.sin = angles.cos() * scale, angles.sin() * scale

    def _angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():  # graphs reuse static position buffers: never cache there
            return self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        if positions is not self._last_positions or dtype != self._last_cos.dtype:
            # every layer rotates the same positions tensor: look the angles up once per forward
            self._last_positions = positions
            self._last_cos, self._last_sin = self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        return self._last_cos, self._last_sin

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [..., tokens, (heads,) dim] where positions matches the tokens axis; heads optional."""
        cos, sin = self._angles(positions, x.dtype)
        if x.dim() == positions.dim() + 2:  # has a heads axis
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        if self.cfg.rope_interleave:
            first, second = x[..., 0::2], x[..., 1::2]
        else:  # the halves form the pairs (rotate_half layout)
            first, second = x.chunk(2, dim=-1)
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
