// The packed layout of GGUF weights (quant_packed.cpp says why and how it is multiplied): what every
// kernel that reads it shares — quant_packed.cpp's decode kernel and fp32 panels, amx_linear.cpp's
// tiles. A packed weight keeps the file's [N, row bytes] shape and bytes; rows 16t .. 16t + 15 (tile
// t) hold, for each of the file's groups along K in turn, 16 × the group's bytes:
//   Q4_0, Q4_1 (group: 32 values): d[16] fp16, (Q4_1: m[16] fp16), then the nibbles;
//   Q5_0, Q5_1 (group: 32 values): as Q4_0 and Q4_1 (a value's low 4 bits as the nibbles), then its
//     high bits (64 bytes: dword c column c's 32, element e's at q5_high_bit(e));
//   Q4_K (group: 256 values in 8 sub-blocks of 32): d[16] fp16, dmin[16] fp16, the 12 bytes of 6-bit
//     scales and mins as 12 rows of 16 (row r's byte c: column c's byte r), then 8 × 256 bytes of
//     nibbles, sub-block j's at 256 + 256 j;
//   Q5_K (group: 256 values): as Q4_K, each sub-block's nibbles followed by its high bits as Q5_0's
//     (64 bytes): sub-block j at 256 + 320 j;
//   nibbles of a sub-block: 4 groups of 64 bytes, group g's dword c holding column c's elements
//     8g .. 8g + 7, element 8g + i in bits 4i .. 4i + 3;
//   Q6_K (group: 256 values in 8 sub-blocks of 32, a scale per 16): d[16] fp16, the 16 int8 scales as
//     16 rows of 16 columns, then per sub-block j at 288 + 384 j: the low 4 bits of its values as Q4's
//     nibbles (256 bytes), then their high 2 bits (128 bytes: 2 groups of 64, group h's dword c
//     holding column c's elements 16h .. 16h + 15, element 16h + i in bits q6k_high_bit(i) .. + 1:
//     elements e and e + 4 of each 8 16 bits apart, as Q4's nibbles are, for the int16 rows' pairs);
//   Q8_0 (group: 32 values): d[16] fp16, then 16 rows of 32 bytes, row r's byte 2c + e column c's
//     element 2r + e.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "aligned_vector.h"
#include "bf16_simd.h"
#include "quant_blocks.h"

// bf16 rows: vcvtneps2bf16; decode rows: vpdpwssd (every CPU with AVX512-BF16 has VNNI)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define KVTOP_QUANT_PACKED 1  // the 16-lane kernels below, and amx_linear.cpp's tiles
#endif
#if defined(KVTOP_QUANT_PACKED) || defined(KVTOP_QUANT_GEMM)
#define KVTOP_QUANT_PACKING 1  // weights are packed and multiplied packed: 16 lanes, or AVX2's 8 (quant_packed.cpp)
#endif

namespace kvtop_packed {

constexpr int64_t kTile = 16;  // columns per tile: one fp32 register's lanes

// Q5_0, Q5_1 and Q5_K: Q4_0, Q4_1 and Q4_K with a fifth bit a value, in a 64-byte plane after each
// sub-block's nibbles.
constexpr bool q5_format(int64_t format) {
  return format == kvtop_quant::kQ5_0 || format == kvtop_quant::kQ5_1 || format == kvtop_quant::kQ5_K;
}

// Q4_K and Q5_K: 8 sub-blocks of 32 a group, each with its 6-bit scale and min.
constexpr bool k_quant_format(int64_t format) { return format == kvtop_quant::kQ4_K || format == kvtop_quant::kQ5_K; }

// The formats packed: every one the kernels run.
constexpr bool packable_format(int64_t format) {
  return format == kvtop_quant::kQ4_0 || format == kvtop_quant::kQ4_1 || format == kvtop_quant::kQ6_K ||
         format == kvtop_quant::kQ8_0 || k_quant_format(format) || q5_format(format);
}

// Bytes of a K format's sub-block in a tile: its nibbles (and Q5_K's high-bit plane).
constexpr int64_t k_sub_bytes(int64_t format) { return q5_format(format) ? 320 : 256; }

// Where element i (0..15) of a Q6_K high-bits dword keeps its 2 bits: elements 8u + v (v < 4) in the
// low word at 2(4u + v), their partners 8u + v + 4 in the high word at the same place.
constexpr int q6k_high_bit(int i) { return 16 * ((i % 8) / 4) + 2 * (4 * (i / 8) + i % 4); }

// Where element e (0..31) of a Q5 high-bits dword keeps its bit: elements 8g + j (j < 4) in the low
// word at 4g + j, their partners 8g + j + 4 in the high word at the same place — a nibble pair's two
// bits 16 apart, so that one shift and a mask put both at bit 4 of their words.
constexpr int q5_high_bit(int e) { return 16 * ((e % 8) / 4) + 4 * (e / 8) + e % 4; }

// Bytes before a Q4_0/Q4_1/Q5_0/Q5_1 group's nibbles: d[16], and m[16] for Q4_1 and Q5_1.
constexpr int64_t q4_scale_bytes(int64_t format) { return kvtop_quant::stores_offset(format) ? 64 : 32; }

#ifdef KVTOP_QUANT_PACKING
// Software prefetch of the weight stream, this many bytes ahead of the block being multiplied: a
// decode step reads each weight once, and the hardware prefetchers alone kept the 8B shape's Q4_K
// layers at ~14.5 GB/s on the Xeon; 1, 2, 4, 8, 16 KiB ahead: 21, 24, 25, 28-31, 26 GB/s (Q6_K 18 -
// 25 GB/s, best at 8 KiB; benchmarks/HISTORY.md, #41's third pass). A prefetch never faults: past the
// weight's end it costs a few useless lines.
constexpr int64_t kPrefetchAhead = 8192;

// The lines of one block of a tile (16 columns' share of a group), prefetched kPrefetchAhead ahead.
template <int64_t F>
inline void prefetch_block(const uint8_t* block) {
  constexpr int64_t kLines = (kTile * kvtop_quant::group_bytes(F) / kvtop_quant::group_blocks(F) + 63) / 64;
  const char* ahead = reinterpret_cast<const char*>(block) + kPrefetchAhead;
  for (int64_t line = 0; line < kLines; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
}

#endif

#ifdef KVTOP_QUANT_PACKING
// Up to 4 rows multiply the tiles as int16 (quant_packed.cpp): AVX-512 VNNI's vpdpwssd, or AVX2's
// vpmaddwd and an add.
// Rows of x as int16 per block of 32 values, one power-of-two scale a block (int16_scale), in the
// pairs a tile's dwords multiply: Q4's (and Q6_K's) dword 4g + j holds elements 8g + j and 8g + j + 4
// (its nibbles j and j + 4); Q8_0's dword r elements 2r and 2r + 1 (row r).
struct RowsI16 {
  kvtop::AlignedVector<int32_t> pairs;      // [M, K / 2]
  kvtop::AlignedVector<float> scale;        // [M, K / 32]
  kvtop::AlignedVector<int32_t> half_sums;  // [M, K / 16], Q6_K only: each 16 values' sum (its q - 32's offset term)
};

// The scale of a block of 32 values whose largest |x| is amax in [2^(e - 1), 2^e) (`bad`: a NaN or an
// infinity among them), and its inverse, which the values are multiplied by and rounded: 2^(e - 14),
// so every value is within 2^(e - 15) of x's — 16 bits of the block's range; x's products with the
// weights then sum exactly in int32 — a scale times a weight's d is exact, and a value that is a
// multiple of the scale (a one-hot row, most of a bf16 row's) is held exactly. A block of |x| < 2^-100
// is held as zeros; a NaN or an infinity makes the scale NaN, so the row's results are NaN as the fp32
// path's would be.
inline void int16_scale(float amax, bool bad, float& scale, float& inv) {
  inv = 0.0f;
  if (bad || std::isinf(amax)) {
    scale = std::numeric_limits<float>::quiet_NaN();
  } else if (amax < 0x1p-100f) {
    scale = 0.0f;
  } else {  // 2^(e - 14) and 2^(14 - e), e = frexp's exponent of amax (its biased exponent - 126), as bits:
    // ldexp was a libm call twice a block
    uint32_t bits;
    std::memcpy(&bits, &amax, sizeof(bits));
    const uint32_t biased = bits >> 23;  // amax >= 2^-100, finite: a normal float, biased exponent 27..254
    const uint32_t scale_bits = (biased - 13) << 23, inv_bits = (267 - biased) << 23;
    std::memcpy(&scale, &scale_bits, sizeof(scale));
    std::memcpy(&inv, &inv_bits, sizeof(inv));
  }
}
#endif

#ifdef KVTOP_QUANT_PACKED
// The floats 0..15, which vpermps indexes with a dword's low 4 bits.
inline __m512 nibble_values() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

// A sub-block of 32 K values of a tile's 16 columns: where its values are, and w = d * q + m per
// column (Q4_0: m = -8 d, equal to the reference's d * (q - 8) up to rounding; its de-quantization
// computes the latter; Q6_K: w = d * q for the first 16 values, d2 * q for the last 16, q signed).
struct Sub {
  const uint8_t* values;
  __m512 d, m, d2;
};

inline __m512 halves16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// Column c's 6-bit scale and min of Q4_K sub-block j, 16 columns at once (gguf's Q4_K.get_scale_min).
inline void q4k_scales(const uint8_t* rows, int64_t j, __m512i& sc, __m512i& mn) {
  auto row = [&](int64_t r) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + 16 * r))); };
  const __m512i low6 = _mm512_set1_epi32(63), low4 = _mm512_set1_epi32(15);
  if (j < 4) {
    sc = _mm512_and_si512(row(j), low6);
    mn = _mm512_and_si512(row(j + 4), low6);
  } else {
    const __m512i both = row(j + 4);
    sc = _mm512_or_si512(_mm512_and_si512(both, low4), _mm512_slli_epi32(_mm512_srli_epi32(row(j - 4), 6), 4));
    mn = _mm512_or_si512(_mm512_srli_epi32(both, 4), _mm512_slli_epi32(_mm512_srli_epi32(row(j), 6), 4));
  }
}

// Sub-block b (of the row's nb) of tile t of packed weight w in format F.
template <int64_t F>
inline Sub packed_sub(const uint8_t* w, int64_t t, int64_t b, int64_t nb) {
  constexpr int64_t kG = kvtop_quant::group_blocks(F);
  const int64_t group_bytes = kTile * kvtop_quant::group_bytes(F);
  const uint8_t* g = w + (t * (nb / kG) + b / kG) * group_bytes;
  if constexpr (F == kvtop_quant::kQ6_K) {  // the reference's (d * scale) for each half
    const int64_t j = b % kG;
    const __m512 d = halves16(g);
    auto scale = [&](int64_t r) {
      return _mm512_mul_ps(
          d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 32 + 16 * r)))));
    };
    return {g + 288 + 384 * j, scale(2 * j), _mm512_setzero_ps(), scale(2 * j + 1)};
  } else if constexpr (k_quant_format(F)) {
    const int64_t j = b % kG;
    __m512i sc, mn;
    q4k_scales(g + 64, j, sc, mn);
    const __m512 d = _mm512_mul_ps(halves16(g), _mm512_cvtepi32_ps(sc));
    const __m512 min = _mm512_mul_ps(halves16(g + 32), _mm512_cvtepi32_ps(mn));
    const __m512 m = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(min), _mm512_set1_epi32(INT32_MIN)));  // -min
    return {g + 256 + k_sub_bytes(F) * j, d, m, d};
  } else if constexpr (F == kvtop_quant::kQ8_0) {
    const __m512 d = halves16(g);
    return {g + 32, d, _mm512_setzero_ps(), d};
  } else {
    const __m512 d = halves16(g);  // m: Q4_0's -8 d, Q5_0's -16 d (their offset terms)
    const __m512 m = kvtop_quant::stores_offset(F) ? halves16(g + 32) : _mm512_mul_ps(d, _mm512_set1_ps(-kvtop_quant::zero_point(F)));
    return {g + q4_scale_bytes(F), d, m, d};
  }
}

// Element 8g + i of a Q4 sub-block for its 16 columns, as floats 0..15.
inline __m512 q4_values(const uint8_t* values, int g, int i) {
  const __m512i group = _mm512_loadu_si512(values + 64 * g);
  return _mm512_permutexvar_ps(i == 0 ? group : _mm512_srli_epi32(group, static_cast<unsigned>(4 * i)), nibble_values());
}

// Row r of a Q8_0 sub-block widened to floats: lanes (column c, parity e) = element 2r + e of column
// c, for columns 0..7 (lo) and 8..15 (hi).
inline void q8_row(const uint8_t* values, int r, __m512& lo, __m512& hi) {
  const uint8_t* q = values + 32 * r;
  lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
}

// A per-column vector in q8_row's lanes: each column's value twice, columns 0..7 (lo) and 8..15 (hi).
inline void column_pairs(__m512 v, __m512& lo, __m512& hi) {
  const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  lo = _mm512_permutexvar_ps(pairs, v);
  hi = _mm512_permutexvar_ps(_mm512_add_epi32(pairs, _mm512_set1_epi32(8)), v);
}

// Element k (0..31) of a Q4, Q5 or Q6_K sub-block for its 16 columns, as floats: Q4's 0..15; Q5's
// 0..31 (its low 4 bits as Q4's, plus 16 times its high bit); Q6_K's q - 32 (its low 4 bits as Q4's,
// plus 16 * its high 2 bits - 32 through a table indexed by 2 bits).
template <int64_t F>
inline __m512 packed_q(const Sub& s, int k) {
  const __m512 low = q4_values(s.values, k / 8, k % 8);
  if constexpr (q5_format(F)) {
    const __m512 high_values = _mm512_setr_ps(0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16);
    const __m512i bits = _mm512_srli_epi32(_mm512_loadu_si512(s.values + 256), static_cast<unsigned>(q5_high_bit(k)));
    return _mm512_add_ps(low, _mm512_permutexvar_ps(bits, high_values));
  }
  if constexpr (F != kvtop_quant::kQ6_K) return low;
  const __m512 high_values = _mm512_setr_ps(-32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16);
  const __m512i group = _mm512_loadu_si512(s.values + 256 + 64 * (k / 16));
  const __m512i bits = _mm512_srli_epi32(group, static_cast<unsigned>(q6k_high_bit(k % 16)));
  return _mm512_add_ps(low, _mm512_permutexvar_ps(bits, high_values));
}

// The reference's value of element k for the 16 columns (Q4_0: d * (q - 8); Q5_0: d * (q - 16); Q6_K: (d * scale) * q;
// d * q + m for the others, rounded once: d * q is exact in fp32 — d an fp16 (Q4_K's times a 6-bit
// scale: 17 bits), q 4 bits — so the fma is the reference's mul then add, bit for bit).
template <int64_t F>
inline __m512 packed_weight(const Sub& s, int k) {
  const __m512 q = packed_q<F>(s, k);
  if constexpr (F == kvtop_quant::kQ4_0 || F == kvtop_quant::kQ5_0)
    return _mm512_mul_ps(s.d, _mm512_sub_ps(q, _mm512_set1_ps(kvtop_quant::zero_point(F))));
  if constexpr (F == kvtop_quant::kQ6_K) return _mm512_mul_ps(k < 16 ? s.d : s.d2, q);
  return _mm512_fmadd_ps(s.d, q, s.m);
}

// Sub-block kb (of the row's kbs) of tile t as bf16 pairs, the layout VDPBF16PS and AMX's B tiles
// take: row r (0..15, at out + r * stride) holds the 16 columns' elements 2r and 2r + 1, column c's at
// 2c and 2c + 1 — the reference's values (packed_weight) rounded to bf16 to nearest even, as torch's
// .to(torch.bfloat16) rounds the de-quantized weight; for Q8_0 the packed row r itself, times d. No
// transpose. amx_linear.cpp's tiles (stride 32) and quant_gemm.cpp's bf16 panels (stride 96: three
// tiles side by side) are made of these.
template <int64_t F>
inline void bf16_pairs(const uint8_t* w, int64_t t, int64_t kb, int64_t kbs, uint16_t* out, int64_t stride) {
  const Sub sub = packed_sub<F>(w, t, kb, kbs);
  prefetch_block<F>(sub.values);
  if constexpr (F == kvtop_quant::kQ8_0) {  // row r: its 32 bytes are the tile's row r, d * q exact in fp32
    __m512 d0, d1;
    column_pairs(sub.d, d0, d1);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      __m512 q0, q1;
      q8_row(sub.values, r, q0, q1);
      _mm512_storeu_si512(out + r * stride,
                          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_mul_ps(d1, q1), _mm512_mul_ps(d0, q0))));
    }
  } else {
    // unrolled, so that each row's shifts and offsets are constants: the loop as written was front-end
    // bound (~35 instructions a row, 0.35 cycles a weight on the Xeon; 0.2 unrolled)
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)
      _mm512_storeu_si512(out + r * stride,
                          kvtop_simd::bf16_pairs16(packed_weight<F>(sub, 2 * r), packed_weight<F>(sub, 2 * r + 1)));
  }
}
#endif

}  // namespace kvtop_packed
