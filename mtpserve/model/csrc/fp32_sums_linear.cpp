// fp32_linear: fp32 x [M, K] times an fp32 weight stored by rows [N, K] -> fp32 [M, N] (the MoE router's logits),
// each output one sum of fp32 FMAs in 16 lanes. Eight weight rows at a time, read once from memory for all M rows (as
// bf16_linear.cpp), each 16 weights loaded once for up to three rows of x. An output depends on its own row of x only:
// a row gives the same bits alone or in any batch.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>

#include "avx512.h"

namespace {

constexpr int64_t kFloats = 16;  // fp32 values in a 512-bit register

AVX512_BF16 inline __m512 load16(const float* p, int64_t left) {   // p[0..15], zeros past `left`
  return left >= kFloats ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << left) - 1), p);
}

// y[m, n..n+R-1] = x[m] . w[n..n+R-1] for T rows m of x at once: each 16 weights loaded once for the T rows
template <int64_t R, int64_t T>
AVX512_BF16 void tile_times(const float* x, int64_t x_stride, const float* block, int64_t w_stride, float* y,
                            int64_t N, int64_t K, bool prefetch) {
  __m512 acc[T][R], xv[T];
  for (int64_t t = 0; t < T; t++)
    for (int64_t r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kFloats) {
    for (int64_t t = 0; t < T; t++) xv[t] = load16(x + t * x_stride + k, K - k);
    for (int64_t r = 0; r < R; r++) {
      if (prefetch) prefetch_weights(block + (R + r) * w_stride + k);   // (the next block, a line at a time)
      const __m512 wv = load16(block + r * w_stride + k, K - k);
      for (int64_t t = 0; t < T; t++) acc[t][r] = _mm512_fmadd_ps(wv, xv[t], acc[t][r]);
    }
  }
  for (int64_t t = 0; t < T; t++)
    for (int64_t r = 0; r < R; r++) y[t * N + r] = _mm512_reduce_add_ps(acc[t][r]);
}

// R weight rows times every row of x, up to kTile rows of x at a time (the block in L1 after the first tile)
template <int64_t R>
AVX512_BF16 void block_times(const float* x, int64_t x_stride, const float* block, int64_t w_stride, float* y,
                             int64_t M, int64_t N, int64_t K) {
  for (int64_t m = 0; m < M; m += kTile) {
    const float* xm = x + m * x_stride;
    float* ym = y + m * N;
    switch (std::min(kTile, M - m)) {
      case 1: tile_times<R, 1>(xm, x_stride, block, w_stride, ym, N, K, m == 0); break;
      case 2: tile_times<R, 2>(xm, x_stride, block, w_stride, ym, N, K, m == 0); break;
      default: tile_times<R, kTile>(xm, x_stride, block, w_stride, ym, N, K, m == 0);
    }
  }
}

at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "fp32_linear: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "fp32_linear: fp32 only");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1, "fp32_linear: rows must be contiguous");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1), w_stride = weight.stride(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + kBlock - 1) / kBlock, tiles = (M + kTile - 1) / kTile;
  at::parallel_for(0, blocks, share_grain(kBlock * K * 4, tiles), [&](int64_t first, int64_t last) {
    int64_t n = first * kBlock;
    const int64_t end = std::min(N, last * kBlock);
    for (; n + kBlock <= end; n += kBlock)
      block_times<kBlock>(xp, x.stride(0), wp + n * w_stride, w_stride, yp + n, M, N, K);
    for (; n < end; n++)   // the last rows, fewer than a block
      block_times<1>(xp, x.stride(0), wp + n * w_stride, w_stride, yp + n, M, N, K);
  });
  return y;
}

}  // namespace

C_SHIM(fp32_linear, (Handle x, Handle weight, Handle* ret0),
       fp32_linear(tensor_at(x), tensor_at(weight)))

TORCH_LIBRARY_FRAGMENT(mtpserve_cpu, m) {
  m.def("fp32_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpserve_cpu, CPU, m) {
  m.impl("fp32_linear", &fp32_linear);
}
