"""CPU kernels of our own, built from csrc/ with torch's C++ extension builder the first time a process needs one
(cached under torch's extension directory, ~20 s once) and registered as torch ops, so eager steps and inductor's
graphs call the same code. Where a kernel cannot run (no AVX512-BF16, no compiler) callers keep PyTorch's ops."""
import logging
import os

import torch

logger = logging.getLogger("mtpserve")


BF16_LINEAR = False   # mtpserve_cpu::bf16_linear is loaded (load_bf16_linear); read by layers.linear


def load_bf16_linear() -> bool:
    """Loads mtpserve_cpu::bf16_linear (built the first time) -> BF16_LINEAR; False on a CPU without AVX512-BF16
    or if the build fails."""
    global BF16_LINEAR
    if BF16_LINEAR or not torch.cpu._is_avx512_bf16_supported():
        return BF16_LINEAR
    try:
        from torch.utils.cpp_extension import load
        source = os.path.join(os.path.dirname(__file__), "csrc", "bf16_linear.cpp")
        load("mtpserve_cpu_kernels", [source], extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)   # (OpenMP: at::parallel_for runs on torch's threads)
    except Exception as e:   # (a machine without a C++ compiler or ninja: PyTorch's bf16 matmuls instead)
        logger.warning("the bf16 CPU kernel did not build (%s: %s); bf16 linears use PyTorch's", type(e).__name__, e)
        return False
    torch.library.register_fake("mtpserve_cpu::bf16_linear")(
        lambda x, weight: x.new_empty(x.shape[0], weight.shape[0]))
    BF16_LINEAR = True
    return True


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T in bf16 (fp32 sums, rounded once): csrc/bf16_linear.cpp."""
    return torch.ops.mtpserve_cpu.bf16_linear(x if x.stride(-1) == 1 else x.contiguous(), weight)
