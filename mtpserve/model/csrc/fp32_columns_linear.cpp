// fp32 x [M, K] times a weight stored by columns, given as its transpose wt [K, N] (rows of N outputs) -> fp32 [M, N],
// for the few rows of a decode or verify step with fp32 weights (model/layers.py stores those by columns). Each
// output sums its K products in order, one FMA at a time, in its own lane:
//     y[m, n..n+63] = sum over k of x[m, k] * wt[k, n..n+63]     (4 registers of 16 sums, k = 0, 1, ..., K-1)
// Sixty-four columns of the weight are read once for up to six rows of x. An output depends on its own row of x
// only: a row gives the same bits alone or in any batch, at any number of threads.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>

#include "avx512.h"

namespace {

constexpr int64_t kVectors = 4;   // registers of 16 columns a block holds (64 columns)
constexpr int64_t kRows = 6;      // rows of x a tile multiplies together (6 x 4 sums in registers)
constexpr int64_t kPanel = 8;     // weight rows a pass reads side by side (8 streams through memory)
constexpr int64_t kAhead = 16;    // weight rows prefetched ahead (the hardware prefetcher alone falls behind DRAM
                                  // from two rows of x up: docs/history.md)

// y[t, n..n+16V-1] += x[t, k] * wt[k, n..] for k in k0..k1-1 of K, T rows t of x (k0 = 0: y starts at zero); the
// last register's columns masked by `last` (columns past N)
template <int64_t V, int64_t T>
AVX512_BF16 void tile(const float* x, int64_t x_stride, const float* wt, int64_t w_stride, float* y, int64_t y_stride,
                      int64_t k0, int64_t k1, int64_t K, __mmask16 last) {
  __m512 acc[T][V], w[V];   // (every loop over t and v unrolled: else GCC kept the sums in memory, a store per FMA)
  #pragma GCC unroll 16
  for (int64_t t = 0; t < T; t++)
    #pragma GCC unroll 16
    for (int64_t v = 0; v < V; v++)
      acc[t][v] = k0 == 0 ? _mm512_setzero_ps()
                          : _mm512_maskz_loadu_ps(v == V - 1 ? last : 0xffff, y + t * y_stride + 16 * v);
  for (int64_t k = k0; k < k1; k++) {
    const float* row = wt + k * w_stride;
    if (k + kAhead < K)
      #pragma GCC unroll 16
      for (int64_t v = 0; v < V; v++)
        prefetch_weights(row + kAhead * w_stride + 16 * v);
    #pragma GCC unroll 16
    for (int64_t v = 0; v < V; v++)
      w[v] = v == V - 1 ? _mm512_maskz_loadu_ps(last, row + 16 * v) : _mm512_loadu_ps(row + 16 * v);
    #pragma GCC unroll 16
    for (int64_t t = 0; t < T; t++) {
      const __m512 xk = _mm512_set1_ps(x[t * x_stride + k]);
      #pragma GCC unroll 16
      for (int64_t v = 0; v < V; v++) acc[t][v] = _mm512_fmadd_ps(w[v], xk, acc[t][v]);
    }
  }
  #pragma GCC unroll 16
  for (int64_t t = 0; t < T; t++)
    #pragma GCC unroll 16
    for (int64_t v = 0; v < V; v++)
      _mm512_mask_storeu_ps(y + t * y_stride + 16 * v, v == V - 1 ? last : 0xffff, acc[t][v]);
}

// y[0..T-1, n0..n1-1] for T rows of x: kPanel weight rows at a time, across the columns 64 at a time
template <int64_t T>
AVX512_BF16 void rows(const float* x, int64_t x_stride, const float* wt, int64_t w_stride, float* y, int64_t y_stride,
                      int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t width = 16 * kVectors;
  for (int64_t k0 = 0; k0 < K; k0 += kPanel) {
    const int64_t k1 = std::min(K, k0 + kPanel);
    for (int64_t n = n0; n < n1; n += width) {
      const int64_t left = std::min(width, n1 - n), vectors = (left + 15) / 16;
      const __mmask16 last = (__mmask16)((1u << (left - 16 * (vectors - 1))) - 1);
      switch (vectors) {
        case 1: tile<1, T>(x, x_stride, wt + n, w_stride, y + n, y_stride, k0, k1, K, last); break;
        case 2: tile<2, T>(x, x_stride, wt + n, w_stride, y + n, y_stride, k0, k1, K, last); break;
        case 3: tile<3, T>(x, x_stride, wt + n, w_stride, y + n, y_stride, k0, k1, K, last); break;
        default: tile<kVectors, T>(x, x_stride, wt + n, w_stride, y + n, y_stride, k0, k1, K, last);
      }
    }
  }
}

// y[:, n0..n1-1], kRows rows of x at a time
AVX512_BF16 void columns(const float* x, int64_t x_stride, const float* wt, int64_t w_stride, float* y,
                         int64_t y_stride, int64_t M, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; m += kRows) {
    const float* xm = x + m * x_stride;
    float* ym = y + m * y_stride;
    switch (std::min(kRows, M - m)) {
      case 1: rows<1>(xm, x_stride, wt, w_stride, ym, y_stride, K, n0, n1); break;
      case 2: rows<2>(xm, x_stride, wt, w_stride, ym, y_stride, K, n0, n1); break;
      case 3: rows<3>(xm, x_stride, wt, w_stride, ym, y_stride, K, n0, n1); break;
      case 4: rows<4>(xm, x_stride, wt, w_stride, ym, y_stride, K, n0, n1); break;
      case 5: rows<5>(xm, x_stride, wt, w_stride, ym, y_stride, K, n0, n1); break;
      default: rows<kRows>(xm, x_stride, wt, w_stride, ym, y_stride, K, n0, n1);
    }
  }
}

at::Tensor fp32_columns_linear(const at::Tensor& x, const at::Tensor& wt) {
  at::Tensor y = at::empty({x.size(0), wt.size(1)}, x.options());
  fp32_columns_linear_into(x, wt, y);
  return y;
}

}  // namespace

C_SHIM(fp32_columns_linear, (Handle x, Handle wt, Handle* ret0),
       fp32_columns_linear(tensor_at(x), tensor_at(wt)))

void fp32_columns_linear_into(const at::Tensor& x, const at::Tensor& wt, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && wt.dim() == 2 && x.size(1) == wt.size(0), "fp32_columns_linear: x [M, K], wt [K, N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wt.scalar_type() == at::kFloat, "fp32_columns_linear: fp32 only");
  TORCH_CHECK(x.stride(1) == 1 && wt.stride(1) == 1, "fp32_columns_linear: rows must be contiguous");
  TORCH_CHECK(y.is_contiguous() && y.size(0) == x.size(0) && y.size(1) == wt.size(1), "fp32_columns_linear: y [M, N]");
  const int64_t M = x.size(0), K = x.size(1), N = wt.size(1), width = 16 * kVectors;
  const float* xp = x.data_ptr<float>();
  const float* wp = wt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + width - 1) / width, tiles = (M + kRows - 1) / kRows;
  const int64_t grain = share_grain(width * K * 4, tiles);
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    columns(xp, x.stride(0), wp, wt.stride(0), yp, N, M, K, first * width, std::min(N, last * width));
  });
}

TORCH_LIBRARY_FRAGMENT(mtpserve_cpu, m) {
  m.def("fp32_columns_linear(Tensor x, Tensor wt) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpserve_cpu, CPU, m) {
  m.impl("fp32_columns_linear", &fp32_columns_linear);
}
