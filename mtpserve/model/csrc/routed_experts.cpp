// A MoE layer's routed experts over many tokens in bf16, each expert once on the tokens that chose it (model/moe.py,
// `_grouped` in one op):
//     x [T, H], weights [T, k] bf16, ids [T, k] (an id of E: an expert held elsewhere, skipped)
//     w13 [E, 2I, H] (an expert's gate rows, then its up rows), w2 [H, E, I] (w2[:, e]: expert e's down projection)
// [t0: e1 e5] [t1: e2 e5] -> rows e1:t0 | e2:t1 | e5:t0 e5:t1, gathered in expert order, then per expert
//     y = (silu(rows @ gate.T) * (rows @ up.T)) @ down.T        (ATen's silu and mul: eager mode's bits)
// and out[t] = the fp32 sum, in expert id order, of bf16(y * weight) over t's choices, rounded once to bf16: the
// bits of `_grouped` and of every other path of a token's experts.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <vector>

#include "avx512.h"

namespace {

// v rounded to bf16 (to nearest, ties to even) and back: c10::BFloat16's rounding for finite values
AVX512_BF16 inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline __mmask16 first(int64_t n) { return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }

AVX512_BF16 inline __m512 load16(const at::BFloat16* p, __mmask16 lanes) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
}

// sums[t] += bf16(y[r] * weight[r]) for each row r of the experts' outputs, t its token (rows in expert order: a
// token's terms in expert id order)
AVX512_BF16 void add_weighted(const at::BFloat16* y, const at::BFloat16* row_weight, const int64_t* row_token,
                              int64_t rows, float* sums, int64_t H) {
  for (int64_t r = 0; r < rows; r++) {
    const __m512 w = _mm512_set1_ps(static_cast<float>(row_weight[r]));
    float* sum = sums + row_token[r] * H;
    for (int64_t h = 0; h < H; h += 16) {
      const __mmask16 lanes = first(H - h);
      const __m512 term = round_bf16(_mm512_mul_ps(load16(y + r * H + h, lanes), w));
      _mm512_mask_storeu_ps(sum + h, lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, sum + h), term));
    }
  }
}

AVX512_BF16 void round_sums(const float* sums, at::BFloat16* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i rounded = _mm512_castps_si512(round_bf16(_mm512_maskz_loadu_ps(first(n - i), sums + i)));
    _mm256_mask_storeu_epi16(out + i, first(n - i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
}

at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
                          const at::Tensor& w2) {
  TORCH_CHECK(x.dim() == 2 && weights.dim() == 2 && ids.sizes() == weights.sizes() && ids.size(0) == x.size(0) &&
              w13.dim() == 3 && w2.dim() == 3 && w13.size(2) == x.size(1) && w2.size(0) == x.size(1) &&
              w2.size(1) == w13.size(0) && w13.size(1) == 2 * w2.size(2),
              "routed_experts: x [T, H], weights and ids [T, k], w13 [E, 2I, H], w2 [H, E, I]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weights.scalar_type() == at::kBFloat16 &&
              ids.scalar_type() == at::kLong, "routed_experts: bf16 x and weights, int64 ids");
  const int64_t T = x.size(0), k = ids.size(1), E = w13.size(0), H = x.size(1), I = w2.size(2);
  const at::Tensor xc = x.contiguous(), wc = weights.contiguous(), ic = ids.contiguous();
  const int64_t* id = ic.data_ptr<int64_t>();
  const at::BFloat16 *xp = xc.data_ptr<at::BFloat16>(), *wp = wc.data_ptr<at::BFloat16>();
  std::vector<int64_t> start(E + 2, 0);   // counting sort of the choices by expert: start[e + 1] = rows before e's
  for (int64_t i = 0; i < T * k; i++) {
    TORCH_CHECK(id[i] >= 0 && id[i] <= E, "routed_experts: an expert id outside [0, E]");
    if (id[i] < E) start[id[i] + 2]++;   // (a choice held elsewhere, E, gets no row)
  }
  for (int64_t e = 0; e <= E; e++) start[e + 1] += start[e];
  const int64_t rows = start[E + 1];
  std::vector<int64_t> row_token(rows);
  std::vector<at::BFloat16> row_weight(rows);
  at::Tensor gathered = at::empty({rows, H}, x.options());
  auto* g = gathered.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < T * k; i++) {   // (tokens in order: an expert's rows by token)
    if (id[i] == E) continue;
    const int64_t r = start[id[i] + 1]++, t = i / k;
    row_token[r] = t;
    row_weight[r] = wp[i];
    std::copy_n(xp + t * H, H, g + r * H);
  }   // (now start[e]: e's first row)
  at::Tensor gate_up = at::empty({rows, 2 * I}, x.options()), y = at::empty({rows, H}, x.options());
  for (int64_t e = 0; e < E; e++) {
    if (start[e + 1] == start[e]) continue;
    at::Tensor part = gate_up.slice(0, start[e], start[e + 1]);
    bf16_linear_into(gathered.slice(0, start[e], start[e + 1]), w13[e], part);
  }
  const at::Tensor hidden = at::silu(gate_up.slice(1, 0, I)) * gate_up.slice(1, I, 2 * I);
  for (int64_t e = 0; e < E; e++) {
    if (start[e + 1] == start[e]) continue;
    at::Tensor part = y.slice(0, start[e], start[e + 1]);
    bf16_linear_into(hidden.slice(0, start[e], start[e + 1]), w2.select(1, e), part);
  }
  at::Tensor sums = at::full({T, H}, -0.0f, x.options().dtype(at::kFloat));   // (-0 + a = a for every a)
  add_weighted(y.data_ptr<at::BFloat16>(), row_weight.data(), row_token.data(), rows, sums.data_ptr<float>(), H);
  for (int64_t i = 0; i < T * k; i++)   // a choice held elsewhere: a zero term, last (E sorts last)
    if (id[i] == E) sums[i / k].add_(0.0);
  at::Tensor out = at::empty({T, H}, x.options());
  round_sums(sums.data_ptr<float>(), out.data_ptr<at::BFloat16>(), T * H);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtpserve_cpu, m) {
  m.def("routed_experts(Tensor x, Tensor weights, Tensor ids, Tensor w13, Tensor w2) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtpserve_cpu, CPU, m) {
  m.impl("routed_experts", &routed_experts);
}
