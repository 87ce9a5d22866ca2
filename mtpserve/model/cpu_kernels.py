"""CPU kernels of our own, built from csrc/ with torch's C++ extension builder the first time a process needs one
(cached under torch's extension directory, ~20 s once) and registered as torch ops, so eager steps and inductor's
graphs call the same code (graphs through each op's C function: inductor_config); loading them also makes
csrc/cpu_allocator.cpp the process's CPU allocator. Where a kernel cannot run (no AVX512-BF16, no compiler) callers
keep PyTorch's ops (and allocator)."""
import ctypes
import hashlib
import logging
import os

import torch
import torch._inductor.config

logger = logging.getLogger("mtpserve")


LOADED = False   # the mtpserve_cpu ops are loaded (load); read by usable
SOURCES = ("bf16_linear.cpp", "int8_linear.cpp", "fp32_sums_linear.cpp", "fp32_columns_linear.cpp",
           "latent_attention.cpp", "routed_experts.cpp", "cpu_allocator.cpp", "avx512.h")


def sources_digest() -> str:
    """A digest of csrc/: compiled graphs call the kernels by their schemas, so one cached before a kernel changed
    must not be reused (ops.register_graph_lowerings puts it in inductor's cache key)."""
    digest = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(os.path.dirname(__file__), "csrc", name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


C_TYPES = {"Tensor": "AtenTensorHandle", "Optional[Tensor]": "AtenTensorHandle*", "int": "int64_t", "float": "double"}
C_SHIMS = {}   # op -> the declaration of its C function (csrc: C_SHIM), for inductor (set by load)


def declare_c_shims(path: str) -> None:
    """The library's symbols made global (a graph's module resolves the C functions as it loads) and each op's C
    function declared from its schema: bf16_linear(Tensor x, Tensor weight) -> Tensor is
    aoti_torch_cpu_bf16_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* ret0)."""
    ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    for schema in torch._C._jit_get_all_schemas():
        namespace, _, name = schema.name.partition("::")
        if (namespace == "mtpserve_cpu" and [str(r.type) for r in schema.returns] == ["Tensor"]
                and all(str(a.type) in C_TYPES for a in schema.arguments)):
            params = [f"{C_TYPES[str(a.type)]} {a.name}" for a in schema.arguments] + ["AtenTensorHandle* ret0"]
            C_SHIMS[getattr(torch.ops.mtpserve_cpu, name).default] = [
                f"AOTITorchError aoti_torch_cpu_{name}({', '.join(params)})"]


def inductor_config() -> dict:
    """What CPU graphs compile with (runner/graphs.py): inductor's C++ calls each op through its C function, not the
    dispatcher. The declarations (op objects) stay out of inductor's cache key, which cannot hold them (it would
    bypass the cache): the kernels' digest is in the key (ops.register_graph_lowerings)."""
    if not C_SHIMS:
        return {}
    ignored = torch._inductor.config._cache_config_ignore_prefix
    return {"aot_inductor.custom_ops_to_c_shims": C_SHIMS,
            "_cache_config_ignore_prefix": ignored + ["aot_inductor.custom_ops_to_c_shims"]}


def load() -> bool:
    """Loads the mtpserve_cpu ops (built the first time) -> LOADED; False on a CPU without AVX512-BF16 and VNNI
    or if the build fails."""
    global LOADED
    if LOADED or not (torch.cpu._is_avx512_bf16_supported() and torch.cpu._is_vnni_supported()):
        return LOADED
    try:
        from torch.utils.cpp_extension import load as build
        sources = [os.path.join(os.path.dirname(__file__), "csrc", name) for name in SOURCES if name.endswith(".cpp")]
        path = build("mtpserve_cpu_kernels", sources, extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                     is_python_module=False, verbose=False)   # (OpenMP: at::parallel_for runs on torch's threads)
    except Exception as e:   # (a machine without a C++ compiler or ninja: PyTorch's ops instead)
        logger.warning("the bf16 CPU kernels did not build (%s: %s); PyTorch's ops instead", type(e).__name__, e)
        return False
    torch.library.register_fake("mtpserve_cpu::bf16_linear")(
        lambda x, weight: x.new_empty(x.shape[0], weight.shape[0]))
    torch.library.register_fake("mtpserve_cpu::bf16_bmm")(
        lambda x, weight: x.new_empty(x.shape[0], x.shape[1], weight.shape[1]))
    torch.library.register_fake("mtpserve_cpu::int8_linear")(
        lambda x, weight, scale: x.new_empty(x.shape[0], weight.shape[0]))
    torch.library.register_fake("mtpserve_cpu::fp32_linear")(
        lambda x, weight: x.new_empty(x.shape[0], weight.shape[0]))
    torch.library.register_fake("mtpserve_cpu::fp32_columns_linear")(
        lambda x, wt: x.new_empty(x.shape[0], wt.shape[1]))
    torch.library.register_fake("mtpserve_cpu::latent_attention")(
        lambda q, keys, mask, scale, value_dim, block_tables=None: q.new_empty(q.shape[0], q.shape[1], value_dim))
    for name in ("routed_experts", "routed_int8_experts"):
        torch.library.register_fake(f"mtpserve_cpu::{name}")(lambda x, *args: torch.empty_like(x))
    torch.ops.mtpserve_cpu.keep_freed_cpu_memory()
    declare_c_shims(path)
    LOADED = True
    return True


def usable(*tensors: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> bool:
    """The kernels are loaded and can take these: all plain tensors (not FP8 or int8 weights) on the CPU, all of
    `dtype`, none to be differentiated (the kernels have no backward)."""
    grad = torch.is_grad_enabled()
    return LOADED and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == dtype
                          and not (grad and t.requires_grad) for t in tensors)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T in bf16 (fp32 sums, rounded once): csrc/bf16_linear.cpp."""
    return torch.ops.mtpserve_cpu.bf16_linear(x if x.stride(-1) == 1 else x.contiguous(), weight)


def bf16_bmm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, M, K] @ weight [B, N, K].transpose(1, 2) in bf16, each x[b] by weight[b] as bf16_linear."""
    return torch.ops.mtpserve_cpu.bf16_bmm(x if x.stride(-1) == 1 else x.contiguous(), weight)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 x [M, K] @ (int8 weight [N, K] * scale [N, 1]).T (a row of x as 16-bit integers at a power of two,
    integer sums, scaled and rounded once): csrc/int8_linear.cpp."""
    return torch.ops.mtpserve_cpu.int8_linear(x if x.stride(-1) == 1 else x.contiguous(), weight, scale)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x [M, K] @ weight [N, K].T, each output one fp32 FMA sum: csrc/fp32_sums_linear.cpp."""
    return torch.ops.mtpserve_cpu.fp32_linear(x if x.stride(-1) == 1 else x.contiguous(), weight)


def fp32_columns_linear(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """fp32 x [M, K] @ wt [K, N] (a weight stored by columns, transposed), each output its K products summed in
    order: csrc/fp32_columns_linear.cpp."""
    return torch.ops.mtpserve_cpu.fp32_columns_linear(x if x.stride(-1) == 1 else x.contiguous(), wt)


def latent_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float, value_dim: int,
                     block_tables: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's absorbed attention in bf16: q [B, R, D] over keys [B, L, D] with mask [B, Q, L] (row i: mask row
    i % Q) -> [B, R, value_dim], the values being keys[..., :value_dim]. With block_tables [B, n], keys is the
    paged cache [blocks, block_size, D] that they index, read in place: csrc/latent_attention.cpp."""
    return torch.ops.mtpserve_cpu.latent_attention(q, keys, mask, scale, value_dim, block_tables)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13, w2, few_rows: int) -> torch.Tensor:
    """A MoE layer's routed experts, x [T, H] with weights and ids [T, k], w13 [E, 2I, H], w2 [H, E, I]: each expert
    once on the tokens that chose it, as model/moe.py's `_grouped`, bit for bit: csrc/routed_experts.cpp. bf16 x
    with bf16 experts or int8 ones (model/int8.py), or all fp32, multiplied as layers.linear multiplies (fp32
    weights stored by columns: our column kernel up to few_rows rows, ATen's linear above)."""
    if isinstance(w13, torch.Tensor):
        return torch.ops.mtpserve_cpu.routed_experts(x, weights, ids, w13, w2, few_rows)
    return torch.ops.mtpserve_cpu.routed_int8_experts(x, weights, ids, w13.data, w13.scale, w2.data, w2.scale)


def experts_usable(x: torch.Tensor, weights: torch.Tensor, w13, w2) -> bool:
    """routed_experts can take these: on the CPU, bf16 x and routing weights with bf16 experts or int8 ones (their
    scales bf16), or all fp32."""
    if x.dtype == torch.float32:
        return usable(x, weights, w13, w2, dtype=torch.float32)

    def bf16_parts(w):
        return (w,) if isinstance(w, torch.Tensor) else (w.scale,) if w.data.dtype == torch.int8 else (None,)
    return usable(x, weights, *bf16_parts(w13), *bf16_parts(w2))
