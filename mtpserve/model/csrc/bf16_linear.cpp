// bf16 x [M, K] times a bf16 weight stored by rows [N, K] -> bf16 [M, N], for the few rows of a decode or verify
// step on a CPU with AVX512-BF16. Each output is one fp32 dot product (VDPBF16PS, 32 products an instruction)
// rounded once to bf16. Eight weight rows at a time, each read once from memory for all M rows of x:
//     y[m, n..n+7] = x[m] . w[n..n+7]        for m in 0..M-1, the eight rows then in L1
// Each 32 weights are loaded once for up to three rows of x; for one row, a weight row's weights are read in order
// (docs/history.md). bf16_bmm: the same per batch entry (MLA's absorbed projections, one per head). An output depends
// on its own row of x only: a row gives the same bits alone or in any batch.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>

#include "avx512.h"

namespace {

// y[m, n..n+R-1] = x[m] . w[n..n+R-1] for T rows m of x at once, each 32 weights loaded once for the T rows. One
// row of x: a weight row at a time (its weights read in order); more: the R rows side by side, x in registers.
// Either way a sum adds its products in order of k: the same bits.
template <int64_t R, int64_t T>
AVX512_BF16 void tile_times_weight(const uint16_t* x, int64_t x_stride, const uint16_t* block, int64_t w_stride,
                                   at::BFloat16* y, int64_t N, int64_t K, bool prefetch) {
  __m512 acc[T][R];
  __m512bh xv[T];
  for (int64_t t = 0; t < T; t++)
    for (int64_t r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
  const int64_t full = K / kLanes * kLanes;   // (the last K % 32 values apart, by masked loads: zeros past K)
  if constexpr (T == 1) {
    for (int64_t r = 0; r < R; r++) {
      const uint16_t* row = block + r * w_stride;
      __m512 sum = _mm512_setzero_ps();   // (a local: as acc[0][r] the sum went through memory each step)
      for (int64_t k = 0; k < full; k += kLanes) {
        if (prefetch) prefetch_weights(row + kAheadBlocks * R * w_stride + k);
        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(row + k), (__m512bh)_mm512_loadu_si512(x + k));
      }
      if (full < K) sum = _mm512_dpbf16_ps(sum, load32(row + full, K - full), load32(x + full, K - full));
      acc[0][r] = sum;
    }
  } else {
    for (int64_t k = 0; k < full; k += kLanes) {
      for (int64_t t = 0; t < T; t++) xv[t] = (__m512bh)_mm512_loadu_si512(x + t * x_stride + k);
      for (int64_t r = 0; r < R; r++) {
        if (prefetch) prefetch_weights(block + (kAheadBlocks * R + r) * w_stride + k);
        __m512bh wv = (__m512bh)_mm512_loadu_si512(block + r * w_stride + k);
        for (int64_t t = 0; t < T; t++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], wv, xv[t]);
      }
    }
    if (full < K) {
      for (int64_t t = 0; t < T; t++) xv[t] = load32(x + t * x_stride + full, K - full);
      for (int64_t r = 0; r < R; r++) {
        __m512bh wv = load32(block + r * w_stride + full, K - full);
        for (int64_t t = 0; t < T; t++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], wv, xv[t]);
      }
    }
  }
  for (int64_t t = 0; t < T; t++) {
    if constexpr (R % 4 == 0) {   // four sums at a time (avx512.h), rounded to bf16 together
      for (int64_t r = 0; r < R; r += 4) {
        __m128 four = sum4(acc[t][r], acc[t][r + 1], acc[t][r + 2], acc[t][r + 3]);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(y + t * N + r), (__m128i)_mm_cvtneps_pbh(four));
      }
    } else {
      for (int64_t r = 0; r < R; r++) y[t * N + r] = _mm512_reduce_add_ps(acc[t][r]);
    }
  }
}

// R weight rows times every row of x, up to kTile rows of x at a time (the block in L1 after the first tile)
template <int64_t R>
AVX512_BF16 void block_times_weight(const uint16_t* x, int64_t x_stride, const uint16_t* block, int64_t w_stride,
                                    at::BFloat16* y, int64_t M, int64_t N, int64_t K) {
  for (int64_t m = 0; m < M; m += kTile) {
    const uint16_t* xm = x + m * x_stride;
    switch (std::min(kTile, M - m)) {
      case 1: tile_times_weight<R, 1>(xm, x_stride, block, w_stride, y + m * N, N, K, m == 0); break;
      case 2: tile_times_weight<R, 2>(xm, x_stride, block, w_stride, y + m * N, N, K, m == 0); break;
      default: tile_times_weight<R, kTile>(xm, x_stride, block, w_stride, y + m * N, N, K, m == 0);
    }
  }
}

// y[:, begin:end] for weight rows begin..end-1
AVX512_BF16 void rows_times_weight(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t w_stride,
                                   at::BFloat16* y, int64_t M, int64_t N, int64_t K, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + kBlock <= end; n += kBlock)
    block_times_weight<kBlock>(x, x_stride, w + n * w_stride, w_stride, y + n, M, N, K);
  for (; n < end; n++)   // the last rows, fewer than a block
    block_times_weight<1>(x, x_stride, w + n * w_stride, w_stride, y + n, M, N, K);
}

void check(const at::Tensor& x, const at::Tensor& weight, int64_t dims) {
  TORCH_CHECK(x.dim() == dims && weight.dim() == dims && x.size(-1) == weight.size(-1),
              "bf16 kernel: x [(B,) M, K], weight [(B,) N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16 kernel: bf16 only");
  TORCH_CHECK(x.stride(-1) == 1 && weight.stride(-1) == 1, "bf16 kernel: rows must be contiguous");
}

// y[b] = x[b] @ w[b].T for b in 0..B-1 (B = 1: a linear), x [M, K] and w [N, K] by rows of the given strides, y
// [M, N] contiguous. Torch's threads split the B x N weight rows by blocks, each thread's share at least kShareBytes
// read per tile of rows (one thread below that).
void batched(const uint16_t* xp, int64_t x_stride, int64_t x_batch, const uint16_t* wp, int64_t w_stride,
             int64_t w_batch, at::BFloat16* yp, int64_t B, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = (N + kBlock - 1) / kBlock, tiles = (M + kTile - 1) / kTile;
  const int64_t grain = share_grain(kBlock * K * 2, tiles);
  at::parallel_for(0, B * blocks, grain, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last;) {   // blocks first..last-1, one batch entry at a time
      const int64_t b = i / blocks, end = std::min(last, (b + 1) * blocks);
      rows_times_weight(xp + b * x_batch, x_stride, wp + b * w_batch, w_stride, yp + b * M * N, M, N, K,
                        (i - b * blocks) * kBlock, std::min(N, (end - b * blocks) * kBlock));
      i = end;
    }
  });
}

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

void batched(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y, int64_t B) {
  batched(bits(x), x.stride(-2), B > 1 ? x.stride(0) : 0, bits(weight), weight.stride(-2), B > 1 ? weight.stride(0) : 0,
          y.data_ptr<at::BFloat16>(), B, x.size(-2), weight.size(-2), x.size(-1));
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight) {
  check(x, weight, 2);
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  batched(x, weight, y, 1);
  return y;
}

at::Tensor bf16_bmm(const at::Tensor& x, const at::Tensor& weight) {
  check(x, weight, 3);
  TORCH_CHECK(x.size(0) == weight.size(0), "bf16_bmm: x [B, M, K], weight [B, N, K]");
  at::Tensor y = at::empty({x.size(0), x.size(1), weight.size(1)}, x.options());
  batched(x, weight, y, x.size(0));
  return y;
}

}  // namespace

C_SHIM(bf16_linear, (Handle x, Handle weight, Handle* ret0),
       bf16_linear(tensor_at(x), tensor_at(weight)))
C_SHIM(bf16_bmm, (Handle x, Handle weight, Handle* ret0),
       bf16_bmm(tensor_at(x), tensor_at(weight)))

void bf16_rows_into(const at::BFloat16* x, const at::BFloat16* w, int64_t w_stride, at::BFloat16* y, int64_t M,
                    int64_t N, int64_t K) {
  batched(reinterpret_cast<const uint16_t*>(x), K, 0, reinterpret_cast<const uint16_t*>(w), w_stride, 0, y, 1, M, N, K);
}

TORCH_LIBRARY(mtpserve_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("bf16_bmm(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpserve_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_bmm", &bf16_bmm);
}
