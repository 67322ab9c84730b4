// Cephes' expf, shared by the attention softmax (paged_attention.cpp) and SiLU (fused_ops.cpp):
// n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), exp(r) by a degree-6 polynomial on
// |r| <= ln 2 / 2; the caller scales by 2^n from the exponent bits and chooses its own clamps.
// Within 2 ulp of expf, and unlike a call to expf it vectorizes (with -fno-trapping-math).
#pragma once

#include <cmath>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvtop_exp {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;  // r = x - n * kLn2Hi + n * kLn2Lo
constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// n for x (already clamped): the power of two exp(x) is scaled by.
inline float exponent(float x) { return std::floor(x * kLog2e + 0.5f); }

// exp(x - n ln 2), |x - n ln 2| <= ln 2 / 2.
inline float reduced(float x, float n) {
  const float r = x - n * kLn2Hi + n * kLn2Lo;
  float p = kPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kPoly[i];
  return p * r * r + r + 1.f;
}

#if defined(__AVX512F__)
// exp(x) = exp(x - n ln 2) * 2^n on 16 lanes, n given: the polynomial above, with fma.
inline __m512 scaled16(__m512 x, __m512 n) {
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kPoly[i]));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(e, n);  // e * 2^n in one instruction
}

// exp(x) for x <= 0 on 16 lanes (below -87 it gives exp(-87)): the softmax of paged_attention.cpp
// and of amx_attention.cpp.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  return scaled16(x, _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

}  // namespace kvtop_exp
