// Fused element-wise ops of the decoder layer on the CPU: RMSNorm (alone, and after the residual
// add), RoPE (neox style, in place on q and k), SiLU-and-mul, and the KV store. Each makes one
// pass over its rows where the torch code (engine/kernels/reference.py, the oracle) makes several,
// and rounds where torch's ops round: arithmetic in fp32, and for bfloat16 every intermediate that torch
// stores as a bf16 tensor rounded to bf16 (nearest even) at the same point. float32 and bfloat16;
// engine/kernels/cpu.py sends other dtypes to the reference.
//
// Built into the same extension as paged_attention.cpp (which holds TORCH_LIBRARY(kvtop_cpu)).
// Plain omp-simd loops over bit-level bf16 conversions: gcc vectorizes them for whatever
// -march=native offers (AVX-512 or AVX2), so there is one path and no intrinsics.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>

// No a*b + c*d into fma: torch rounds each product and the sum, and RoPE in fp32 then matches it
// bit for bit. (After the includes: only this file's functions.)
#pragma GCC optimize("fp-contract=off")
#include "cephes_exp.h"  // after the pragma: its polynomial is compiled as this file's own was
#include "bf16_simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGrainElements = 16384;  // per parallel chunk: below this a thread costs more than it saves

// Element access by storage type: float as is, bfloat16 as its 16 bits (shifts vectorize; c10's
// conversions do not always).
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  using Bits = float;
  static float get(float v) { return v; }
  static float put(float f) { return f; }
  static float round(float f) { return f; }
};

template <>
struct Elem<c10::BFloat16> {
  using Bits = uint16_t;
  static float get(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }
  // round to nearest even, NaN kept quiet: c10::BFloat16's own rule
  static uint32_t rounded_bits(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : r;
  }
  static uint16_t put(float f) { return static_cast<uint16_t>(rounded_bits(f) >> 16); }
  static float round(float f) { return std::bit_cast<float>(rounded_bits(f)); }
};

// Rows of a tensor whose last dim is contiguous: row r of [A, B, H] (or [A, H]) starts at
// (r / B) * s0 + (r % B) * s1, so views such as qkv.split's q need no copy.
struct Rows {
  int64_t count, width, inner, s0, s1;

  explicit Rows(const at::Tensor& t) : width(t.size(-1)), inner(1), s0(0), s1(0) {
    TORCH_CHECK(t.dim() == 2 || t.dim() == 3, "expected a 2-d or 3-d tensor, got ", t.dim(), " dims");
    TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, "the last dim must be contiguous");
    s0 = t.stride(0);
    if (t.dim() == 3) std::tie(inner, s1) = std::make_tuple(t.size(1), t.stride(1));
    count = t.size(0) * inner;
  }
  int64_t offset(int64_t r) const { return (r / inner) * s0 + (r % inner) * s1; }
};

int64_t grain(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1)); }

template <typename T>
using Bits = typename Elem<T>::Bits;

#if defined(__AVX512F__)
// The norms' and RoPE's rows in intrinsics (issue #13): gcc vectorized the loops below, but with
// c10's rounding spelled in integer ops they ran at 4-6x the time of a copy of the same bytes, and
// the norms and RoPE took 12 % of a 2,048-token bf16 prefill step. Same arithmetic, same rounding.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return kvtop_simd::bf16_widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

using kvtop_simd::bf16_pack;

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_pack(v)); }

// Elem<T>::round on 16 lanes: bf16 rounds to the nearest bf16 (as a float), float is left as is.
inline __m512 round16(__m512 v, float) { return v; }
inline __m512 round16(__m512 v, uint16_t) { return kvtop_simd::bf16_round(v); }

// norm_row's second loop, columns [0, h - h % 16): out = w * round(x * r). Returns where it stopped.
template <typename B>
int64_t scale_row16(const B* x, const B* w, B* out, int64_t h, float r) {
  const __m512 rv = _mm512_set1_ps(r);
  int64_t i = 0;
  for (; i + 16 <= h; i += 16) store16(out + i, _mm512_mul_ps(load16(w + i), round16(_mm512_mul_ps(load16(x + i), rv), B{})));
  return i;
}

// res = round(res + x) in place over columns [0, h - h % 16), and the sum of the rounded squares.
template <typename B>
int64_t add_row16(const B* x, B* res, int64_t h, float& ss) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= h; i += 16) {
    const __m512 sum = round16(_mm512_add_ps(load16(res + i), load16(x + i)), B{});
    store16(res + i, sum);
    acc = _mm512_fmadd_ps(sum, sum, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
  return i;
}

// rope_row over i in [0, half - half % 16).
template <typename B>
int64_t rope_row16(B* x, const B* c, const B* s, int64_t half) {
  B* hi = x + half;
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = load16(x + i), x2 = load16(hi + i);
    const __m512 a1 = round16(_mm512_mul_ps(x1, load16(c + i)), B{});
    const __m512 neg_x2 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32(INT32_MIN)));
    const __m512 b1 = round16(_mm512_mul_ps(neg_x2, load16(s + i)), B{});  // -x2 as the scalar loop: -0 stays -0
    const __m512 a2 = round16(_mm512_mul_ps(x2, load16(c + half + i)), B{});
    const __m512 b2 = round16(_mm512_mul_ps(x1, load16(s + half + i)), B{});
    store16(x + i, _mm512_add_ps(a1, b1));
    store16(hi + i, _mm512_add_ps(a2, b2));
  }
  return i;
}
#endif

// The sum of x's squares over columns [0, h), 16 lanes at a time where AVX-512 is there.
template <typename T>
float sum_squares(const Bits<T>* x, int64_t h) {
  using E = Elem<T>;
  int64_t i = 0;
  float ss = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= h; i += 16) {
    const __m512 f = load16(x + i);
    acc = _mm512_fmadd_ps(f, f, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; i < h; ++i) ss += E::get(x[i]) * E::get(x[i]);
  return ss;
}

// out = w * round(x * r) over columns [0, h): the normalized row times the weight.
template <typename T>
void scale_row(const Bits<T>* x, const Bits<T>* w, Bits<T>* out, int64_t h, float r) {
  using E = Elem<T>;
  int64_t i = 0;
#if defined(__AVX512F__)
  i = scale_row16(x, w, out, h, r);
#endif
  for (; i < h; ++i) out[i] = E::put(E::get(w[i]) * E::round(E::get(x[i]) * r));
}

// out = weight * round(x * rsqrt(mean(x^2) + eps)): torch's `weight * (xf * rsqrt(...)).to(dtype)`.
template <typename T>
void norm_row(const Bits<T>* x, const Bits<T>* w, Bits<T>* out, int64_t h, float eps) {
  const float r = 1.f / std::sqrt(sum_squares<T>(x, h) / static_cast<float>(h) + eps);
  scale_row<T>(x, w, out, h, r);
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, float eps) {
  const Rows rows(x);
  const int64_t h = rows.width;
  const auto* xp = static_cast<const Bits<T>*>(x.data_ptr());
  const auto* wp = static_cast<const Bits<T>*>(weight.data_ptr());
  auto* op = static_cast<Bits<T>*>(out.data_ptr());
  at::parallel_for(0, rows.count, grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row<T>(xp + rows.offset(r), wp, op + r * h, h, eps);
  });
}

// residual = round(residual + x) in place (torch's bf16 add), then out = norm(residual).
template <typename T>
void fused_add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                             at::Tensor& out, float eps) {
  using E = Elem<T>;
  const Rows xr(x), rr(residual);
  const int64_t h = xr.width;
  const auto* xp = static_cast<const Bits<T>*>(x.data_ptr());
  auto* rp = static_cast<Bits<T>*>(residual.data_ptr());
  const auto* wp = static_cast<const Bits<T>*>(weight.data_ptr());
  auto* op = static_cast<Bits<T>*>(out.data_ptr());
  at::parallel_for(0, xr.count, grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Bits<T>* xs = xp + xr.offset(r);
      Bits<T>* res = rp + rr.offset(r);
      int64_t i = 0;
      float ss = 0.f;
#if defined(__AVX512F__)
      i = add_row16(xs, res, h, ss);  // the add and the squares in one pass
#endif
      for (; i < h; ++i) {
        res[i] = E::put(E::get(res[i]) + E::get(xs[i]));
        ss += E::get(res[i]) * E::get(res[i]);
      }
      scale_row<T>(res, wp, op + r * h, h, 1.f / std::sqrt(ss / static_cast<float>(h) + eps));
    }
  });
}

// One head row in place, neox style: out = round(round(x * cos) + round(rotate_half(x) * sin)),
// rotate_half(x) = (-x2, x1). Iteration i touches only x[i] and x[i + half]: no dependence.
template <typename T>
void rope_row(Bits<T>* x, const Bits<T>* c, const Bits<T>* s, int64_t half) {
  using E = Elem<T>;
  Bits<T>* hi = x + half;
  int64_t start = 0;
#if defined(__AVX512F__)
  start = rope_row16(x, c, s, half);
#endif
#pragma omp simd
  for (int64_t i = start; i < half; ++i) {
    const float x1 = E::get(x[i]), x2 = E::get(hi[i]);
    const float a1 = E::round(x1 * E::get(c[i])), b1 = E::round(-x2 * E::get(s[i]));
    const float a2 = E::round(x2 * E::get(c[i + half])), b2 = E::round(x1 * E::get(s[i + half]));
    x[i] = E::put(a1 + b1);
    hi[i] = E::put(a2 + b2);
  }
}

template <typename T>
void rope_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const Rows qr(q), kr(k);
  const int64_t tokens = q.size(0), hq = qr.inner, hk = kr.inner, per_token = hq + hk, half = q.size(-1) / 2;
  auto* qp = static_cast<Bits<T>*>(q.data_ptr());
  auto* kp = static_cast<Bits<T>*>(k.data_ptr());
  const auto* cp = static_cast<const Bits<T>*>(cos.data_ptr());
  const auto* sp = static_cast<const Bits<T>*>(sin.data_ptr());
  const int64_t cs = cos.stride(0), ss = sin.stride(0);
  // by token, each token's head rows found by strides (a division per row cost as much as its RoPE)
  at::parallel_for(0, tokens, grain(2 * half * per_token), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t head = 0; head < hq; ++head) rope_row<T>(qp + t * qr.s0 + head * qr.s1, cp + t * cs, sp + t * ss, half);
      for (int64_t head = 0; head < hk; ++head) rope_row<T>(kp + t * kr.s0 + head * kr.s1, cp + t * cs, sp + t * ss, half);
    }
  });
}

// exp(x) in fp32 by cephes_exp.h, times 2^n built as 2^(n-1) * 2 (so n = 128 stays finite).
// exp(x < -86) gives exp(-86); above 88.72 it is inf.
inline float exp_fp32(float x) {
  const float xc = std::min(std::max(x, -86.f), 88.7f);
  const float n = kvtop_exp::exponent(xc);
  const float half_two_n = std::bit_cast<float>((static_cast<int32_t>(n) + 126) << 23);
  return x > 88.72283f ? std::numeric_limits<float>::infinity() : (kvtop_exp::reduced(xc, n) * half_two_n) * 2.f;
}

#if defined(__AVX512F__)
// SiLU-and-mul's rows in intrinsics (issue #13): what gcc made of the loop below ran at ~60 cycles per 16
// elements, 3.5x the time of a copy of the same bytes, and the op took 8-11 % of a bf16 prefill step.
// The same formula: exp_fp32 lane-wise (its clamps and overflow; fma in the polynomial), the division as
// a reciprocal refined by one Newton step (within an fp32 ulp or so), c10's rounding to bf16: bf16_simd.h's
// silu_mul16, which amx_linear.cpp's gate/up epilogue runs too.

// Columns [0, count - count % 16) of one row; returns where the scalar loop takes over.
template <typename T>
int64_t silu_and_mul_row16(const Bits<T>* g, const Bits<T>* u, Bits<T>* o, int64_t count) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16)  // silu's own bf16 tensor in torch: rounded here too (fp32: as is)
    store16(o + i, kvtop_simd::silu_mul16<std::is_same_v<T, c10::BFloat16>>(load16(g + i), load16(u + i)));
  return i;
}
#endif

// out = round(round(g / (1 + exp(-g))) * u): torch's `F.silu(gate) * up`, silu's formula included.
template <typename T>
void silu_and_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  using E = Elem<T>;
  const Rows rows(gate_up);
  const int64_t inter = rows.width / 2;
  const auto* gp = static_cast<const Bits<T>*>(gate_up.data_ptr());
  auto* op = static_cast<Bits<T>*>(out.data_ptr());
  at::parallel_for(0, rows.count, grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Bits<T>* g = gp + rows.offset(r);
      const Bits<T>* u = g + inter;
      Bits<T>* o = op + r * inter;
      int64_t start = 0;
#if defined(__AVX512F__)
      start = silu_and_mul_row16<T>(g, u, o, inter);
#endif
#pragma omp simd
      for (int64_t i = start; i < inter; ++i) {
        const float x = E::get(g[i]);
        o[i] = E::put(E::round(x / (1.f + exp_fp32(-x))) * E::get(u[i]));
      }
    }
  });
}

void check_float_or_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(!t.is_cuda(), name, " must be on the CPU");
}

void check_weight(const at::Tensor& x, const at::Tensor& weight) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must have x's dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(),
              "weight must be a contiguous vector of x's last dim");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_weight(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, weight, out, static_cast<float>(eps));
  else rms_norm_impl<c10::BFloat16>(x, weight, out, static_cast<float>(eps));
  return out;
}

at::Tensor fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_weight(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must have x's shape and dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) fused_add_rms_norm_impl<float>(x, residual, weight, out, static_cast<float>(eps));
  else fused_add_rms_norm_impl<c10::BFloat16>(x, residual, weight, out, static_cast<float>(eps));
  return out;
}

void rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_float_or_bf16(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(0) == q.size(0) && k.size(-1) == q.size(-1),
              "q [tokens, heads, dim] and k [tokens, kv_heads, dim] expected");
  TORCH_CHECK(q.size(-1) % 2 == 0, "head_dim must be even");
  for (const at::Tensor* t : {&k, &cos, &sin}) TORCH_CHECK(t->scalar_type() == q.scalar_type(), "dtypes differ");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == q.size(0) && t->size(1) == q.size(-1) && t->stride(1) == 1,
                "cos and sin must be [tokens, head_dim] with a contiguous last dim");
  }
  if (q.scalar_type() == at::kFloat) rope_impl<float>(q, k, cos, sin);
  else rope_impl<c10::BFloat16>(q, k, cos, sin);
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_float_or_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [tokens, 2 * intermediate]");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) silu_and_mul_impl<float>(gate_up, out);
  else silu_and_mul_impl<c10::BFloat16>(gate_up, out);
  return out;
}

// Greedy sampling's argmax, as torch's `x.max(dim=-1).indices`: per row the first index of its
// maximum, or of its first NaN if it holds one. torch's reduction with an index runs at ~1.3 G
// elements/s here (64 x 49,152 bf16 logits: 2.3 ms a decode step); this is one vectorized pass of
// block maxima and a scan of the one block that holds the first maximum.
constexpr int64_t kArgmaxBlock = 1024;

template <typename T>
int64_t argmax_row(const Bits<T>* x, int64_t n) {
  using E = Elem<T>;
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_block = 0;
  for (int64_t b0 = 0; b0 < n; b0 += kArgmaxBlock) {
    const int64_t b1 = std::min(n, b0 + kArgmaxBlock);
    float m = -std::numeric_limits<float>::infinity();
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = b0; i < b1; ++i) {
      const float f = E::get(x[i]);
      m = std::max(m, f);  // a NaN f leaves m as it is ...
      nan |= f != f;  // ... and is caught here
    }
    if (nan) {
      for (int64_t i = b0; i < b1; ++i) {
        if (const float f = E::get(x[i]); f != f) return i;
      }
    }
    if (m > best) std::tie(best, best_block) = std::make_tuple(m, b0);  // strictly: ties keep the earlier block
  }
  const int64_t end = std::min(n, best_block + kArgmaxBlock);
  for (int64_t i = best_block; i < end; ++i) {
    if (E::get(x[i]) == best) return i;
  }
  return best_block;  // a row of -inf: its first index, as torch
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && (x.stride(1) == 1 || x.size(1) <= 1) && x.size(1) > 0,
              "argmax_rows: x must be [rows, n > 0] with its last dim contiguous");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const bool fp32 = x.scalar_type() == at::kFloat;
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      op[r] = fp32 ? argmax_row<float>(static_cast<const float*>(x.data_ptr()) + r * stride, n)
                   : argmax_row<c10::BFloat16>(static_cast<const uint16_t*>(x.data_ptr()) + r * stride, n);
    }
  });
  return out;
}

// The reference's store_kv for a cache of k's own dtype (float32, bfloat16, float16): each token's
// [kv_heads, head_dim] rows of k and v copied into its slot, slot -1 skipped. One op where the torch
// code makes six (a mask, a sync on it, two views, two index_puts): 30 layers, every step.
void store_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2), "cache rows do not match key's");
  for (const at::Tensor* t : {&value, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == key.scalar_type(), "key, value and the caches must share a dtype");
  }
  TORCH_CHECK(!key.is_cuda() && !k_cache.is_cuda(), "store_kv: CPU tensors expected");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be int64 [tokens]");
  const int64_t tokens = key.size(0), row = key.size(1) * key.size(2), slots = k_cache.size(0) * k_cache.size(1);
  const at::Tensor slot = slot_mapping.contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= -1 && sp[t] < slots, "slot ", sp[t], " is not a slot of the cache");
  }
  // rows of one token are one run when head_dim and kv_heads are contiguous (the qkv split's views are)
  const bool runs = key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                    value.stride(1) == value.size(2);
  const at::Tensor k = runs ? key : key.contiguous(), v = runs ? value : value.contiguous();
  const int64_t bytes = row * k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  at::parallel_for(0, tokens, grain(2 * row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (sp[t] < 0) continue;
      std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
        &store_kv);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor", &fused_add_rms_norm);
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()", &rotary_embedding);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
  m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows);
}
