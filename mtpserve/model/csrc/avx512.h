// What the CPU kernels share: the target they are compiled for, the linear kernels' block, tile and thread share, a
// weight prefetch, masked loads (bf16 as fp32), a four-way sum, the bf16 linear.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace {

// weights the kernels read next, prefetched into L2 (T1), not L1 (T0): from DRAM, more of them in flight
// (docs/history.md)
inline void prefetch_weights(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

constexpr int64_t kLanes = 32;   // bf16 values in a 512-bit register
constexpr int64_t kBlock = 8;    // weight rows the linear kernels read together
constexpr int64_t kAheadBlocks = 2;   // blocks ahead that the bf16 kernel prefetches (docs/history.md)
constexpr int64_t kTile = 3;     // rows of x they multiply together (3 x 8 sums in registers)
constexpr int64_t kShareBytes = 32 << 10;   // the weight bytes a thread reads at least (fewer: one thread)

// the grain of a linear kernel's parallel_for over units of weight (unit_bytes each, read once per tile of rows of
// x): each thread reads at least `share` bytes
inline int64_t share_grain(int64_t unit_bytes, int64_t tiles, int64_t share = kShareBytes) {
  const int64_t units = share / (unit_bytes * tiles);
  return units > 1 ? units : 1;
}

// p[0..31] as bf16, zeros past `left` values
AVX512_BF16 inline __m512bh load32(const uint16_t* p, int64_t left) {
  if (left >= kLanes) return (__m512bh)_mm512_loadu_si512(p);
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << left) - 1), p);
}

// bf16 p[0..15] as fp32, zeros past `left` values (none when left <= 0)
AVX512_BF16 inline __m512 load16_as_float(const uint16_t* p, int64_t left) {
  __m256i v = left >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                         : _mm256_maskz_loadu_epi16((__mmask16)((1u << std::max<int64_t>(left, 0)) - 1), p);
  return _mm512_cvtpbh_ps((__m256bh)v);
}

// {sum a, sum b, sum c, sum d}: per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3] and the same of c, d, then
// [a, b, c, d], then the four lanes added
AVX512_BF16 inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512d ab = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)));
  __m512d cd = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d)));
  __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
  __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

}  // namespace

// y [M, N] (contiguous, written) = x [M, K] (contiguous) @ w.T in bf16, w [N, K] by rows w_stride apart (from
// pointers: no tensor made per call)
void bf16_rows_into(const at::BFloat16* x, const at::BFloat16* w, int64_t w_stride, at::BFloat16* y, int64_t M,
                    int64_t N, int64_t K);

// y [M, N] (contiguous, written) = bf16 x [M, K] (contiguous) @ (int8 w [N, K] * scale [N]).T, w by rows w_stride
// apart, scales scale_stride apart (from pointers)
void int8_rows_into(const at::BFloat16* x, const int8_t* w, int64_t w_stride, const at::BFloat16* scale,
                    int64_t scale_stride, at::BFloat16* y, int64_t M, int64_t N, int64_t K);

// y [M, N] (contiguous, written) = fp32 x [M, K] @ wt [K, N]: fp32_columns_linear into a given tensor
void fp32_columns_linear_into(const at::Tensor& x, const at::Tensor& wt, at::Tensor& y);

// An op's C function for inductor's C++ wrapper (declared to it from the op's schema: cpu_kernels.declare_c_shims):
// a graph calls aoti_torch_cpu_<op>(inputs..., &output) directly instead of through the dispatcher. Tensor
// arguments come as handles, Tensor? ones as a pointer to a handle or null.
#define C_SHIM(op, params, ...)                                                                      \
  extern "C" AOTITorchError aoti_torch_cpu_##op params {                                            \
    AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({ *ret0 = torch::aot_inductor::new_tensor_handle(__VA_ARGS__); }) \
  }

using Handle = AtenTensorHandle;

inline const at::Tensor& tensor_at(Handle h) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h);
}
