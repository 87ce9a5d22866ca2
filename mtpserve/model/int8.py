"""Weight-only int8 on the CPU (`quantization="int8"`): linear and expert weights stored as int8 with one scale
per output channel, multiplied by PyTorch's int8 weight-only kernel (torch.ops.aten._weight_int8pack_mm, the
kernel gpt-fast's int8 mode uses), which reads the int8 weight and scales each output column; with bf16
activations on a CPU where our kernels load, by ours (model/csrc/int8_linear.cpp: each row of x as 16-bit integers
at a power of two, integer sums), at any number of rows.

Quantized as the checkpoint loads (from bf16/fp32 weights; an FP8 checkpoint's weights are dequantized first):
row r of W [out, in] becomes round(W[r] / s[r]) in [-127, 127], s[r] = max|W[r]| / 127. Row 0 = [0.5, -1.27, 0.02]:
s = 0.01, int8 [50, -127, 2]. Not lossless with respect to the bf16 model (the error is measured in the docs);
speculative decoding stays lossless with respect to the int8 model. The same modules as FP8 (model/fp8.py); the
embedding, the LM head, the router and the attention's absorbed kv_b weights stay in the activation dtype.
Activations are bf16 or fp16: the kernel has no fast fp32 path on the CPU.
"""
from dataclasses import dataclass

import torch

from mtpserve.model import cpu_kernels


@dataclass
class Int8Weight:
    data: torch.Tensor    # int8 [..., out, in]
    scale: torch.Tensor   # [..., out], the activation dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index) -> "Int8Weight":
        """Indexing any dimension but the last (an expert of stacked weights, rows)."""
        return Int8Weight(self.data[index], self.scale[index])

    def select(self, dim: int, index) -> "Int8Weight":
        return Int8Weight(self.data.select(dim, index), self.scale.select(dim, index))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.data.float() * self.scale.float().unsqueeze(-1)).to(dtype)


def quantize_rows(w: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """W [out, in] -> int8 with one scale per row (in `dtype`, the activations')."""
    scale = (w.float().abs().amax(-1) / 127).clamp_min(1e-12).to(dtype)
    data = torch.round(w.float() / scale.float().unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return Int8Weight(data.contiguous(), scale)


def set_int8(linear: torch.nn.Linear, w: Int8Weight) -> None:
    linear.weight = torch.nn.Parameter(w.data, requires_grad=False)
    linear.int8_scale = w.scale


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W.T with W in int8: [..., out]."""
    flat = x.reshape(-1, x.shape[-1])
    if cpu_kernels.usable(flat, w.scale):
        out = cpu_kernels.int8_linear(flat, w.data, w.scale)
    else:   # (ATen's kernel reads the scales as contiguous, whatever their strides)
        out = torch.ops.aten._weight_int8pack_mm(flat.contiguous(), w.data, w.scale.contiguous())
    out = out.view(*x.shape[:-1], -1)
    return out if bias is None else out + bias
