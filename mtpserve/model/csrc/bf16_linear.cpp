// bf16 x [M, K] times a bf16 weight stored by rows [N, K] -> bf16 [M, N], for the few rows of a decode or verify
// step on a CPU with AVX512-BF16. Each output is one fp32 dot product (VDPBF16PS, 32 products an instruction)
// rounded once to bf16. Eight weight rows at a time, each read once from memory for all M rows of x:
//     y[m, n..n+7] = x[m] . w[n..n+7]        for m in 0..M-1, the eight rows then in L1
// An output depends on its own row of x only: a row gives the same bits alone or in any batch.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>

#include "avx512.h"

namespace {

// y[:, begin:end] for weight rows begin..end-1
AVX512_BF16 void rows_times_weight(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t w_stride,
                                   at::BFloat16* y, int64_t M, int64_t N, int64_t K, int64_t begin, int64_t end) {
  constexpr int64_t R = kBlock;   // the next block is prefetched while this one is read
  int64_t n = begin;
  for (; n + R <= end; n += R) {
    const uint16_t* block = w + n * w_stride;
    for (int64_t m = 0; m < M; m++) {
      const uint16_t* xm = x + m * x_stride;
      __m512 acc[R];
      for (int64_t r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += kLanes) {
        __m512bh xv = load32(xm + k, K - k);
        for (int64_t r = 0; r < R; r++) {
          if (m == 0) _mm_prefetch(reinterpret_cast<const char*>(block + (R + r) * w_stride + k), _MM_HINT_T0);
          acc[r] = _mm512_dpbf16_ps(acc[r], load32(block + r * w_stride + k, K - k), xv);
        }
      }
      for (int64_t r = 0; r < R; r++) y[m * N + n + r] = _mm512_reduce_add_ps(acc[r]);
    }
  }
  for (; n < end; n++) {   // the last rows, fewer than a block
    for (int64_t m = 0; m < M; m++) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += kLanes)
        acc = _mm512_dpbf16_ps(acc, load32(w + n * w_stride + k, K - k), load32(x + m * x_stride + k, K - k));
      y[m * N + n] = _mm512_reduce_add_ps(acc);
    }
  }
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "bf16_linear: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16_linear: bf16 only");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1, "bf16_linear: rows must be contiguous");
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  // torch's threads split the weight by blocks, each thread's share at least kShareBytes (one thread below that)
  const int64_t blocks = (N + kBlock - 1) / kBlock, grain = std::max<int64_t>(1, kShareBytes / (kBlock * K * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    rows_times_weight(xp, x.stride(0), wp, weight.stride(0), y.data_ptr<at::BFloat16>(), M, N, K, first * kBlock,
                      std::min(N, last * kBlock));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(mtpserve_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpserve_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
}
