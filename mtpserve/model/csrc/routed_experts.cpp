// A MoE layer's routed experts, each expert once on the tokens that chose it (model/moe.py, `_grouped` in one op):
//     x [T, H], weights [T, k], ids [T, k] (an id of E: an expert held elsewhere, skipped)
//     w13 [E, 2I, H] (an expert's gate rows, then its up rows), w2 [H, E, I] (w2[:, e]: expert e's down projection)
//     bf16: x, weights and experts bf16 (bf16_linear); int8 experts (routed_int8_experts): w13 and w2 int8
//     with their bf16 scales s13 [E, 2I], s2 [H, E] (int8_linear); fp32: all fp32, each expert's weights stored
//     by columns, multiplied as layers.linear does (the column kernel up to few_rows rows, ATen's linear above)
// [t0: e1 e5] [t1: e2 e5] -> rows e1:t0 | e2:t1 | e5:t0 e5:t1, gathered in expert order, then per expert
//     y = (silu(rows @ gate.T) * (rows @ up.T)) @ down.T        (ATen's silu and mul: eager mode's bits)
// and out[t] = the fp32 sum, in expert id order, of (y * weight) in x's dtype over t's choices, rounded once to x's
// dtype: the bits of `_grouped` and of every other path of a token's experts.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <optional>
#include <type_traits>
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

AVX512_BF16 inline __m512 load16(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }

// sums[t] += Scalar(y[r] * weight[r]) for each row r of the experts' outputs, t its token (rows in expert order: a
// token's terms in expert id order)
template <typename Scalar>
AVX512_BF16 void add_weighted(const Scalar* y, const Scalar* row_weight, const int64_t* row_token, int64_t rows,
                              float* sums, int64_t H) {
  for (int64_t r = 0; r < rows; r++) {
    const __m512 w = _mm512_set1_ps(static_cast<float>(row_weight[r]));
    float* sum = sums + row_token[r] * H;
    for (int64_t h = 0; h < H; h += 16) {
      const __mmask16 lanes = first(H - h);
      __m512 term = _mm512_mul_ps(load16(y + r * H + h, lanes), w);
      if constexpr (std::is_same_v<Scalar, at::BFloat16>) term = round_bf16(term);
      __asm__("" : "+v"(term));   // (the product rounded on its own, as PyTorch's: no FMA with the sum)
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

// y[first..first+n) = x[first..first+n) @ w_e.T for expert e, w_e = w.select(dim, e) [N, K] (x and y contiguous), as
// layers.linear multiplies: bf16, or int8 with its scales' select(dim, e), from pointers (no tensor made per expert);
// fp32 (w_e stored by columns) by the column kernel up to few_rows rows of x, ATen's linear above
template <typename Scalar>
void expert_product(const at::Tensor& x, const at::Tensor& w, int64_t dim, int64_t e,
                    const std::optional<at::Tensor>& scale, at::Tensor& y, int64_t first, int64_t n, int64_t few_rows) {
  if (n == 0) return;
  const int64_t K = x.size(1), N = y.size(1);
  if constexpr (std::is_same_v<Scalar, at::BFloat16>) {
    TORCH_CHECK(w.stride(2) == 1, "routed_experts: expert rows must be contiguous");
    const Scalar* xe = x.data_ptr<Scalar>() + first * K;
    Scalar* ye = y.data_ptr<Scalar>() + first * N;
    if (scale)
      int8_rows_into(xe, w.data_ptr<int8_t>() + e * w.stride(dim), w.stride(1 - dim),
                     scale->data_ptr<Scalar>() + e * scale->stride(dim), scale->stride(1 - dim), ye, n, N, K);
    else
      bf16_rows_into(xe, w.data_ptr<Scalar>() + e * w.stride(dim), w.stride(1 - dim), ye, n, N, K);
    return;
  }
  const at::Tensor xe = x.slice(0, first, first + n), we = w.select(dim, e);
  at::Tensor ye = y.slice(0, first, first + n);
  if (we.stride(0) == 1 && n <= few_rows) fp32_columns_linear_into(xe, we.t(), ye);
  else ye.copy_(at::linear(xe, we));
}

template <typename Scalar>
at::Tensor routed(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
                  const at::Tensor& w2, const std::optional<at::Tensor>& s13, const std::optional<at::Tensor>& s2,
                  int64_t few_rows) {
  const int64_t T = x.size(0), k = ids.size(1), E = w13.size(0), H = x.size(1), I = w2.size(2);
  const at::Tensor xc = x.contiguous(), wc = weights.contiguous(), ic = ids.contiguous();
  const int64_t* id = ic.data_ptr<int64_t>();
  const Scalar *xp = xc.data_ptr<Scalar>(), *wp = wc.data_ptr<Scalar>();
  std::vector<int64_t> start(E + 2, 0);   // counting sort of the choices by expert: start[e + 1] = rows before e's
  for (int64_t i = 0; i < T * k; i++) {
    TORCH_CHECK(id[i] >= 0 && id[i] <= E, "routed_experts: an expert id outside [0, E]");
    if (id[i] < E) start[id[i] + 2]++;   // (a choice held elsewhere, E, gets no row)
  }
  for (int64_t e = 0; e <= E; e++) start[e + 1] += start[e];
  const int64_t rows = start[E + 1];
  std::vector<int64_t> row_token(rows);
  std::vector<Scalar> row_weight(rows);
  at::Tensor gathered = at::empty({rows, H}, x.options());
  Scalar* g = gathered.data_ptr<Scalar>();
  for (int64_t i = 0; i < T * k; i++) {   // (tokens in order: an expert's rows by token)
    if (id[i] == E) continue;
    const int64_t r = start[id[i] + 1]++, t = i / k;
    row_token[r] = t;
    row_weight[r] = wp[i];
    std::copy_n(xp + t * H, H, g + r * H);
  }   // (now start[e]: e's first row)
  at::Tensor gate_up = at::empty({rows, 2 * I}, x.options()), y = at::empty({rows, H}, x.options());
  for (int64_t e = 0; e < E; e++)
    expert_product<Scalar>(gathered, w13, 0, e, s13, gate_up, start[e], start[e + 1] - start[e], few_rows);
  const at::Tensor hidden = at::silu(gate_up.slice(1, 0, I)) * gate_up.slice(1, I, 2 * I);
  for (int64_t e = 0; e < E; e++)
    expert_product<Scalar>(hidden, w2, 1, e, s2, y, start[e], start[e + 1] - start[e], few_rows);
  at::Tensor sums = at::full({T, H}, -0.0f, x.options().dtype(at::kFloat));   // (-0 + a = a for every a)
  add_weighted<Scalar>(y.data_ptr<Scalar>(), row_weight.data(), row_token.data(), rows, sums.data_ptr<float>(), H);
  for (int64_t i = 0; i < T * k; i++)   // a choice held elsewhere: a zero term, last (E sorts last)
    if (id[i] == E) sums[i / k].add_(0.0);
  if constexpr (std::is_same_v<Scalar, float>) return sums;
  at::Tensor out = at::empty({T, H}, x.options());
  round_sums(sums.data_ptr<float>(), out.data_ptr<at::BFloat16>(), T * H);
  return out;
}

void check(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
           const at::Tensor& w2) {
  TORCH_CHECK(x.dim() == 2 && weights.dim() == 2 && ids.sizes() == weights.sizes() && ids.size(0) == x.size(0) &&
              w13.dim() == 3 && w2.dim() == 3 && w13.size(2) == x.size(1) && w2.size(0) == x.size(1) &&
              w2.size(1) == w13.size(0) && w13.size(1) == 2 * w2.size(2),
              "routed_experts: x [T, H], weights and ids [T, k], w13 [E, 2I, H], w2 [H, E, I]");
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
              weights.scalar_type() == x.scalar_type() && ids.scalar_type() == at::kLong,
              "routed_experts: bf16 or fp32 x and weights, int64 ids");
}

at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
                          const at::Tensor& w2, int64_t few_rows) {
  check(x, weights, ids, w13, w2);
  if (x.scalar_type() == at::kFloat) return routed<float>(x, weights, ids, w13, w2, {}, {}, few_rows);
  return routed<at::BFloat16>(x, weights, ids, w13, w2, {}, {}, few_rows);
}

at::Tensor routed_int8_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                               const at::Tensor& w13, const at::Tensor& s13, const at::Tensor& w2,
                               const at::Tensor& s2) {
  check(x, weights, ids, w13, w2);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w13.scalar_type() == at::kChar && w2.scalar_type() == at::kChar &&
              s13.scalar_type() == at::kBFloat16 && s2.scalar_type() == at::kBFloat16,
              "routed_int8_experts: bf16 x and scales, int8 experts");
  TORCH_CHECK(s13.dim() == 2 && s13.size(0) == w13.size(0) && s13.size(1) == w13.size(1) && s2.dim() == 2 &&
              s2.size(0) == w2.size(0) && s2.size(1) == w2.size(1), "routed_int8_experts: s13 [E, 2I], s2 [H, E]");
  return routed<at::BFloat16>(x, weights, ids, w13, w2, s13, s2, 0);
}

}  // namespace

C_SHIM(routed_experts, (Handle x, Handle weights, Handle ids, Handle w13, Handle w2, int64_t few_rows, Handle* ret0),
       routed_experts(tensor_at(x), tensor_at(weights), tensor_at(ids), tensor_at(w13), tensor_at(w2), few_rows))
C_SHIM(routed_int8_experts,
       (Handle x, Handle weights, Handle ids, Handle w13, Handle s13, Handle w2, Handle s2, Handle* ret0),
       routed_int8_experts(tensor_at(x), tensor_at(weights), tensor_at(ids), tensor_at(w13), tensor_at(s13),
                           tensor_at(w2), tensor_at(s2)))

TORCH_LIBRARY_FRAGMENT(mtpserve_cpu, m) {
  // (every argument required: a graph's C++ calls the op with the arguments it was traced with)
  m.def("routed_experts(Tensor x, Tensor weights, Tensor ids, Tensor w13, Tensor w2, int few_rows) -> Tensor");
  m.def("routed_int8_experts(Tensor x, Tensor weights, Tensor ids, Tensor w13, Tensor s13, Tensor w2, Tensor s2) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(mtpserve_cpu, CPU, m) {
  m.impl("routed_experts", &routed_experts);
  m.impl("routed_int8_experts", &routed_int8_experts);
}
