// AVX-512 pieces shared by fused_ops.cpp (SiLU-and-mul as its own op) and amx_linear.cpp (SiLU-and-mul
// in the gate/up projection's epilogue), so that both round and compute exactly alike: c10's bf16
// rounding on 16 lanes, the SiLU exp, and SiLU-and-mul itself; and the bf16 pairs the de-quantized
// GGUF weights are multiplied in (quant_packed.h, quant_gemm.cpp). Both files compile it with
// fp-contract off (no mul+add turned into an fma), as fused_ops.cpp's scalar loops need.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <limits>

#include "cephes_exp.h"

namespace kvtop_simd {

// c10::BFloat16's rounding (Elem<c10::BFloat16>::rounded_bits) on 16 lanes: nearest even, a NaN made
// the one quiet NaN.
inline __m512i bf16_rounded_bits(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                     _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
}

// 16 lanes rounded to bf16 bits. VCVTNEPS2BF16 rounds as c10 does except that it flushes denormals
// and keeps a NaN's sign and payload: a vector holding either takes the integer path.
inline __m256i bf16_pack(__m512 f) {
#if defined(__AVX512BF16__)
  if (_mm512_fpclass_ps_mask(f, 0x01 | 0x20 | 0x80) == 0)  // no quiet NaN, denormal, signalling NaN
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f));
#endif
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(f), 16));
}

// 16 bf16 values widened to floats (exact).
inline __m512 bf16_widen(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

// 16 lanes rounded to the nearest bf16, kept as floats.
inline __m512 bf16_round(__m512 v) { return bf16_widen(bf16_pack(v)); }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Two rows of 16 columns' values (K elements 2i and 2i + 1) as one row of bf16 pairs, column c's at
// words 2c and 2c + 1 — the operand VDPBF16PS and AMX's B tiles take — rounded to nearest even
// (normal values: the de-quantized weights these pair are never denormal).
inline __m512i bf16_pairs16(__m512 even, __m512 odd) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // word 2c + e: 16e + c
  const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));  // 16 even, then 16 odd
  return _mm512_permutexvar_epi16(interleave, halves);
}
#endif

// exp(x) in fp32 by cephes_exp.h on 16 lanes: x clamped to [-86, 88.7], 2^n applied in one step,
// inf above 88.72283 (fused_ops.cpp's scalar exp_fp32 lane for lane).
inline __m512 exp_fp32_16(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-86.f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(kvtop_exp::kLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  return _mm512_mask_mov_ps(kvtop_exp::scaled16(xc, n), _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283f), _CMP_GT_OQ),
                            _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

// silu(g) * u before its final rounding: g / (1 + exp(-g)) with the division as a reciprocal refined
// by one Newton step (within an fp32 ulp or so), silu's own result rounded to bf16 first when
// ROUND_SILU (torch's bf16 `F.silu(gate)` is a bf16 tensor of its own).
template <bool ROUND_SILU>
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 d = _mm512_add_ps(one, exp_fp32_16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  __m512 rc = _mm512_rcp14_ps(d);
  rc = _mm512_fmadd_ps(rc, _mm512_fnmadd_ps(d, rc, one), rc);  // one Newton step: 2^-14 -> ~2^-28
  rc = _mm512_mask_mov_ps(rc, _mm512_cmp_ps_mask(d, _mm512_set1_ps(std::numeric_limits<float>::infinity()), _CMP_EQ_OQ),
                          _mm512_setzero_ps());
  __m512 s = _mm512_mul_ps(g, rc);
  if constexpr (ROUND_SILU) s = bf16_round(s);
  return _mm512_mul_ps(s, u);
}

}  // namespace kvtop_simd
#endif
