// GGUF blocks read into registers: the formats' layouts and their values as the reference computes
// them, for every kernel that computes on the blocks (quant_gemm.cpp's fp32 kernels, amx_linear.cpp's
// bf16 tiles). The formats (quant_gemm.cpp says more):
//   Q8_0 (ggml type 8):  32 values: fp16 d, int8 q[32]                 w = d * q
//   Q4_0 (ggml type 2):  32 values: fp16 d, 16 bytes of nibbles        w = d * (q - 8)
//   Q4_1 (ggml type 3):  32 values: fp16 d, fp16 m, 16 bytes of nibbles w = d * q + m
//   Q5_0 (ggml type 6):  32 values: fp16 d, 4 bytes of high bits, nibbles  w = d * (q - 16)
//   Q5_1 (ggml type 7):  32 values: fp16 d, fp16 m, high bits, nibbles     w = d * q + m
//   Q4_K (ggml type 12): 256 values in 8 sub-blocks of 32, 144 bytes    w = (d * sc_j) * q - dmin * min_j
//   Q5_K (ggml type 13): 256 values in 8 sub-blocks of 32, 176 bytes    w = (d * sc_j) * q - dmin * min_j
//   Q6_K (ggml type 14): 256 values, 210 bytes                          w = (d * scale) * (q - 32)
// The Q5 formats' q is 5 bits: a nibble as Q4's, plus 16 where its high bit is set. They are common
// where a model's rows are not a multiple of 256 (llama.cpp's Q4_K_M then writes Q5_0, Q5_K_M Q5_1:
// SmolLM2's 576) and in Q5_K_M files. They are packed for decode as the Q4 formats are (quant_packed.h).
// Included after `#pragma GCC optimize("fp-contract=off")` (set here too): dequant_block's mul then add
// must stay two roundings, as the reference's.
#pragma once
#pragma GCC optimize("fp-contract=off")

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVTOP_QUANT_GEMM 1
#include <immintrin.h>
#endif

namespace kvtop_quant {

// ggml's type ids, as engine/model/quant_linear.py names them
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int64_t kBlock = 32;  // values per sub-block: the unit both kernels walk
// A weight repacked for decode (quant_packed.cpp) is named by its ggml type + this.
constexpr int64_t kPackedFormat = 100;

// The value Q4_0 and Q5_0 subtract from their unsigned q (w = d * (q - zero_point)): the middle of
// the nibble's 0..15, of the 5-bit value's 0..31.
constexpr float zero_point(int64_t format) { return format == kQ5_0 ? 16.0f : 8.0f; }

// Q4_1 and Q5_1: a block stores its offset m beside d (w = d * q + m), where Q4_0 and Q5_0 subtract
// their zero point.
constexpr bool stores_offset(int64_t format) { return format == kQ4_1 || format == kQ5_1; }

// Sub-blocks of 32 per group (the file's block: 1, or 8 in a K format's super-block of 256).
constexpr int64_t group_blocks(int64_t format) { return format == kQ4_K || format == kQ5_K || format == kQ6_K ? 8 : 1; }

constexpr int64_t group_bytes(int64_t format) {
  switch (format) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

// blocks: a contiguous uint8 [N, K / group values * group bytes]; K a multiple of the group's
// values; a format the kernels run. Returns the group's bytes.
inline int64_t check_blocks(const at::Tensor& blocks, int64_t format, int64_t n, int64_t k, const char* op) {
  const int64_t bytes = group_bytes(format);
  TORCH_CHECK(bytes > 0, op, ": ggml type ", format, " is not one this kernel runs (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
  const int64_t values = group_blocks(format) * kBlock;
  TORCH_CHECK(k > 0 && k % values == 0, op, ": K must be a positive multiple of ", values);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && !blocks.is_cuda() && blocks.is_contiguous() && blocks.dim() == 2 &&
                  blocks.size(0) == n && blocks.size(1) == k / values * bytes,
              op, ": the weight must be a contiguous uint8 [N, K/", values, " * ", bytes, "] on the CPU");
  return bytes;
}

#ifdef KVTOP_QUANT_GEMM
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One sub-block's 32 quantized values as floats (nibbles unsigned 0..15, the Q5 formats' 0..31, Q8_0
// signed; Q6_K's already scaled: the reference's values), in element order, and its scale d and offset
// m: w = d * q + m (Q4_0: m = -8 d, Q5_0: -16 d, equal to the reference's d * (q - 8) or d * (q - 16) up
// to rounding; the panels compute it as the reference does, dequant_block).
struct Block {
  __m256 q[4];
  float d, m;
};

// 32 unsigned bytes in element order as four registers of floats.
inline void bytes_to_floats(__m256i q, __m256 out[4]) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// Q4_K's sub-block j scale and min, 6 bits each, packed in 12 bytes (gguf's Q4_K.get_scale_min).
inline void q4k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// A block's 16 bytes of nibbles as its 32 values in element order: element j < 16 byte j's low half,
// j >= 16 byte j - 16's high half (Q4_0, Q4_1, Q5_0, Q5_1).
inline __m256i block_nibbles(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
}

// Sub-block j's 32 nibbles in a K format's 128 bytes of them: sub-blocks 2i and 2i + 1 the low and high
// halves of bytes 32i .. 32i + 31 (Q4_K, Q5_K).
inline __m256i k_nibbles(const uint8_t* qs, int j) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j / 2)));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  return (j & 1) ? _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask) : _mm256_and_si256(bytes, mask);
}

// Q5_0's and Q5_1's high bits, the 4 bytes at `qh`: 16 in byte i where bit i is set, else 0.
inline __m256i q5_high_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                            _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                               0x0303030303030303));  // byte i: bits' byte i / 8
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));  // byte i: 1 << (i % 8)
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(16));
}

// Q5_K's high bits for sub-block j, the 32 bytes at `qh`: 16 in byte l where bit j of qh[l] is set.
inline __m256i q5k_high_bits(const uint8_t* qh, int j) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  // per byte: bit j moved to bit 0 (the 16-bit shift brings the next byte's bits only above it), kept, times 16
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(0x01)), 4);
}

// Sub-block j of group g in a Q4 or Q5 format (unsigned values: a nibble, plus 16 × a high bit in Q5): its 32 values q as bytes in element order, and its
// scale d and offset m, w = d * q + m — Q4_0: m = -8 d, Q5_0: -16 d (the reference's d * (q - 8) or
// d * (q - 16) up to rounding); Q4_K, Q5_K: d * sc_j and -(dmin * min_j), their 6-bit scale and min.
// Layouts: Q4_0 d, nibbles; Q4_1 d, m, nibbles; Q5_0 d, qh[4], nibbles; Q5_1 d, m, qh[4], nibbles;
// Q4_K d, dmin, scales[12], nibbles[128]; Q5_K d, dmin, scales[12], qh[32], nibbles[128].
template <int64_t F>
inline __m256i unsigned_values(const uint8_t* g, int j, float& d, float& m) {
  if constexpr (F == kQ4_K || F == kQ5_K) {
    int sc, mn;
    q4k_scale_min(g + 4, j, sc, mn);
    d = half_at(g) * static_cast<float>(sc);
    m = -(half_at(g + 2) * static_cast<float>(mn));
    if constexpr (F == kQ4_K) return k_nibbles(g + 16, j);
    return _mm256_or_si256(k_nibbles(g + 48, j), q5k_high_bits(g + 16, j));
  }
  constexpr bool offset = stores_offset(F);
  d = half_at(g);
  m = offset ? half_at(g + 2) : -zero_point(F) * d;
  const uint8_t* values = g + (offset ? 4 : 2);
  if constexpr (F == kQ4_0 || F == kQ4_1) return block_nibbles(values);
  return _mm256_or_si256(block_nibbles(values + 4), q5_high_bits(values));
}

// Sub-block j (0..7) of a Q6_K super-block, its values (d * scale) * (q - 32) as the reference
// computes them; d = 1, m = 0. Values 128h .. 128h + 127 take ql[64h ..] (low nibbles for the first
// 64, high for the next) and qh[32h ..] (2 bits at shift 2t for the t-th 32).
inline Block load_q6k(const uint8_t* g, int j) {
  Block out;
  const int h = j / 4, t = j % 4;
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 64 * h + 32 * (t & 1)));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 128 + 32 * h));
  const __m256i low = t < 2 ? _mm256_and_si256(ql, _mm256_set1_epi8(0x0F))
                            : _mm256_and_si256(_mm256_srli_epi16(ql, 4), _mm256_set1_epi8(0x0F));
  const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(0x03));
  const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
  const int8_t* scales = reinterpret_cast<const int8_t*>(g + 192);
  const float d = half_at(g + 208);
  const __m256 s0 = _mm256_set1_ps(d * static_cast<float>(scales[2 * j]));
  const __m256 s1 = _mm256_set1_ps(d * static_cast<float>(scales[2 * j + 1]));
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  out.q[0] = _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
  out.q[1] = _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
  out.q[2] = _mm256_mul_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
  out.q[3] = _mm256_mul_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
  out.d = 1.0f;
  out.m = 0.0f;
  return out;
}

// Sub-block j of group g (a K format's super-block; the block itself for the others, j = 0).
template <int64_t F>
inline Block load_block(const uint8_t* g, int j) {
  Block out;
  if constexpr (F == kQ6_K) {
    return load_q6k(g, j);
  } else if constexpr (F == kQ8_0) {
    out.d = half_at(g);
    out.m = 0.0f;
    for (int i = 0; i < 4; ++i) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + 2 + 8 * i));
      out.q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
    }
  } else {
    bytes_to_floats(unsigned_values<F>(g, j, out.d, out.m), out.q);
  }
  return out;
}

// The reference's values for sub-block j of group g: Q8_0 d * q, Q4_0 d * (q - 8), Q5_0 d * (q - 16),
// Q4_1 and Q5_1 d * q + m, Q4_K and Q5_K (d sc) q - dmin min (as d q + m: adding -x is subtracting x),
// Q6_K its values as loaded (no fma).
template <int64_t F>
inline void dequant_block(const uint8_t* g, int64_t j, __m256 out[4]) {
  const Block blk = load_block<F>(g, static_cast<int>(j));
  if constexpr (F == kQ6_K) {
    for (int i = 0; i < 4; ++i) out[i] = blk.q[i];
    return;
  }
  const __m256 d = _mm256_set1_ps(blk.d);
  for (int i = 0; i < 4; ++i) {
    if constexpr (F == kQ4_0 || F == kQ5_0)
      out[i] = _mm256_mul_ps(d, _mm256_sub_ps(blk.q[i], _mm256_set1_ps(zero_point(F))));
    else if constexpr (F == kQ4_1 || F == kQ4_K || F == kQ5_1 || F == kQ5_K)
      out[i] = _mm256_add_ps(_mm256_mul_ps(d, blk.q[i]), _mm256_set1_ps(blk.m));
    else
      out[i] = _mm256_mul_ps(d, blk.q[i]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// dequant_block in two 16-lane registers (elements 0..15, 16..31): the same values, half the
// conversions, for the de-quantization into AMX tiles (amx_linear.cpp), where it is the whole cost
// (Q6_K's through dequant_block's 8 lanes).
template <int64_t F>
inline void dequant_block16(const uint8_t* g, int64_t j, __m512 out[2]) {
  if constexpr (F == kQ6_K) {
    __m256 v[4];
    dequant_block<F>(g, j, v);
    out[0] = _mm512_insertf32x8(_mm512_castps256_ps512(v[0]), v[1], 1);
    out[1] = _mm512_insertf32x8(_mm512_castps256_ps512(v[2]), v[3], 1);
    return;
  }
  __m512 q[2];
  float d, m = 0.0f;
  if constexpr (F == kQ8_0) {
    d = half_at(g);
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 2))));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 18))));
  } else {
    const __m256i v = unsigned_values<F>(g, static_cast<int>(j), d, m);
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(v)));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(v, 1)));
  }
  const __m512 dv = _mm512_set1_ps(d);
  for (int i = 0; i < 2; ++i) {
    if constexpr (F == kQ4_0 || F == kQ5_0)
      out[i] = _mm512_mul_ps(dv, _mm512_sub_ps(q[i], _mm512_set1_ps(zero_point(F))));
    else if constexpr (F == kQ4_1 || F == kQ4_K || F == kQ5_1 || F == kQ5_K)
      out[i] = _mm512_add_ps(_mm512_mul_ps(dv, q[i]), _mm512_set1_ps(m));
    else
      out[i] = _mm512_mul_ps(dv, q[i]);
  }
}
#endif

template <typename Body>
void by_format(int64_t format, const Body& body) {
  switch (format) {
    case kQ4_0: body(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: body(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ5_0: body(std::integral_constant<int64_t, kQ5_0>{}); break;
    case kQ5_1: body(std::integral_constant<int64_t, kQ5_1>{}); break;
    case kQ4_K: body(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ5_K: body(std::integral_constant<int64_t, kQ5_K>{}); break;
    case kQ6_K: body(std::integral_constant<int64_t, kQ6_K>{}); break;
    default: body(std::integral_constant<int64_t, kQ8_0>{}); break;
  }
}
#endif  // KVTOP_QUANT_GEMM

}  // namespace kvtop_quant
