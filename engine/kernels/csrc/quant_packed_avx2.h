// The packed layout (quant_packed.h) multiplied with AVX2 + FMA + F16C: a CPU without AVX-512 (AMD Zen
// 3, CI's machine) packs the same tiles and reads them half a tile — 8 columns, one 8-lane register —
// at a time. Half h of a tile is its columns 8h .. 8h + 7: the second 32 bytes of each 64-byte group of
// Q4 nibble dwords, bytes 16h .. 16h + 15 of each Q8_0 row, lanes 8h .. of the per-column fields.
//
// Why: on the file's layout (quant_gemm.cpp) every call past the decode rows de-quantizes each
// column's blocks and transposes them into K-major panels — shuffles, on one port of Intel's cores —
// and a batched decode step pays it for every weight (64 rows: 0.79× the fp32 panels' time). Here a
// register's 8 lanes are 8 columns' values of one K: a shift, a mask and a conversion make them, no
// transpose. Decode rows multiply them as quant_packed.cpp's 16-lane kernel does.
// Included by quant_packed.cpp only, where KVTOP_QUANT_PACKING holds without KVTOP_QUANT_PACKED.
#pragma once

#include <cstdint>
#include <cstring>

#include "quant_packed.h"

namespace kvtop_packed::avx2 {

using kvtop_quant::kBlock;
using kvtop_quant::kQ4_0;
using kvtop_quant::kQ4_1;
using kvtop_quant::kQ5_0;
using kvtop_quant::kQ6_K;
using kvtop_quant::kQ8_0;
using kvtop_quant::zero_point;

constexpr int64_t kHalf = 8;  // columns per half tile: one register's lanes

// A sub-block of 32 K values of a half tile: its values (the tile's: a half's bytes are found by the
// readers below) and, per column, w = d * q + m (quant_packed.h's Sub, in 8 lanes).
struct Half {
  const uint8_t* values;
  __m256 d, m, d2;
};

inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Q4_K sub-block j's 6-bit scales and mins of 8 columns (`rows`: the 12 rows of 16, at the half's
// first column), as quant_packed.h's q4k_scales.
inline void q4k_scales8(const uint8_t* rows, int64_t j, __m256i& sc, __m256i& mn) {
  auto row = [&](int64_t r) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows + 16 * r))); };
  const __m256i low6 = _mm256_set1_epi32(63), low4 = _mm256_set1_epi32(15);
  if (j < 4) {
    sc = _mm256_and_si256(row(j), low6);
    mn = _mm256_and_si256(row(j + 4), low6);
  } else {
    const __m256i both = row(j + 4);
    sc = _mm256_or_si256(_mm256_and_si256(both, low4), _mm256_slli_epi32(_mm256_srli_epi32(row(j - 4), 6), 4));
    mn = _mm256_or_si256(_mm256_srli_epi32(both, 4), _mm256_slli_epi32(_mm256_srli_epi32(row(j), 6), 4));
  }
}

// Sub-block b (of the row's nb) of half h of tile t of packed weight w in format F.
template <int64_t F>
inline Half half_sub(const uint8_t* w, int64_t t, int64_t b, int64_t nb, int64_t h) {
  constexpr int64_t kG = kvtop_quant::group_blocks(F);
  const int64_t group_bytes = kTile * kvtop_quant::group_bytes(F), c = kHalf * h;
  const uint8_t* g = w + (t * (nb / kG) + b / kG) * group_bytes;
  if constexpr (F == kQ6_K) {
    const int64_t j = b % kG;
    const __m256 d = halves8(g + 2 * c);
    auto scale = [&](int64_t r) {
      return _mm256_mul_ps(
          d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + 32 + 16 * r + c)))));
    };
    return {g + 288 + 384 * j, scale(2 * j), _mm256_setzero_ps(), scale(2 * j + 1)};
  } else if constexpr (k_quant_format(F)) {
    const int64_t j = b % kG;
    __m256i sc, mn;
    q4k_scales8(g + 64 + c, j, sc, mn);
    const __m256 d = _mm256_mul_ps(halves8(g + 2 * c), _mm256_cvtepi32_ps(sc));
    const __m256 min = _mm256_mul_ps(halves8(g + 32 + 2 * c), _mm256_cvtepi32_ps(mn));
    return {g + 256 + k_sub_bytes(F) * j, d, _mm256_xor_ps(min, _mm256_set1_ps(-0.0f)), d};  // m = -min
  } else if constexpr (F == kQ8_0) {
    const __m256 d = halves8(g + 2 * c);
    return {g + 32, d, _mm256_setzero_ps(), d};
  } else {
    const __m256 d = halves8(g + 2 * c);  // m: Q4_0's -8 d, Q5_0's -16 d (their offset terms)
    const __m256 m = kvtop_quant::stores_offset(F) ? halves8(g + 32 + 2 * c) : _mm256_mul_ps(d, _mm256_set1_ps(-zero_point(F)));
    return {g + q4_scale_bytes(F), d, m, d};
  }
}

// The nibble dwords of group g (elements 8g .. 8g + 7) of half h's 8 columns.
inline __m256i q4_group(const uint8_t* values, int g, int64_t h) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 64 * g + 32 * h));
}

// Element 8g + i of those dwords as floats 0..15.
inline __m256 q4_element(__m256i group, int i) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(group, 4 * i), _mm256_set1_epi32(15)));
}

// Element k (0..31) of a Q4, Q5 or Q6_K sub-block for half h's 8 columns, as floats (quant_packed.h's
// packed_q: Q5's its low 4 bits + 16 * its high bit; Q6_K's q - 32 = its low 4 bits + 16 * its high 2
// bits - 32, all exact in fp32).
template <int64_t F>
inline __m256 half_q(const Half& s, int k, int64_t h) {
  const __m256 low = q4_element(q4_group(s.values, k / 8, h), k % 8);
  if constexpr (q5_format(F)) {
    const __m256i bit = _mm256_and_si256(_mm256_srli_epi32(q4_group(s.values + 256, 0, h), q5_high_bit(k)), _mm256_set1_epi32(1));
    return _mm256_add_ps(low, _mm256_mul_ps(_mm256_cvtepi32_ps(bit), _mm256_set1_ps(16.0f)));
  }
  if constexpr (F != kQ6_K) return low;
  const __m256i group = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.values + 256 + 64 * (k / 16) + 32 * h));
  const __m256i bits = _mm256_and_si256(_mm256_srli_epi32(group, q6k_high_bit(k % 16)), _mm256_set1_epi32(3));
  const __m256 high = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(bits), _mm256_set1_ps(16.0f)), _mm256_set1_ps(32.0f));
  return _mm256_add_ps(low, high);
}

// The reference's value of element k for the half's 8 columns (quant_packed.h's packed_weight).
template <int64_t F>
inline __m256 half_weight(const Half& s, int k, int64_t h) {
  const __m256 q = half_q<F>(s, k, h);
  if constexpr (F == kQ4_0 || F == kQ5_0) return _mm256_mul_ps(s.d, _mm256_sub_ps(q, _mm256_set1_ps(zero_point(F))));
  if constexpr (F == kQ6_K) return _mm256_mul_ps(k < 16 ? s.d : s.d2, q);
  return _mm256_add_ps(_mm256_mul_ps(s.d, q), s.m);
}

// Row r of a Q8_0 sub-block for half h, widened: lanes (column, parity) = element 2r + e of the half's
// columns 0..3 (lo) and 4..7 (hi).
inline void q8_row(const uint8_t* values, int r, int64_t h, __m256& lo, __m256& hi) {
  const uint8_t* q = values + 32 * r + 16 * h;
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8))));
}

// (c0, c1, c4, c5, c2, c3, c6, c7), what hadd and shuffle_ps leave of two (column, parity) registers,
// back in column order.
inline __m256 column_order(__m256 v) { return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7)); }

// 8 fp32 results to y: as they are, or rounded to bf16 (nearest even, as torch rounds; no AVX512-BF16).
inline void store8(float* y, __m256 v) { _mm256_storeu_ps(y, v); }
inline void store8(uint16_t* y, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y),
                   _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
}

// The sum of 32 floats (a block of x: the offset term's factor).
inline float block_sum(const float* x) {
  const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}

// One block of 32 values of x as int16 (quant_packed.h's RowsI16: the pairs' order, int16_scale's
// scale; quant_packed.cpp's quantize_block in 8 lanes).
template <int64_t F>
inline void quantize_block(const float* x, int16_t* out, float& scale) {
  __m256 v[4], amax = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  float inv;
  int16_scale(_mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1))), _mm256_movemask_ps(unordered) != 0, scale, inv);
  const __m256 iv = _mm256_set1_ps(inv);
  // each 128-bit lane of a packed pair holds 8 consecutive values: Q4's order is a shuffle within it
  const __m256i q4_order = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                            0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  for (int i = 0; i < 2; ++i) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * i], iv)), b = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * i + 1], iv));
    __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // values 16i .. 16i + 15 in order
    if constexpr (F != kQ8_0) words = _mm256_shuffle_epi8(words, q4_order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * i), words);
  }
}

// Q4 (and Q5) half h of tile t for rows [0, R) (quant_packed.cpp's q4_tile_rows in 8 lanes): a dword's
// nibbles j and j + 4, masked into its words (Q5: their high bits at bit 4), times an x pair
// (vpmaddwd), summed exactly in int32 a block, then scaled once (d times x's scale); the offset term
// through x's fp32 block sums (xsum [R, nb]).
template <int64_t F, typename T, int R>
void q4_half_rows(const RowsI16& x, int64_t k, const float* xsum, const uint8_t* w, int64_t t, int64_t h, int64_t nb,
                  const float* bias, T* y, int64_t ldy) {
  const __m256i low4 = _mm256_set1_epi32(0x000F000F), bit4 = _mm256_set1_epi32(0x00100010);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Half s = half_sub<F>(w, t, b, nb, h);
    if (h == 0) prefetch_block<F>(s.values);
    __m256i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i group = q4_group(s.values, g, h);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m256i q = _mm256_and_si256(j == 0 ? group : _mm256_srli_epi32(group, 4 * j), low4);
        if constexpr (q5_format(F)) {  // the pair's high bits (quant_packed.h's q5_high_bit) to bits 4 and 20
          const int p = 4 * g + j;
          const __m256i plane = q4_group(s.values + 256, 0, h);
          const __m256i bits = p >= 4 ? _mm256_srli_epi32(plane, p - 4) : _mm256_slli_epi32(plane, 4 - p);
          q = _mm256_or_si256(q, _mm256_and_si256(bits, bit4));
        }
        for (int r = 0; r < R; ++r) {
          const __m256i pair = _mm256_set1_epi32(x.pairs[(r * k + b * kBlock) / 2 + 4 * g + j]);
          sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(q, pair));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_mul_ps(s.d, _mm256_set1_ps(x.scale[r * nb + b]));
      acc[r] = _mm256_fmadd_ps(s.m, _mm256_set1_ps(xsum[r * nb + b]), _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), d, acc[r]));
    }
  }
  const __m256 bv = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) store8(y + r * ldy, _mm256_add_ps(acc[r], bv));
}

// Q6_K on int16 rows, half h of tile t (quant_packed.cpp's q6k_tile_rows in 8 lanes): a word is its
// value's low nibble | its high 2 bits << 4, the pairs as Q4's; each 16 values' sum, less 32 times
// their int16 sum, scaled by its own d.
template <typename T, int R>
void q6k_half_rows(const RowsI16& x, int64_t k, const uint8_t* w, int64_t t, int64_t h, int64_t nb, const float* bias,
                   T* y, int64_t ldy) {
  const __m256i low4 = _mm256_set1_epi32(0x000F000F), high2 = _mm256_set1_epi32(0x00300030);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Half s = half_sub<kQ6_K>(w, t, b, nb, h);
    if (h == 0) prefetch_block<kQ6_K>(s.values);
    __m256i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
    for (int part = 0; part < 2; ++part) {  // values 16 part .. 16 part + 15: groups 2 part, 2 part + 1
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.values + 256 + 64 * part + 32 * h));
      for (int u = 0; u < 2; ++u) {
        const int g = 2 * part + u;
        const __m256i group = q4_group(s.values, g, h);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const int at = q6k_high_bit(8 * u + j) - 4;
          const __m256i hi = at >= 0 ? _mm256_srli_epi32(high, at) : _mm256_slli_epi32(high, -at);
          const __m256i lo = _mm256_and_si256(j == 0 ? group : _mm256_srli_epi32(group, 4 * j), low4);
          const __m256i q = _mm256_or_si256(lo, _mm256_and_si256(hi, high2));
          for (int r = 0; r < R; ++r) {
            const __m256i pair = _mm256_set1_epi32(x.pairs[(r * k + b * kBlock) / 2 + 4 * g + j]);
            sum[r][part] = _mm256_add_epi32(sum[r][part], _mm256_madd_epi16(q, pair));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(x.scale[r * nb + b]);
      const int32_t* sums = x.half_sums.data() + 2 * (r * nb + b);
      const __m256i q0 = _mm256_sub_epi32(sum[r][0], _mm256_set1_epi32(32 * sums[0]));
      const __m256i q1 = _mm256_sub_epi32(sum[r][1], _mm256_set1_epi32(32 * sums[1]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), _mm256_mul_ps(s.d, scale), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), _mm256_mul_ps(s.d2, scale), acc[r]);
    }
  }
  const __m256 bv = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) store8(y + r * ldy, _mm256_add_ps(acc[r], bv));
}

// Q8_0 half h of tile t for rows [0, R) (quant_packed.cpp's q8_tile_rows in 8 lanes): row r of the
// half's 16 bytes widened to words is 8 columns' (element 2r, 2r + 1) pairs, which vpmaddwd multiplies
// by the x pair and sums: a lane a column.
template <typename T, int R>
void q8_half_rows(const RowsI16& x, int64_t k, const uint8_t* w, int64_t t, int64_t h, int64_t nb, const float* bias,
                  T* y, int64_t ldy) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Half s = half_sub<kQ8_0>(w, t, b, nb, h);
    if (h == 0) prefetch_block<kQ8_0>(s.values);
    __m256i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int row = 0; row < 16; ++row) {
      const __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.values + 32 * row + 16 * h)));
      for (int r = 0; r < R; ++r)
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(q, _mm256_set1_epi32(x.pairs[(r * k + b * kBlock) / 2 + row])));
    }
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(s.d, _mm256_set1_ps(x.scale[r * nb + b])), acc[r]);
  }
  const __m256 bv = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) store8(y + r * ldy, _mm256_add_ps(acc[r], bv));
}
// Tile t's 16 columns as fp32 panel rows (quant_packed.cpp's panel_rows): seg [K, width] at the tile's
// first column, row k holding the reference's value of element k, half by half.
template <int64_t F>
void panel_rows(const uint8_t* w, int64_t t, int64_t nb, int64_t width, float* seg) {
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t h = 0; h < 2; ++h) {
      const Half s = half_sub<F>(w, t, b, nb, h);
      if (h == 0) prefetch_block<F>(s.values);
      float* rows = seg + b * kBlock * width + kHalf * h;
      if constexpr (F == kQ8_0) {
        for (int r = 0; r < 16; ++r) {  // (column, parity) lanes: even and odd into rows 2r, 2r + 1
          __m256 lo, hi;
          q8_row(s.values, r, h, lo, hi);
          const __m256 even = column_order(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)));
          const __m256 odd = column_order(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
          _mm256_storeu_ps(rows + (2 * r) * width, _mm256_mul_ps(s.d, even));
          _mm256_storeu_ps(rows + (2 * r + 1) * width, _mm256_mul_ps(s.d, odd));
        }
      } else {
        for (int e = 0; e < kBlock; ++e) _mm256_storeu_ps(rows + e * width, half_weight<F>(s, e, h));
      }
    }
  }
}

}  // namespace kvtop_packed::avx2
