// MLA's absorbed decode attention on the CPU, bf16: query rows (heads x query tokens) over the latent keys of
// their request, one latent row per position shared by every head (model/attention.py, `_attend`):
//     q    [B, R, D]   row i = head * Q + query token (D = kv_lora_rank + rope dims: 128 + 16 shipped)
//     keys [B, L, D]   the request's cached latents c and rope keys; the values are c = keys[..., :V]
//                      or, with block_tables [B, n], the cache [blocks, block_size, D] itself: position p of request
//                      b is row p % block_size of block block_tables[b, p / block_size] (no copy of the keys)
//     mask [B, Q, L]   row i attends to the positions that mask[b, i % Q] allows
//     out  [B, R, V] = softmax(scale * q . keys[p] over the allowed p) . keys[p, :V]
// Scores and probabilities stay fp32 (bf16 dot products, VDPBF16PS); the output is rounded once to bf16.
// Row i over positions 0..5 with Q = 1:  scores s0..s5 -> masked, max, e^(s - max) / sum -> out = sum_p w_p c_p
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "avx512.h"

namespace {

constexpr int64_t kRowBlock = 8; // query rows that share each value row read
constexpr int64_t kAhead = 8;     // positions between the key rows read and those prefetched

// e^x for x <= 0 (to 2 ulp): 2^n e^r, n = round(x / ln 2), r = x - n ln 2 in two parts, e^r by its Taylor series
AVX512_BF16 inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606820309417e-06f), r);
  __m512 e = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(e, n);
}

// acc[i][j] += q_{r+i}[k..k+31] . keys[p+j][k..k+31] (masked: zeros past D)
template <int64_t RR, int64_t P, bool kMasked>
AVX512_BF16 __attribute__((always_inline)) inline void add_chunk(__m512 (&acc)[RR][P], const uint16_t* q,
                                                                 int64_t q_stride, const uint16_t* const* keys,
                                                                 int64_t D, int64_t r, int64_t p, int64_t k) {
  __m512bh key[P];
#pragma GCC unroll 16
  for (int64_t j = 0; j < P; j++)
    key[j] = kMasked ? load32(keys[p + j] + k, D - k) : (__m512bh)_mm512_loadu_si512(keys[p + j] + k);
#pragma GCC unroll 16
  for (int64_t i = 0; i < RR; i++) {
    const uint16_t* qi = q + (r + i) * q_stride + k;
    const __m512bh qv = kMasked ? load32(qi, D - k) : (__m512bh)_mm512_loadu_si512(qi);
#pragma GCC unroll 16
    for (int64_t j = 0; j < P; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], key[j], qv);
  }
}

// raw scores[r, p..p+P-1] = q_r . keys[p + j] for RR rows from r: RR x P independent sums, reduced four at a time
// (keys: a pointer to each position's row)
template <int64_t RR, int64_t P>
AVX512_BF16 inline void scores_block(const uint16_t* q, int64_t q_stride, const uint16_t* const* keys, int64_t D,
                                     int64_t r, int64_t p, int64_t L, float* scores) {
  __m512 acc[RR][P];
#pragma GCC unroll 16
  for (int64_t i = 0; i < RR; i++)
#pragma GCC unroll 16
    for (int64_t j = 0; j < P; j++) acc[i][j] = _mm512_setzero_ps();
  const int64_t full = D / kLanes * kLanes;   // (unmasked loads: no branch in the loop, the sums in registers)
  for (int64_t k = 0; k < full; k += kLanes) add_chunk<RR, P, false>(acc, q, q_stride, keys, D, r, p, k);
  if (full < D) add_chunk<RR, P, true>(acc, q, q_stride, keys, D, r, p, full);
  for (int64_t i = 0; i < RR; i++) {
    if constexpr (P == 4) _mm_storeu_ps(scores + (r + i) * L + p, sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    else for (int64_t j = 0; j < P; j++) scores[(r + i) * L + p + j] = _mm512_reduce_add_ps(acc[i][j]);
  }
}

// probs[r, 0..L-1] of `rows` query rows: scale * q_r . keys[p] where allowed, softmaxed but not yet divided by
// their sum (-> inv_sum[r]). Four rows by four positions at a time.
AVX512_BF16 void block_probs(const uint16_t* q, int64_t q_stride, int64_t rows, const uint16_t* const* keys,
                             const bool* const* allowed, int64_t L, int64_t D, float scale, float* probs,
                             float* inv_sum) {
  int64_t p = 0;
  for (; p + 4 <= L; p += 4) {
    for (int64_t j = p + kAhead; j < std::min(p + kAhead + 4, L); j++)   // (cache rows: blocks apart in memory)
      for (int64_t k = 0; k < 2 * D; k += 64) _mm_prefetch(reinterpret_cast<const char*>(keys[j]) + k, _MM_HINT_T0);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) scores_block<4, 4>(q, q_stride, keys, D, r, p, L, probs);
    for (; r < rows; r++) scores_block<1, 4>(q, q_stride, keys, D, r, p, L, probs);
  }
  for (; p < L; p++)
    for (int64_t r = 0; r < rows; r++) scores_block<1, 1>(q, q_stride, keys, D, r, p, L, probs);
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t r = 0; r < rows; r++) {
    float* row = probs + r * L;
    __m512 top = minus_inf;
    for (p = 0; p < L; p += 16) {   // masked and scaled; the row's largest
      const __mmask16 lanes = (__mmask16)((1u << std::min<int64_t>(16, L - p)) - 1);
      __m128i bytes = _mm_maskz_loadu_epi8(lanes, allowed[r] + p);
      __m512 s = _mm512_mask_mul_ps(minus_inf, _mm_test_epi8_mask(bytes, bytes), _mm512_maskz_loadu_ps(lanes, row + p),
                                    _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(row + p, lanes, s);
      top = _mm512_mask_max_ps(top, lanes, top, s);
    }
    const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(top));   // (set_mask allows every row a position)
    __m512 sum = _mm512_setzero_ps();
    for (p = 0; p < L; p += 16) {
      const __mmask16 lanes = (__mmask16)((1u << std::min<int64_t>(16, L - p)) - 1);
      __m512 s = _mm512_maskz_loadu_ps(lanes, row + p);
      __mmask16 kept = _mm512_mask_cmp_ps_mask(lanes, s, minus_inf, _CMP_NEQ_OQ);
      __m512 e = _mm512_maskz_mov_ps(kept, exp_nonpositive(_mm512_sub_ps(s, row_max)));
      _mm512_mask_storeu_ps(row + p, lanes, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv_sum[r] = 1.f / _mm512_reduce_add_ps(sum);
  }
}

// out[r, :V] = inv_sum[r] sum_p probs[r, p] keys[p, :V] for kRowBlock rows (probs rows past `rows` are zeros), 32
// columns at a time
AVX512_BF16 void block_values(const float* probs, const float* inv_sum, int64_t L, const uint16_t* const* keys,
                              int64_t V, at::BFloat16* out, int64_t out_stride, int64_t rows) {
  for (int64_t c = 0; c < V; c += kLanes) {
    __m512 acc[kRowBlock][2];
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRowBlock; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < L; p++) {
      const uint16_t* value = keys[p] + c;
      __m512 lo = load16_as_float(value, V - c), hi = load16_as_float(value + 16, V - c - 16);
#pragma GCC unroll 16
      for (int64_t r = 0; r < kRowBlock; r++) {
        __m512 w = _mm512_set1_ps(probs[r * L + p]);
        acc[r][0] = _mm512_fmadd_ps(w, lo, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w, hi, acc[r][1]);
      }
    }
    const __mmask32 cols = V - c >= kLanes ? ~0u : (__mmask32)((1ull << (V - c)) - 1);
#pragma GCC unroll 16
    for (int64_t r = 0; r < kRowBlock; r++) {
      if (r >= rows) break;
      const __m512 inv = _mm512_set1_ps(inv_sum[r]);
      __m512bh both = _mm512_cvtne2ps_pbh(_mm512_mul_ps(acc[r][1], inv), _mm512_mul_ps(acc[r][0], inv));
      _mm512_mask_storeu_epi16(out + r * out_stride + c, cols, (__m512i)both);
    }
  }
}

at::Tensor latent_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& mask, double scale,
                            int64_t value_dim, const c10::optional<at::Tensor>& block_tables) {
  const bool paged = block_tables.has_value();
  const int64_t B = q.size(0), R = q.size(1), D = q.size(2), L = mask.size(2), Q = mask.size(1), V = value_dim;
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && mask.dim() == 3 && q.size(2) == keys.size(2) && mask.size(0) == B &&
              R % Q == 0 && V <= D, "latent_attention: q [B, R, D], keys [., ., D], mask [B, Q, L], R = heads x Q");
  TORCH_CHECK(paged ? block_tables->dim() == 2 && block_tables->size(0) == B &&
                          block_tables->size(1) * keys.size(1) >= L && block_tables->scalar_type() == at::kLong
                    : keys.size(0) == B && keys.size(1) == L,
              "latent_attention: keys [B, L, D], or a cache [blocks, block_size, D] with int64 block_tables [B, n] "
              "covering L positions");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
              mask.scalar_type() == at::kBool, "latent_attention: bf16 q and keys, bool mask");
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(2) == 1 && mask.stride(2) == 1,
              "latent_attention: rows must be contiguous");
  at::Tensor out = at::empty({B, R, V}, q.options());
  const at::Tensor tables = paged ? block_tables->contiguous() : at::Tensor();
  const int64_t* table = paged ? tables.data_ptr<int64_t>() : nullptr;
  // a request's keys in runs of `run` rows: a cache block each, or all L rows of its entry in keys
  const int64_t run = paged ? keys.size(1) : L, runs = paged ? tables.size(1) : 1, blocks = keys.size(0);
  const int64_t block_stride = keys.stride(0), row_stride = keys.stride(1);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(keys.data_ptr());
  const bool* mp = mask.data_ptr<bool>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, B, 1, [&](int64_t first, int64_t last) {
    std::vector<float> probs(kRowBlock * L);
    std::vector<const uint16_t*> key_rows(L);   // position p's row
    float inv_sum[kRowBlock];
    const bool* allowed[kRowBlock];
    for (int64_t b = first; b < last; b++) {
      for (int64_t i = 0, p = 0; p < L; i++) {
        const int64_t block = paged ? table[b * runs + i] : b;
        TORCH_CHECK(block >= 0 && block < blocks, "latent_attention: a block id outside the cache");
        const uint16_t* block_rows = kp + block * block_stride;
        for (int64_t row = 0; row < run && p < L; row++, p++) key_rows[p] = block_rows + row * row_stride;
      }
      for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, R - r0);
        for (int64_t r = 0; r < rows; r++) allowed[r] = mp + b * mask.stride(0) + ((r0 + r) % Q) * mask.stride(1);
        std::fill(probs.begin() + rows * L, probs.end(), 0.f);
        block_probs(qp + b * q.stride(0) + r0 * q.stride(1), q.stride(1), rows, key_rows.data(), allowed, L, D,
                    float(scale), probs.data(), inv_sum);
        block_values(probs.data(), inv_sum, L, key_rows.data(), V, op + (b * R + r0) * V, V, rows);
      }
    }
  });
  return out;
}

}  // namespace

C_SHIM(latent_attention,
       (Handle q, Handle keys, Handle mask, double scale, int64_t value_dim, Handle* block_tables, Handle* ret0),
       latent_attention(tensor_at(q), tensor_at(keys), tensor_at(mask), scale, value_dim,
                        block_tables ? c10::optional<at::Tensor>(tensor_at(*block_tables)) : c10::nullopt))

TORCH_LIBRARY_FRAGMENT(mtpserve_cpu, m) {
  m.def("latent_attention(Tensor q, Tensor keys, Tensor mask, float scale, int value_dim, Tensor? block_tables=None) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(mtpserve_cpu, CPU, m) {
  m.impl("latent_attention", &latent_attention);
}
