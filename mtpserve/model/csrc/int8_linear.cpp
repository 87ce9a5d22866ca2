// bf16 x [M, K] times an int8 weight stored by rows [N, K] with one scale per row [N] -> bf16 [M, N] (weight-only int8,
// model/int8.py). A row of x enters as 16-bit integers at a power of two: its largest value under 2^15, every value
// within 2^7 of that exact (a bf16 value has 8 significant bits), smaller ones rounded to the step (an error under
// 2^-15 of the largest). Products are summed exactly in int32 lanes (VPDPWSSD: 32 products an instruction), then
// scaled and rounded once:
//     x[m] = [1 0.5 -2], largest 2 < 2^2: step 2^(2-15), xq = [8192 4096 -16384]
//     w[n] = [50 -127 2], s[n] = 0.01  ->  y[m, n] = bf16((409600 - 520192 - 32768) * 2^-13 * 0.01) = bf16(-0.175)
// Eight weight rows at a time, read once from memory for all M rows (as bf16_linear.cpp): for one row of x a weight
// row at a time, in order; for more, side by side, each 32 weights widened once for up to three rows of x. Integer
// sums are the same in any order: a row of x gives the same bits alone or in any batch.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "avx512.h"

#define AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")))

namespace {

// Weights summed in int32 lanes before a lane is moved to fp32: a lane adds two products under 2^22 an instruction,
// 4,096 weights (128 instructions) stay under 2^30
constexpr int64_t kChunk = 4096;

// x [M, K] bf16 -> xq [M, Kp] int16 (zeros past K) and scale [M]: xq[m] * scale[m] = x[m], rounded as above (to
// nearest, ties to even)
AVX512_VNNI void quantize_rows(const uint16_t* x, int64_t x_stride, int64_t M, int64_t K, int64_t Kp, int16_t* xq,
                               float* scale) {
  for (int64_t m = 0; m < M; m++) {
    const uint16_t* row = x + m * x_stride;
    __m512 largest = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16)
      largest = _mm512_max_ps(largest, _mm512_abs_ps(load16_as_float(row + k, K - k)));
    int exponent = 0;
    std::frexp(_mm512_reduce_max_ps(largest), &exponent);   // largest < 2^exponent
    const __m512 to_int = _mm512_set1_ps(std::ldexp(1.f, 15 - exponent));   // largest * to_int < 2^15
    scale[m] = std::ldexp(1.f, exponent - 15);
    for (int64_t k = 0; k < Kp; k += 16) {   // (zeros past K: Kp is a multiple of 32)
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16_as_float(row + k, K - k), to_int));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * Kp + k), _mm512_cvtepi32_epi16(q));
    }
  }
}

// 32 int8 weights at p widened to int16, zeros past `left`
AVX512_VNNI inline __m512i widen32(const int8_t* p, int64_t left = kLanes) {
  const __m256i v = left >= kLanes ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                   : _mm256_maskz_loadu_epi8((__mmask32)((1ull << left) - 1), p);
  return _mm512_cvtepi8_epi16(v);
}

// sums[t][r] += xq[t, k0..k1-1] . w[r, k0..k1-1] for T rows t of x and R weight rows r, exact in int32 lanes. One
// row of x: a weight row after another, read in order (as bf16_linear.cpp); more: the R rows side by side, each 32
// weights widened once for the T rows of x. (A function of its own, the sums of earlier chunks in memory: with them
// in registers too GCC kept the T x R sums in memory, a store per VPDPWSSD.)
template <int64_t R, int64_t T>
AVX512_VNNI void chunk_sums(const int16_t* xq, int64_t Kp, const int8_t* block, int64_t w_stride, int64_t k0,
                            int64_t k1, bool prefetch, float (*sums)[R]) {
  __m512i acc[T][R];
  const int64_t full = k0 + (k1 - k0) / kLanes * kLanes;   // (the last K % 32 apart, by masked loads)
  if constexpr (T == 1) {
    for (int64_t r = 0; r < R; r++) {
      const int8_t* row = block + r * w_stride;
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();   // (two sums: half the latency)
      int64_t k = k0;
      for (; k + 2 * kLanes <= full; k += 2 * kLanes) {
        if (prefetch) prefetch_weights(row + kAheadBlocks * R * w_stride + k);
        even = _mm512_dpwssd_epi32(even, widen32(row + k), _mm512_loadu_si512(xq + k));
        odd = _mm512_dpwssd_epi32(odd, widen32(row + k + kLanes), _mm512_loadu_si512(xq + k + kLanes));
      }
      if (k < full) even = _mm512_dpwssd_epi32(even, widen32(row + k), _mm512_loadu_si512(xq + k));
      if (full < k1) odd = _mm512_dpwssd_epi32(odd, widen32(row + full, k1 - full), _mm512_loadu_si512(xq + full));
      acc[0][r] = _mm512_add_epi32(even, odd);
    }
  } else {
    __m512i xv[T];
    for (int64_t t = 0; t < T; t++)
      for (int64_t r = 0; r < R; r++) acc[t][r] = _mm512_setzero_si512();
    for (int64_t k = k0; k < full; k += kLanes) {
      for (int64_t t = 0; t < T; t++) xv[t] = _mm512_loadu_si512(xq + t * Kp + k);
      for (int64_t r = 0; r < R; r++) {
        if (prefetch) prefetch_weights(block + (R + r) * w_stride + k);   // (the next block)
        const __m512i wv = widen32(block + r * w_stride + k);
        for (int64_t t = 0; t < T; t++) acc[t][r] = _mm512_dpwssd_epi32(acc[t][r], wv, xv[t]);
      }
    }
    if (full < k1) {
      for (int64_t t = 0; t < T; t++) xv[t] = _mm512_loadu_si512(xq + t * Kp + full);
      for (int64_t r = 0; r < R; r++) {
        const __m512i wv = widen32(block + r * w_stride + full, k1 - full);
        for (int64_t t = 0; t < T; t++) acc[t][r] = _mm512_dpwssd_epi32(acc[t][r], wv, xv[t]);
      }
    }
  }
  for (int64_t t = 0; t < T; t++) {   // the lanes as fp32, summed four rows at a time (avx512.h)
    if constexpr (R == 1) {
      sums[t][0] += _mm512_reduce_add_ps(_mm512_cvtepi32_ps(acc[t][0]));
    } else {
      for (int64_t r = 0; r < R; r += 4)
        _mm_storeu_ps(sums[t] + r, _mm_add_ps(_mm_loadu_ps(sums[t] + r), sum4(
            _mm512_cvtepi32_ps(acc[t][r]), _mm512_cvtepi32_ps(acc[t][r + 1]), _mm512_cvtepi32_ps(acc[t][r + 2]),
            _mm512_cvtepi32_ps(acc[t][r + 3]))));
    }
  }
}

// y[m, n..n+R-1] = (xq[m] . w[n..n+R-1]) * scale_x[m] * scale_w[n..] for T rows m of x at once
template <int64_t R, int64_t T>
AVX512_VNNI void tile_times(const int16_t* xq, int64_t Kp, const float* x_scale, const int8_t* block,
                            int64_t w_stride, const at::BFloat16* w_scale, int64_t scale_stride, at::BFloat16* y,
                            int64_t N, int64_t K, bool prefetch) {
  static_assert(R % 4 == 0 || R == 1);
  float sums[T][R] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kChunk)
    chunk_sums<R, T>(xq, Kp, block, w_stride, k0, std::min(K, k0 + kChunk), prefetch, sums);
  for (int64_t r = 0; r < R; r += 4) {   // scaled, rounded to bf16 four at a time
    const __m128 w_scales = R == 1 ? _mm_set_ss(float(w_scale[0]))
        : _mm_setr_ps(float(w_scale[r * scale_stride]), float(w_scale[(r + 1) * scale_stride]),
                      float(w_scale[(r + 2) * scale_stride]), float(w_scale[(r + 3) * scale_stride]));
    for (int64_t t = 0; t < T; t++) {
      const __m128 four_sums = R == 1 ? _mm_set_ss(sums[t][0]) : _mm_loadu_ps(sums[t] + r);
      const __m128i four = (__m128i)_mm_cvtneps_pbh(_mm_mul_ps(_mm_mul_ps(four_sums, _mm_set1_ps(x_scale[t])),
                                                               w_scales));
      if constexpr (R == 1) y[t * N] = c10::bit_cast<at::BFloat16>(uint16_t(_mm_extract_epi16(four, 0)));
      else _mm_storel_epi64(reinterpret_cast<__m128i*>(y + t * N + r), four);
    }
  }
}

// R weight rows times every row of x, up to kTile rows of x at a time (the block in L1 after the first tile)
template <int64_t R>
AVX512_VNNI void block_times(const int16_t* xq, int64_t Kp, const float* x_scale, const int8_t* block,
                             int64_t w_stride, const at::BFloat16* w_scale, int64_t scale_stride, at::BFloat16* y,
                             int64_t M, int64_t N, int64_t K) {
  for (int64_t m = 0; m < M; m += kTile) {
    const int16_t* xm = xq + m * Kp;
    switch (std::min(kTile, M - m)) {
      case 1: tile_times<R, 1>(xm, Kp, x_scale + m, block, w_stride, w_scale, scale_stride, y + m * N, N, K, m == 0);
        break;
      case 2: tile_times<R, 2>(xm, Kp, x_scale + m, block, w_stride, w_scale, scale_stride, y + m * N, N, K, m == 0);
        break;
      default: tile_times<R, kTile>(xm, Kp, x_scale + m, block, w_stride, w_scale, scale_stride, y + m * N, N, K,
                                    m == 0);
    }
  }
}

constexpr int64_t kInt8ShareBytes = 64 << 10;   // a thread's share of the weight (docs/history.md)

// y = x @ (w * scale).T, torch's threads splitting the weight by blocks of rows, each thread's share at least
// kInt8ShareBytes read per tile of rows (one thread below that)
void int8_rows(const uint16_t* x, int64_t x_stride, const int8_t* w, int64_t w_stride, const at::BFloat16* scale,
               int64_t scale_stride, at::BFloat16* y, int64_t M, int64_t N, int64_t K) {
  const int64_t Kp = (K + kLanes - 1) / kLanes * kLanes;
  thread_local std::vector<int16_t> xq;   // (reused: no allocation per call)
  thread_local std::vector<float> x_scale;
  xq.resize(M * Kp);
  x_scale.resize(M);
  quantize_rows(x, x_stride, M, K, Kp, xq.data(), x_scale.data());
  const int16_t* xqp = xq.data();
  const float* xs = x_scale.data();
  const int64_t blocks = (N + kBlock - 1) / kBlock, tiles = (M + kTile - 1) / kTile;
  const int64_t grain = share_grain(kBlock * K, tiles, kInt8ShareBytes);
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    int64_t n = first * kBlock;
    const int64_t end = std::min(N, last * kBlock);
    for (; n + kBlock <= end; n += kBlock)
      block_times<kBlock>(xqp, Kp, xs, w + n * w_stride, w_stride, scale + n * scale_stride, scale_stride, y + n, M,
                          N, K);
    for (; n < end; n++)   // the last rows, fewer than a block
      block_times<1>(xqp, Kp, xs, w + n * w_stride, w_stride, scale + n * scale_stride, scale_stride, y + n, M, N, K);
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "int8_linear: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kChar &&
              scale.scalar_type() == at::kBFloat16, "int8_linear: bf16 x and scales, int8 weight");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == weight.size(0), "int8_linear: one scale per weight row");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1, "int8_linear: rows must be contiguous");
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  int8_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), weight.data_ptr<int8_t>(), weight.stride(0),
            scale.data_ptr<at::BFloat16>(), scale.stride(0), y.data_ptr<at::BFloat16>(), x.size(0), weight.size(0),
            x.size(1));
  return y;
}

}  // namespace

C_SHIM(int8_linear, (Handle x, Handle weight, Handle scale, Handle* ret0),
       int8_linear(tensor_at(x), tensor_at(weight), tensor_at(scale)))

void int8_rows_into(const at::BFloat16* x, const int8_t* w, int64_t w_stride, const at::BFloat16* scale,
                    int64_t scale_stride, at::BFloat16* y, int64_t M, int64_t N, int64_t K) {
  int8_rows(reinterpret_cast<const uint16_t*>(x), K, w, w_stride, scale, scale_stride, y, M, N, K);
}

TORCH_LIBRARY_FRAGMENT(mtpserve_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpserve_cpu, CPU, m) {
  m.impl("int8_linear", &int8_linear);
}
