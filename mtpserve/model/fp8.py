"""FP8 weights kept in memory (`quantization="fp8"`): float8_e4m3fn values with block scales, dequantized at
matmul time, so linear weights take half the bytes of bf16.

DeepSeek-V3 checkpoints scale each 128x128 tile (`weight_scale_inv`). In memory a weight keeps one scale per row
and column block ([out, ceil(in / block)]: the tile scales repeated down the rows, 1/32 of the fp8 bytes), so
tensor-parallel row slices, fused projections (rows concatenated) and stacked experts stay plain tensor
operations. Dequantizing computes what the loader computes for a dequantized load (fp8 value x scale in float32,
then the activation dtype), so the output is identical to the dequantized model's.
"""
import math
from dataclasses import dataclass

import torch

from mtpserve.model.int8 import Int8Weight, int8_linear

# Linear weights kept in FP8. kv_b_proj is dequantized at load: it only feeds the absorbed attention weights,
# built once (fuse). Embedding, output heads and router are not FP8 in DeepSeek's checkpoints either.
FP8_MODULES = {"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj",
               "down_proj", "eh_proj"}


@dataclass
class Fp8Weight:
    data: torch.Tensor    # float8_e4m3fn [..., out, in]
    scale: torch.Tensor   # float32 [..., out, ceil(in / block)]
    block: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index) -> "Fp8Weight":
        """Indexing any dimension but the last (an expert of stacked weights, rows)."""
        return Fp8Weight(self.data[index], self.scale[index], self.block)

    def select(self, dim: int, index) -> "Fp8Weight":
        return Fp8Weight(self.data.select(dim, index), self.scale.select(dim, index), self.block)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        columns = self.scale.repeat_interleave(self.block, dim=-1)[..., :self.data.shape[-1]]
        return (self.data.float() * columns).to(dtype)


def keeps_fp8(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] == "weight" and len(parts) > 1 and parts[-2] in FP8_MODULES


def from_tiles(data: torch.Tensor, scale_inv: torch.Tensor, start: tuple[int, int],
               block: tuple[int, int]) -> Fp8Weight:
    """An FP8 weight (or this rank's slice of it, starting at row, column `start`) with the whole tensor's tile
    scales -> an Fp8Weight. A slice that starts inside a column tile keeps finer column blocks, each inside one
    tile: 128-column tiles, a slice from column 48 -> blocks of gcd(128, 48) = 16 columns."""
    fine = math.gcd(block[1], start[1])
    rows = (torch.arange(data.shape[0]) + start[0]) // block[0]
    columns = (torch.arange(0, data.shape[1], fine) + start[1]) // block[1]
    return Fp8Weight(data, scale_inv.float()[rows][:, columns].contiguous(), fine)


def quantize_rows(w: torch.Tensor, block: int = 128) -> Fp8Weight:
    """Online FP8 of an unquantized weight (`quantization="fp8"` on a bf16/fp32 checkpoint): one scale per
    row and column block."""
    out_dim, in_dim = w.shape
    blocks = -(-in_dim // block)
    padded = torch.zeros(out_dim, blocks * block, dtype=torch.float32)
    padded[:, :in_dim] = w.float()
    tiles = padded.view(out_dim, blocks, block)
    scale = tiles.abs().amax(-1).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    data = (tiles / scale.unsqueeze(-1)).view(out_dim, -1)[:, :in_dim].to(torch.float8_e4m3fn)
    return Fp8Weight(data.contiguous(), scale, block)


def weight_of(linear: torch.nn.Linear):
    """The weight to multiply by: the module's tensor, an Fp8Weight when it is kept in FP8 or an Int8Weight when
    in int8 (model/int8.py)."""
    if getattr(linear, "int8_scale", None) is not None:
        return Int8Weight(linear.weight, linear.int8_scale)
    scale = getattr(linear, "weight_scale", None)
    return linear.weight if scale is None else Fp8Weight(linear.weight, scale, linear.weight_block)


def apply_linear(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x), dequantizing an FP8 weight for this product only."""
    w = weight_of(linear)
    if isinstance(w, Int8Weight):
        return int8_linear(x, w, linear.bias)
    return torch.nn.functional.linear(x, w.dequantize(x.dtype) if isinstance(w, Fp8Weight) else w, linear.bias)


def set_fp8(linear: torch.nn.Linear, w: Fp8Weight) -> None:
    linear.weight = torch.nn.Parameter(w.data, requires_grad=False)
    linear.weight_scale, linear.weight_block = w.scale, w.block
