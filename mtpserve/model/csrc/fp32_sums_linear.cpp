// Products summed in fp32 FMAs, for any number of rows:
//   int8_linear: bf16 x [M, K] times an int8 weight stored by rows [N, K] with one scale per row [N] -> bf16 [M, N]
//     (weight-only int8, model/int8.py). x and the weight are widened to fp32 16 values at a time; each sum is
//     scaled and rounded once:
//     w[n] = [50 -127 2], s[n] = 0.01, x[m] = [1 1 1]  ->  y[m, n] = bf16(0.01 * (50 - 127 + 2)) = -0.75
//   fp32_linear: fp32 x [M, K] times an fp32 weight [N, K] -> fp32 [M, N] (the MoE router's logits).
// Eight weight rows at a time, read once from memory for all M rows (as bf16_linear.cpp), each 16 values widened
// once for up to three rows of x. An output depends on its own row of x only: a row gives the same bits alone or in
// any batch.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>

#include "avx512.h"

namespace {

constexpr int64_t kFloats = 16;  // fp32 values in a 512-bit register

AVX512_BF16 inline __m512 widen16(const int8_t* p, int64_t left) {   // p[0..15] as fp32, zeros past `left`
  __m128i v = left >= kFloats ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                              : _mm_maskz_loadu_epi8((__mmask16)((1u << left) - 1), p);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

AVX512_BF16 inline __m512 widen16(const float* p, int64_t left) {   // p[0..15], zeros past `left`
  return left >= kFloats ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << left) - 1), p);
}

AVX512_BF16 inline __m512 widen16(const uint16_t* p, int64_t left) {   // bf16 p[0..15] as fp32, zeros past `left`
  __m256i v = left >= kFloats ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                              : _mm256_maskz_loadu_epi16((__mmask16)((1u << left) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// y[m, n..n+R-1] = x[m] . w[n..n+R-1] for T rows m of x at once: each 16 weights widened once for the T rows
template <int64_t R, int64_t T, typename X, typename W, typename O>
AVX512_BF16 void tile_times(const X* x, int64_t x_stride, const W* block, int64_t w_stride,
                            const at::BFloat16* scale, int64_t scale_stride, O* y, int64_t N, int64_t K,
                            bool prefetch) {
  __m512 acc[T][R], xv[T];
  for (int64_t t = 0; t < T; t++)
    for (int64_t r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kFloats <= K; k += kFloats) {
    for (int64_t t = 0; t < T; t++) xv[t] = widen16(x + t * x_stride + k, kFloats);
    // (the next block prefetched a cache line at a time)
    const bool new_line = prefetch && k % (64 / int64_t(sizeof(W))) == 0;
    for (int64_t r = 0; r < R; r++) {
      if (new_line) prefetch_weights(block + (R + r) * w_stride + k);
      __m512 wv = widen16(block + r * w_stride + k, kFloats);
      for (int64_t t = 0; t < T; t++) acc[t][r] = _mm512_fmadd_ps(wv, xv[t], acc[t][r]);
    }
  }
  if (k < K) {   // the last K % 16 values
    for (int64_t t = 0; t < T; t++) xv[t] = widen16(x + t * x_stride + k, K - k);
    for (int64_t r = 0; r < R; r++) {
      __m512 wv = widen16(block + r * w_stride + k, K - k);
      for (int64_t t = 0; t < T; t++) acc[t][r] = _mm512_fmadd_ps(wv, xv[t], acc[t][r]);
    }
  }
  for (int64_t t = 0; t < T; t++)
    for (int64_t r = 0; r < R; r++)
      y[t * N + r] = O(scale ? _mm512_reduce_add_ps(acc[t][r]) * float(scale[r * scale_stride])
                             : _mm512_reduce_add_ps(acc[t][r]));
}

// R weight rows times every row of x, up to kTile rows of x at a time (the block in L1 after the first tile)
template <int64_t R, typename X, typename W, typename O>
AVX512_BF16 void block_times(const X* x, int64_t x_stride, const W* block, int64_t w_stride,
                             const at::BFloat16* scale, int64_t scale_stride, O* y, int64_t M, int64_t N, int64_t K) {
  for (int64_t m = 0; m < M; m += kTile) {
    const X* xm = x + m * x_stride;
    O* ym = y + m * N;
    switch (std::min(kTile, M - m)) {
      case 1: tile_times<R, 1>(xm, x_stride, block, w_stride, scale, scale_stride, ym, N, K, m == 0); break;
      case 2: tile_times<R, 2>(xm, x_stride, block, w_stride, scale, scale_stride, ym, N, K, m == 0); break;
      default: tile_times<R, kTile>(xm, x_stride, block, w_stride, scale, scale_stride, ym, N, K, m == 0);
    }
  }
}

constexpr int64_t kSumsShareBytes = 64 << 10;   // these kernels' thread share (int8: docs/history.md)

// y = x @ (w * scale).T for weight rows 0..N-1 (scale null: 1), torch's threads splitting the weight by blocks, each
// thread's share at least kSumsShareBytes read per tile of rows (one thread below that)
template <typename X, typename W, typename O>
void rows_times(const X* x, int64_t x_stride, const W* w, int64_t w_stride, const at::BFloat16* scale,
                int64_t scale_stride, O* y, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = (N + kBlock - 1) / kBlock, tiles = (M + kTile - 1) / kTile;
  const int64_t grain = share_grain(kBlock * K * int64_t(sizeof(W)), tiles, kSumsShareBytes);
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    int64_t n = first * kBlock;
    const int64_t end = std::min(N, last * kBlock);
    for (; n + kBlock <= end; n += kBlock)
      block_times<kBlock>(x, x_stride, w + n * w_stride, w_stride, scale ? scale + n * scale_stride : nullptr,
                          scale_stride, y + n, M, N, K);
    for (; n < end; n++)   // the last rows, fewer than a block
      block_times<1>(x, x_stride, w + n * w_stride, w_stride, scale ? scale + n * scale_stride : nullptr,
                     scale_stride, y + n, M, N, K);
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "int8_linear: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kChar &&
              scale.scalar_type() == at::kBFloat16, "int8_linear: bf16 x and scales, int8 weight");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == weight.size(0), "int8_linear: one scale per weight row");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1, "int8_linear: rows must be contiguous");
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  rows_times(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), weight.data_ptr<int8_t>(), weight.stride(0),
             scale.data_ptr<at::BFloat16>(), scale.stride(0), y.data_ptr<at::BFloat16>(), x.size(0), weight.size(0),
             x.size(1));
  return y;
}

at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "fp32_linear: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "fp32_linear: fp32 only");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1, "fp32_linear: rows must be contiguous");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  rows_times(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), weight.stride(0), nullptr, 0,
             y.data_ptr<float>(), M, N, K);
  return y;
}

}  // namespace

void int8_rows_into(const at::BFloat16* x, const int8_t* w, int64_t w_stride, const at::BFloat16* scale,
                    int64_t scale_stride, at::BFloat16* y, int64_t M, int64_t N, int64_t K) {
  rows_times(reinterpret_cast<const uint16_t*>(x), K, w, w_stride, scale, scale_stride, y, M, N, K);
}

TORCH_LIBRARY_FRAGMENT(mtpserve_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("fp32_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpserve_cpu, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("fp32_linear", &fp32_linear);
}
