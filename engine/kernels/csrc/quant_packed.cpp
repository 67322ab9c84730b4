// GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and Q8_0 weights repacked at load for decode: the same
// bytes in tiles of 16 output columns, which one to four rows multiply with the columns in a register's
// 16 lanes (issue #41).
//
// Why: at one to four rows a decode step's time on the file's layout (quant_gemm.cpp's quant_gemv) is
// the de-quantization, not the memory: each column's nibbles are widened, converted and multiplied
// into a K-lane register, and every block's scale waits for a horizontal sum. Here a register holds
// 16 columns, each block's scale and offset are applied once per tile (y += d * S + m * sum_k x_k,
// Q4_0's m = -8 d), and nothing is summed across lanes. The rows are int16: each block of 32 of a
// row's values is rounded to int16 with one power-of-two scale (quant_packed.h's int16_scale says how
// close), and vpdpwssd (AVX-512 VNNI) multiplies a dword's two nibbles (elements 8g + j and 8g + j + 4,
// moved into its words by one byte shuffle and a mask, the last pair by a word shift alone) by a pair
// of those int16 and sums both into int32, exactly: 32 products an instruction, where fp32 FMAs on the
// same tiles took a shift, a permute and an FMA for 16 (benchmarks/HISTORY.md, #41's sixth pass), so
// one row runs at what the cache delivers rather than at ports 0 and 5. Each block's integer sum is
// scaled once (d times the row's scale); the offset term keeps x's fp32 sums. Q6_K's word is its low
// nibble | its high 2 bits << 4 (q6k_tile_rows), its q - 32 through the int16 values' sums per 16;
// Q5_0/Q5_1/Q5_K's is Q4's pair with the two values' high bits at bit 4 of each word (one shift of the
// high-bit plane, a mask), Q5_0's offset -16 d. AVX2 does the same 8 columns at a time with vpmaddwd
// and an add (quant_packed_avx2.h).
//
// The packed layout (quant_packed.h has it byte by byte), for N a multiple of 16: the [N, row bytes]
// tensor keeps its shape and byte count (resident bytes are the file's); tiles of 16 columns hold
// each of the file's groups along K in turn, 16 columns' worth:
//   Q4_0 / Q4_1 / Q4_K: per sub-block of 32 K values, 4 groups of 64 bytes whose dword c holds column
//     c's elements 8g .. 8g + 7, a nibble each (for the fp32 panels and AMX tiles, `vpermps` reads only
//     an index's low 4 bits, so the dwords shifted right by 4j index a table of the floats 0..15
//     straight to the 16 columns' element 8g + j). The scales (Q4_K's and Q5_K's 6-bit scales and mins,
//     16 columns a row) come out once per sub-block as 16 lanes. The Q5 formats' and Q6_K's low 4 bits
//     are laid out so too, their high bits beside them.
//   Q8_0: 16 rows of 32 bytes, row r's byte 2c + e column c's element 2r + e: a row widened to words is
//     16 columns' (element 2r, 2r + 1) pairs.
// A row of a tile's values is also a row of quant_gemm's fp32 panels (dequant_panel below) and, in
// pairs, of an AMX B tile (amx_linear.cpp): both read the packed weight without a transpose.
// Without AVX-512 (with BF16), AVX2 + FMA + F16C reads the same tiles half a tile — 8 columns, one
// 8-lane register — at a time: quant_packed_avx2.h, which this file's gemv and dequant_panel call there.
//
// quant_linear (quant_gemm.cpp) routes a packed format (its ggml type + kPackedFormat) here (up to 4
// rows), to AMX or, without it, the bf16 panels (more bf16 rows: quant_gemm.cpp makes them of
// quant_packed.h's bf16_pairs) or to the fp32 panels (the rest); only the reference unpacks it to the
// file's layout (quant_unpack, a copy of the weight's bytes).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "aligned_vector.h"
#include "bf16_simd.h"
#include "panel_gemm.h"
#include "quant_blocks.h"
#include "quant_packed.h"
#if defined(KVTOP_QUANT_PACKING) && !defined(KVTOP_QUANT_PACKED)
#include "quant_packed_avx2.h"  // AVX2's kernels: half a tile at a time
#endif

namespace kvtop_packed {

using kvtop_quant::kBlock;
using kvtop_quant::kQ4_0;
using kvtop_quant::kQ4_1;
using kvtop_quant::kQ4_K;
using kvtop_quant::kQ5_0;
using kvtop_quant::kQ5_1;
using kvtop_quant::kQ5_K;
using kvtop_quant::kQ6_K;
using kvtop_quant::kQ8_0;

// Weights are packed here: the 16-lane kernels (AVX-512 BW + BF16) or the 8-lane ones (AVX2 + FMA + F16C).
bool supported() {
#ifdef KVTOP_QUANT_PACKING
  return true;
#else
  return false;
#endif
}

// gate_up_tiles (SiLU-and-mul over gate/up tile pairs, quant_linear.py's QuantGateUp) is built: AVX-512
// only; elsewhere a packed gate/up stays a plain packed layer and SiLU-and-mul runs after it.
bool gate_up_supported() {
#ifdef KVTOP_QUANT_PACKED
  return true;
#else
  return false;
#endif
}

namespace {

void check_packable(const at::Tensor& blocks, int64_t format, int64_t n, const char* op) {
  TORCH_CHECK(packable_format(format), op,
              ": only Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and Q8_0 weights are packed, not ggml type ", format);
  TORCH_CHECK(n % kTile == 0, op, ": N must be a multiple of ", kTile);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() && blocks.size(0) == n,
              op, ": the weight must be a contiguous uint8 [N, row bytes]");
  TORCH_CHECK(blocks.size(1) % kvtop_quant::group_bytes(format) == 0, op, ": a row must be whole blocks");
}

// Element k (0..31) of sub-block j of a file group's nibbles: Q4_0/Q4_1/Q5_0/Q5_1 byte k's low half for k < 16,
// byte k - 16's high half; Q4_K's and Q5_K's sub-blocks 2i and 2i + 1 the low and high halves of bytes 32i ..
inline uint8_t file_nibble(int64_t format, const uint8_t* qs, int j, int k) {
  if (k_quant_format(format)) return (qs[32 * (j / 2) + k] >> (4 * (j & 1))) & 0x0F;
  return k < 16 ? qs[k] & 0x0F : qs[k - 16] >> 4;
}
inline void set_file_nibble(int64_t format, uint8_t* qs, int j, int k, uint8_t v) {
  if (k_quant_format(format))
    qs[32 * (j / 2) + k] |= static_cast<uint8_t>(v << (4 * (j & 1)));
  else
    qs[k % 16] |= static_cast<uint8_t>(v << (k < 16 ? 0 : 4));
}

// A group's layout: its fp16 fields per column (16 columns' worth each at the tile's start, 2 bytes
// each at the file group's), the file group's bytes before its values, where sub-block j's nibbles
// start in the tile.
struct GroupLayout {
  int scales;  // fp16 fields per column: d (and m or dmin)
  int head;    // the file group's bytes before its values (Q5: the scales, then the high bits)
  int64_t sub_bytes;  // a K format's sub-block in the tile (quant_packed.h's k_sub_bytes); 0 otherwise
  int64_t nibbles(int j) const { return sub_bytes ? 256 + sub_bytes * j : 32 * scales; }
};
inline GroupLayout group_layout(int64_t format) {
  if (format == kQ4_K) return {2, 16, k_sub_bytes(kQ4_K)};
  if (format == kQ5_K) return {2, 48, k_sub_bytes(kQ5_K)};  // d, dmin, scales[12], qh[32]
  if (format == kQ4_1) return {2, 4, 0};
  if (format == kQ5_0) return {1, 6, 0};
  if (format == kQ5_1) return {2, 8, 0};
  return {1, 2, 0};  // Q4_0, Q8_0
}

// A sub-block's 32 Q5 high bits in element order (bit k: element k) as a tile's plane holds them
// (element k at q5_high_bit(k)), and back.
uint32_t plane_order(uint32_t bits) {
  uint32_t out = 0;
  for (int k = 0; k < kBlock; ++k) out |= ((bits >> k) & 1u) << q5_high_bit(k);
  return out;
}
uint32_t element_order(uint32_t plane) {
  uint32_t out = 0;
  for (int k = 0; k < kBlock; ++k) out |= ((plane >> q5_high_bit(k)) & 1u) << k;
  return out;
}

// Sub-block j's 32 high bits in a file group's qh (bit k: element k): Q5_0/Q5_1's 4 bytes are the
// block's; Q5_K's 32 bytes hold element 32j + k at bit j of byte k.
uint32_t file_high_bits(int64_t format, const uint8_t* qh, int j) {
  uint32_t bits = 0;
  if (format != kQ5_K) {
    std::memcpy(&bits, qh, 4);
    return bits;
  }
  for (int k = 0; k < kBlock; ++k) bits |= ((qh[k] >> j) & 1u) << k;
  return bits;
}
void set_file_high_bits(int64_t format, uint8_t* qh, int j, uint32_t bits) {
  if (format != kQ5_K) {
    std::memcpy(qh, &bits, 4);
    return;
  }
  for (int k = 0; k < kBlock; ++k) qh[k] = static_cast<uint8_t>((qh[k] & ~(1u << j)) | ((bits >> k) & 1u) << j);
}

// Where Q8_0 element k of column c sits in a tile block's values.
inline int q8_place(int c, int k) { return 32 * (k / 2) + 2 * c + (k & 1); }


// Q6_K element e (0..255) of a file group: its ql byte and shift, its qh byte and shift (gguf's
// layout: values 128h .. 128h + 127 take ql[64h ..] and qh[32h ..]; the t-th 32 of them ql's low (t < 2)
// or high halves of bytes 64h + 32 (t & 1) .., and bits 2t of qh[32h + l]).
inline void q6k_place(int e, int& ql, int& ql_shift, int& qh, int& qh_shift) {
  const int h = e / 128, t = (e % 128) / 32, l = e % 32;
  ql = 64 * h + 32 * (t & 1) + l, ql_shift = t >= 2 ? 4 : 0;
  qh = 128 + 32 * h + l, qh_shift = 2 * t;
}

// Copies one Q6_K tile group either way (to_tile: pack; else unpack into zeroed values).
void copy_q6k_group(uint8_t* tile, uint8_t* const blk[kTile], bool to_tile) {
  if (to_tile)
    std::memset(tile + 288, 0, 8 * 384);
  else
    for (int c = 0; c < kTile; ++c) std::memset(blk[c], 0, 192);
  for (int c = 0; c < kTile; ++c) {
    uint8_t* file = blk[c];
    to_tile ? std::memcpy(tile + 2 * c, file + 208, 2) : std::memcpy(file + 208, tile + 2 * c, 2);  // d
    for (int r = 0; r < 16; ++r) to_tile ? (tile[32 + 16 * r + c] = file[192 + r]) : (file[192 + r] = tile[32 + 16 * r + c]);
    for (int e = 0; e < 256; ++e) {
      int ql, ql_shift, qh, qh_shift;
      q6k_place(e, ql, ql_shift, qh, qh_shift);
      const int j = e / 32, k = e % 32;
      uint8_t* low = tile + 288 + 384 * j + 64 * (k / 8) + 4 * c + (k % 8) / 2;  // as Q4's nibbles
      const int high_bit = q6k_high_bit(k % 16);
      uint8_t* high = tile + 288 + 384 * j + 256 + 64 * (k / 16) + 4 * c + high_bit / 8;
      const int low_shift = 4 * (k & 1), high_shift = high_bit % 8;
      if (to_tile) {
        *low |= static_cast<uint8_t>(((file[ql] >> ql_shift) & 0x0F) << low_shift);
        *high |= static_cast<uint8_t>(((file[qh] >> qh_shift) & 0x03) << high_shift);
      } else {
        file[ql] |= static_cast<uint8_t>(((*low >> low_shift) & 0x0F) << ql_shift);
        file[qh] |= static_cast<uint8_t>(((*high >> high_shift) & 0x03) << qh_shift);
      }
    }
  }
}

// Copies one tile group between the file's layout (blk[c]: column c's group) and the packed one
// (tile), either way: to_tile true packs, false unpacks (the destination's nibbles zeroed first).
void copy_group(int64_t format, uint8_t* tile, uint8_t* const blk[kTile], bool to_tile) {
  if (format == kQ6_K) return copy_q6k_group(tile, blk, to_tile);
  const GroupLayout L = group_layout(format);
  const int64_t bytes = kvtop_quant::group_bytes(format), values = bytes - L.head;
  const int subs = static_cast<int>(kvtop_quant::group_blocks(format));
  if (to_tile)
    std::memset(tile + 32 * L.scales, 0, kTile * bytes - 32 * L.scales);
  else
    for (int c = 0; c < kTile; ++c) std::memset(blk[c] + L.head, 0, values);
  for (int c = 0; c < kTile; ++c) {
    for (int f = 0; f < L.scales; ++f) {  // d, then m (Q4_1) or dmin (Q4_K)
      uint8_t* a = tile + 32 * f + 2 * c;
      uint8_t* b = blk[c] + 2 * f;
      to_tile ? std::memcpy(a, b, 2) : std::memcpy(b, a, 2);
    }
    if (k_quant_format(format))
      for (int r = 0; r < 12; ++r) {  // the 6-bit scales, 16 columns a row
        uint8_t* a = tile + 64 + 16 * r + c;
        to_tile ? (*a = blk[c][4 + r]) : (blk[c][4 + r] = *a);
      }
    uint8_t* qs = blk[c] + L.head;
    if (format == kQ8_0) {
      for (int k = 0; k < kBlock; ++k) {
        uint8_t* a = tile + 32 + q8_place(c, k);
        to_tile ? (*a = qs[k]) : (qs[k] = *a);
      }
      continue;
    }
    for (int j = 0; j < subs; ++j) {
      if (q5_format(format)) {  // the sub-block's high-bit plane (after its nibbles); the file's qh just before qs
        uint8_t* plane = tile + L.nibbles(j) + 256 + 4 * c;
        uint8_t* qh = qs - (format == kQ5_K ? 32 : 4);
        uint32_t bits;
        if (to_tile) {
          bits = plane_order(file_high_bits(format, qh, j));
          std::memcpy(plane, &bits, 4);
        } else {
          std::memcpy(&bits, plane, 4);
          set_file_high_bits(format, qh, j, element_order(bits));
        }
      }
      uint8_t* dwords = tile + L.nibbles(j) + 4 * c;  // group g's dword c at 64 g: elements 8g .. 8g + 7
      for (int i = 0; i < 16; ++i) {                 // byte i of the four: elements 2i, 2i + 1
        uint8_t& byte = dwords[64 * (i / 4) + i % 4];
        if (to_tile) {
          byte = static_cast<uint8_t>(file_nibble(format, qs, j, 2 * i) | file_nibble(format, qs, j, 2 * i + 1) << 4);
        } else {
          set_file_nibble(format, qs, j, 2 * i, byte & 0x0F);
          set_file_nibble(format, qs, j, 2 * i + 1, byte >> 4);
        }
      }
    }
  }
}

// Between the file's blocks [N, row bytes] and the packed layout (same shape, same bytes).
at::Tensor repack(const at::Tensor& blocks, int64_t format, int64_t n, bool to_tile, const char* op) {
  check_packable(blocks, format, n, op);
  const int64_t bytes = kvtop_quant::group_bytes(format), groups = blocks.size(1) / bytes;
  at::Tensor out = at::empty_like(blocks);
  uint8_t* src = const_cast<uint8_t*>(blocks.data_ptr<uint8_t>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  uint8_t* file = to_tile ? src : dst;
  uint8_t* packed = to_tile ? dst : src;
  at::parallel_for(0, n / kTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* blk[kTile];
        for (int c = 0; c < kTile; ++c) blk[c] = file + ((t * kTile + c) * groups + g) * bytes;
        copy_group(format, packed + (t * groups + g) * kTile * bytes, blk, to_tile);
      }
  });
  return out;
}

}  // namespace

// The file's blocks [N, row bytes] of a packable format in the packed layout.
at::Tensor pack(const at::Tensor& blocks, int64_t format, int64_t n) {
  return repack(blocks, format, n, true, "quant_pack");
}

// The packed weight back in the file's layout (bit for bit the blocks it was packed from).
at::Tensor unpack(const at::Tensor& packed, int64_t format, int64_t n) {
  return repack(packed, format, n, false, "quant_unpack");
}

// Rows `ids` of a packed Q8_0 weight [N, K] de-quantized, fp32 [L, K] (d * q, as the `gguf` package
// de-quantizes): a tied embedding's lookup in its logits head's tiles (quant_linear.py's
// QuantEmbedding). Row n is column n % 16 of tile n / 16: per block, d at bytes 2c, element 2r + e at
// 32 + 32r + 2c + e.
at::Tensor packed_q8_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t n) {
  check_packable(packed, kQ8_0, n, "quant_packed_rows");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "quant_packed_rows: ids must be int64 [L]");
  const int64_t nb = packed.size(1) / kvtop_quant::group_bytes(kQ8_0), group = kTile * kvtop_quant::group_bytes(kQ8_0);
  const at::Tensor where = ids.contiguous();
  const int64_t* id = where.data_ptr<int64_t>();
  for (int64_t i = 0; i < where.size(0); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "quant_packed_rows: id ", id[i], " is not a row of [0, ", n, ")");
  at::Tensor out = at::empty({where.size(0), nb * kBlock}, packed.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, where.size(0), 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t c = id[i] % kTile;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* g = w + (id[i] / kTile * nb + b) * group;
        c10::Half d;
        std::memcpy(&d, g + 2 * c, 2);
        float* row = o + i * nb * kBlock + b * kBlock;
        for (int r = 0; r < kBlock / 2; ++r)
          for (int e = 0; e < 2; ++e)
            row[2 * r + e] = static_cast<float>(d) * static_cast<float>(static_cast<int8_t>(g[32 + 32 * r + 2 * c + e]));
      }
    }
  });
  return out;
}

namespace {

// run(std::integral_constant<int, R>{}) for R = m, 1 to 4 (more: 4): the row count a kernel's
// registers are laid out for, fixed at compile time.
template <typename Run>
inline void by_rows(int64_t m, Run run) {
  switch (m) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    default: run(std::integral_constant<int, 4>{}); break;
  }
}

}  // namespace

#ifdef KVTOP_QUANT_PACKED
namespace {

// 16 fp32 results to y: as they are, or rounded to bf16 (nearest even).
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
inline void store16(uint16_t* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// silu(gate) * up over 16 columns of a row of T (fp32, or bf16's bits): bf16 widened exactly, its SiLU
// rounded before the product (torch's bf16 silu is a bf16 tensor of its own) and the result rounded as
// torch rounds (bf16_pack keeps NaNs and denormals) — fused_ops.cpp's silu_and_mul, bit for bit.
inline void silu_mul_row16(const float* gate, const float* up, float* out) {
  _mm512_storeu_ps(out, kvtop_simd::silu_mul16<false>(_mm512_loadu_ps(gate), _mm512_loadu_ps(up)));
}
inline void silu_mul_row16(const uint16_t* gate, const uint16_t* up, uint16_t* out) {
  auto widen = [](const uint16_t* p) {
    return kvtop_simd::bf16_widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  const __m512 v = kvtop_simd::silu_mul16<true>(widen(gate), widen(up));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), kvtop_simd::bf16_pack(v));
}

inline float block_sum(const float* x) {
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)));
}

// One block of 32 values of x as int16 (quant_packed.h's RowsI16: the pairs' order, int16_scale's scale).
template <int64_t F>
inline void quantize_block(const float* x, int16_t* out, float& scale) {
  alignas(64) static const int16_t q4_order[32] = {0,  4,  1,  5,  2,  6,  3,  7,  8,  12, 9,  13, 10, 14, 11, 15,
                                                   16, 20, 17, 21, 18, 22, 19, 23, 24, 28, 25, 29, 26, 30, 27, 31};
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const bool nan = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
  float inv;
  int16_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))), nan, scale, inv);
  const __m512 iv = _mm512_set1_ps(inv);
  const __m512i words = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(lo, iv)))),
      _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(hi, iv))), 1);
  _mm512_storeu_si512(out, F == kQ8_0 ? words : _mm512_permutexvar_epi16(_mm512_load_si512(q4_order), words));
}

// Nibbles j and j + 4 of each dword (j = 0..3) as its two words' low bits, the rest garbage above.
inline __m512i nibble_pairs(__m512i group, int j) {
  if (j == 0) return group;
#ifdef __AVX512VBMI__  // a byte shuffle on port 5, leaving port 0 to the multiply-adds
  const int64_t b = 4 * j;
  return _mm512_multishift_epi64_epi8(_mm512_set1_epi64(b | (16 + b) << 16 | (32 + b) << 32 | (48 + b) << 48), group);
#else
  return _mm512_srli_epi32(group, static_cast<unsigned>(4 * j));
#endif
}

// Nibbles j and j + 4 of each dword as its two words, 0..15: the last pair is a word shift alone (the
// nibbles at the top of the words), the others masked.
inline __m512i nibble_pair_words(__m512i group, int j, __m512i low4) {
  if (j == 3) return _mm512_srli_epi16(group, 12);
  return _mm512_and_si512(nibble_pairs(group, j), low4);
}

// A Q5 high-bit plane's bits of pair p = 4g + j (elements 8g + j and 8g + j + 4: q5_high_bit's 4g + j
// and 16 + 4g + j) moved to bits 4 and 20 (a with 0x00100010 keeps them; the rest is garbage).
inline __m512i q5_pair_bits(const uint8_t* plane, int p) {
  const __m512i bits = _mm512_loadu_si512(plane);
  return p >= 4 ? _mm512_srli_epi32(bits, static_cast<unsigned>(p - 4)) : _mm512_slli_epi32(bits, static_cast<unsigned>(4 - p));
}

// Independent vpdpwssd chains a row sums a block's products into: a block's 16 multiply-adds a row in
// one or two chains wait on each other's latency (4-5 cycles on Zen 4); one row alone takes four, so
// that its block runs at the instruction's throughput. The int32 sums are exact: any split gives the
// same total.
template <int R>
constexpr int kChains = R == 1 ? 4 : 2;

template <int R>
inline __m512i chains_sum(const __m512i (&chains)[kChains<R>]) {
  __m512i total = chains[0];
  for (int c = 1; c < kChains<R>; ++c) total = _mm512_add_epi32(total, chains[c]);
  return total;
}

// Q4 (and Q5) tile t's 16 columns for rows [0, R) of int16 x, y [R, 16] of T (bf16 or fp32) at stride
// ldy: each block's 16 columns x 32 values summed exactly in int32 (vpdpwssd: a nibble pair — Q5's with
// its high bits at bit 4 of each word — times an x pair a lane), then scaled once, d times x's scale;
// the offset term (m · Σx) through x's fp32 block sums.
template <int64_t F, typename T, int R>
void q4_tile_rows(const RowsI16& x, int64_t k, const float* xsum, const uint8_t* w, int64_t t, int64_t nb,
                      const float* bias, T* y, int64_t ldy) {
  const __m512i low4 = _mm512_set1_epi32(0x000F000F), bit4 = _mm512_set1_epi32(0x00100010);
  __m512 acc[R], macc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), macc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Sub sub = packed_sub<F>(w, t, b, nb);
    prefetch_block<F>(sub.values);
    __m512i sum[R][kChains<R>];
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m512i group = _mm512_loadu_si512(sub.values + 64 * g);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i q = nibble_pair_words(group, j, low4);
        if constexpr (q5_format(F)) q = _mm512_ternarylogic_epi32(q, q5_pair_bits(sub.values + 256, 4 * g + j), bit4, 0xF8);
        for (int r = 0; r < R; ++r) {
          __m512i& chain = sum[r][(4 * g + j) % kChains<R>];
          const __m512i xv = _mm512_set1_epi32(x.pairs[(r * k + b * kBlock) / 2 + 4 * g + j]);
          // a chain's first product starts it (vpmaddwd) rather than adding to a zeroed register
          chain = 4 * g + j < kChains<R> ? _mm512_madd_epi16(q, xv) : _mm512_dpwssd_epi32(chain, q, xv);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_mul_ps(sub.d, _mm512_set1_ps(x.scale[r * nb + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chains_sum<R>(sum[r])), d, acc[r]);
      macc[r] = _mm512_fmadd_ps(sub.m, _mm512_set1_ps(xsum[r * nb + b]), macc[r]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) store16(y + r * ldy, _mm512_add_ps(_mm512_add_ps(acc[r], macc[r]), bv));
}

// Q8_0 tile t's 16 columns for rows [0, R) of int16 x: row r of a block's values widened to words is
// 16 dwords of (element 2r, 2r + 1) of a column, which one vpdpwssd multiplies by the x pair and sums.
template <typename T, int R>
void q8_tile_rows(const RowsI16& x, int64_t k, const uint8_t* w, int64_t t, int64_t nb, const float* bias, T* y,
                      int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Sub sub = packed_sub<kQ8_0>(w, t, b, nb);
    prefetch_block<kQ8_0>(sub.values);
    __m512i sum[R][kChains<R>];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains<R>; ++c) sum[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int row = 0; row < 16; ++row) {
      const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sub.values + 32 * row)));
      for (int r = 0; r < R; ++r) {
        __m512i& chain = sum[r][row % kChains<R>];
        chain = _mm512_dpwssd_epi32(chain, q, _mm512_set1_epi32(x.pairs[(r * k + b * kBlock) / 2 + row]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_mul_ps(sub.d, _mm512_set1_ps(x.scale[r * nb + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chains_sum<R>(sum[r])), d, acc[r]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) store16(y + r * ldy, _mm512_add_ps(acc[r], bv));
}

// Q6_K on int16 rows: a word is its value's low nibble | its high 2 bits << 4 (q in 0..63; the high
// bits of elements e and e + 4 sit 16 bits apart, quant_packed.h's q6k_high_bit, so one shift moves
// both pairs' to bits 4 and 5 of their words), the pairs as Q4's; each 16 values' sum, less 32 times
// their int16 sum (q - 32), is scaled by its own d.
template <typename T, int R>
void q6k_tile_rows(const RowsI16& x, int64_t k, const uint8_t* w, int64_t t, int64_t nb, const float* bias, T* y,
                   int64_t ldy) {
  const __m512i low4 = _mm512_set1_epi32(0x000F000F), high2 = _mm512_set1_epi32(0x00300030);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Sub sub = packed_sub<kQ6_K>(w, t, b, nb);
    prefetch_block<kQ6_K>(sub.values);
    __m512i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
    for (int part = 0; part < 2; ++part) {  // values 16 part .. 16 part + 15: groups 2 part, 2 part + 1
      const __m512i high = _mm512_loadu_si512(sub.values + 256 + 64 * part);
      for (int u = 0; u < 2; ++u) {
        const int g = 2 * part + u;
        const __m512i group = _mm512_loadu_si512(sub.values + 64 * g);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const int at = q6k_high_bit(8 * u + j) - 4;
          const __m512i hi = at >= 0 ? _mm512_srli_epi32(high, static_cast<unsigned>(at))
                                     : _mm512_slli_epi32(high, static_cast<unsigned>(-at));
          const __m512i q = _mm512_ternarylogic_epi32(nibble_pairs(group, j), low4, _mm512_and_si512(hi, high2), 0xEA);
          for (int r = 0; r < R; ++r)
            sum[r][part] = _mm512_dpwssd_epi32(sum[r][part], q, _mm512_set1_epi32(x.pairs[(r * k + b * kBlock) / 2 + 4 * g + j]));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(x.scale[r * nb + b]);
      const int32_t* sums = x.half_sums.data() + 2 * (r * nb + b);
      const __m512i q0 = _mm512_sub_epi32(sum[r][0], _mm512_set1_epi32(32 * sums[0]));
      const __m512i q1 = _mm512_sub_epi32(sum[r][1], _mm512_set1_epi32(32 * sums[1]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), _mm512_mul_ps(sub.d, s), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), _mm512_mul_ps(sub.d2, s), acc[r]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) store16(y + r * ldy, _mm512_add_ps(acc[r], bv));
}

// Tile t's 16 columns for m rows (1..4) of x as int16 rows into y [m, 16] at stride ldy; bias: the
// tile's 16 (or none); xsum: Q4's per-block sums of x (fp32).
template <int64_t F, typename T>
void tile(const RowsI16& x, int64_t m, int64_t k, const float* xsum, const uint8_t* w, int64_t t, const float* bias,
          T* y, int64_t ldy) {
  const int64_t nb = k / kBlock;
  auto run = [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    if constexpr (F == kQ8_0)
      q8_tile_rows<T, R>(x, k, w, t, nb, bias, y, ldy);
    else if constexpr (F == kQ6_K)
      q6k_tile_rows<T, R>(x, k, w, t, nb, bias, y, ldy);
    else
      q4_tile_rows<F, T, R>(x, k, xsum, w, t, nb, bias, y, ldy);
  };
  by_rows(m, run);
}

// Tiles [t0, t1) for m rows (1..4) of x as int16 rows into y [m, n].
template <int64_t F, typename T>
void tiles(const RowsI16& x, int64_t m, int64_t k, const float* xsum, const uint8_t* w, int64_t t0, int64_t t1,
           const float* bias, T* y, int64_t n) {
  for (int64_t t = t0; t < t1; ++t) tile<F>(x, m, k, xsum, w, t, bias ? bias + t * kTile : nullptr, y + t * kTile, n);
}

}  // namespace
#elif defined(KVTOP_QUANT_PACKING)
namespace {

using avx2::block_sum;
using avx2::quantize_block;

// Tiles [t0, t1) for m rows (1..4) of x as int16 rows, half a tile at a time (quant_packed_avx2.h).
template <int64_t F, typename T>
void tiles(const RowsI16& x, int64_t m, int64_t k, const float* xsum, const uint8_t* w, int64_t t0, int64_t t1,
           const float* bias, T* y, int64_t n) {
  const int64_t nb = k / kBlock;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t c = t * kTile + avx2::kHalf * h;
      const float* bh = bias ? bias + c : nullptr;
      auto run = [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        if constexpr (F == kQ8_0)
          avx2::q8_half_rows<T, R>(x, k, w, t, h, nb, bh, y + c, n);
        else if constexpr (F == kQ6_K)
          avx2::q6k_half_rows<T, R>(x, k, w, t, h, nb, bh, y + c, n);
        else
          avx2::q4_half_rows<F, T, R>(x, k, xsum, w, t, h, nb, bh, y + c, n);
      };
      by_rows(m, run);
    }
}

}  // namespace
#endif

#ifdef KVTOP_QUANT_PACKING
namespace {

// m rows of x fp32 [M, K] as int16 per block of 32 (quant_packed.h's RowsI16).
template <int64_t F>
void quantize_rows(const float* x, int64_t m, int64_t k, RowsI16& out) {
  const int64_t blocks = m * (k / kBlock);
  out.pairs.resize(blocks * kBlock / 2);
  out.scale.resize(blocks);
  for (int64_t i = 0; i < blocks; ++i)
    quantize_block<F>(x + i * kBlock, reinterpret_cast<int16_t*>(out.pairs.data() + i * kBlock / 2), out.scale[i]);
  if constexpr (F == kQ6_K) {  // words 0..15 of a block are its first 16 values (reordered within each 8)
    const int16_t* words = reinterpret_cast<const int16_t*>(out.pairs.data());
    out.half_sums.assign(2 * blocks, 0);
    for (int64_t i = 0; i < 2 * blocks; ++i)
      for (int v = 0; v < 16; ++v) out.half_sums[i] += words[16 * i + v];
  }
}

}  // namespace
#endif

// Whether gemv takes these rows: up to 4, bf16 or fp32.
bool gemv_takes(const at::Tensor& x) {
  return supported() && x.dim() == 2 && x.size(0) <= 4 &&
         (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat);
}

namespace {

// gemv's and gemv_silu_mul's checks of a call (`op` names it in the error): a packed weight of n
// columns, x 1-4 bf16 or fp32 rows of its K, the bias a contiguous float32 [N].
void check_call(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t n,
                const std::optional<at::Tensor>& bias, const char* op) {
  check_packable(packed, format, n, op);
  TORCH_CHECK(!x.is_cuda() && gemv_takes(x), op, ": x must be a bfloat16 or float32 [M <= 4, K]");
  const int64_t group_values = kvtop_quant::group_blocks(format) * kBlock;
  TORCH_CHECK(x.size(1) % group_values == 0 &&
                  packed.size(1) == x.size(1) / group_values * kvtop_quant::group_bytes(format),
              op, ": x's K does not match the weight's");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                op, ": bias must be a contiguous float32 [N]");
}

// f(p) with p a float32 tensor's data, or a bfloat16 one's as its bits (uint16_t*).
template <typename F>
void with_lanes(const at::Tensor& t, const F& f) {
  if (t.scalar_type() == at::kFloat)
    f(t.data_ptr<float>());
  else
    f(reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()));
}

}  // namespace

#ifdef KVTOP_QUANT_PACKING
namespace {

// What gemv and gemv_silu_mul do before their tiles, on the calling thread, once their checks pass:
// take x in fp32 (a bf16 x widened here rather than by x.to(kFloat), whose dispatch and allocation
// cost more than the conversion of a few rows: a decode step makes ~90 of these calls), Q4's
// per-block sums of x (the offset term; Q8_0 and Q6_K have none), x as int16 rows; then
// run(f, rows, xsum) with f the weight's format as a constant. m is not 0.
template <typename Run>
void with_rows(const at::Tensor& x, int64_t format, const Run& run) {
  const int64_t k = x.size(1), m = x.size(0), nb = k / kBlock;
  const at::Tensor xc = x.contiguous();  // x itself where it already is
  thread_local kvtop::AlignedVector<float> widened;
  const float* xp = nullptr;
  if (xc.scalar_type() == at::kFloat) {
    xp = xc.data_ptr<float>();
  } else {
    widened.resize(m * k);
    // through locals: indexing the thread_local in the loop looked its address up (__tls_get_addr,
    // the library being loaded at run time) for every element — 3 ns an element, 30 % of a call at
    // K = 1,536 — and kept the loop from vectorizing
    float* out = widened.data();
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    const int64_t count = m * k;
    for (int64_t i = 0; i < count; ++i) {
      const uint32_t bits = static_cast<uint32_t>(xb[i]) << 16;
      std::memcpy(out + i, &bits, 4);
    }
    xp = out;
  }
  std::vector<float> xsum(format == kQ8_0 || format == kQ6_K ? 0 : m * nb);
  for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i) xsum[i] = block_sum(xp + i * kBlock);
  kvtop_quant::by_format(format, [&](auto f) {  // every format the kernels run is packed
    thread_local RowsI16 quantized;
    quantize_rows<decltype(f)::value>(xp, m, k, quantized);
    const RowsI16& rows = quantized;  // this thread's: the workers read it through this reference
    run(f, rows, xsum.data());
  });
}

// Tiles a task: ~16 KiB of weight, so that the small projections still split across threads.
int64_t tiles_per_task(const at::Tensor& packed) {
  return std::max<int64_t>(1, (16 << 10) / (kTile * packed.size(1)));
}

}  // namespace
#endif

// x [M <= 4, K] bf16 or fp32 @ W^T (+ bias fp32 [N]) -> [M, N] in x's dtype, W packed (pack above).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t n,
                const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "quant_packed_gemv: this build has no AVX2 with FMA and F16C");
  check_call(x, packed, format, n, bias, "quant_packed_gemv");
  const int64_t k = x.size(1), m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
#ifdef KVTOP_QUANT_PACKING
  if (m == 0) return y;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  with_rows(x, format, [&](auto f, const RowsI16& rows, const float* xsum) {
    constexpr int64_t F = decltype(f)::value;
    with_lanes(y, [&](auto* yp) {
      at::parallel_for(0, n / kTile, tiles_per_task(packed), [&](int64_t t0, int64_t t1) {
        tiles<F>(rows, m, k, xsum, wp, t0, t1, bp, yp, n);
      });
    });
  });
#endif
  return y;
}

// SiLU-and-mul of a gate/up weight packed with gate and up tiles alternating (gate_up_tiles below):
// x [M <= 4, K] bf16 or fp32 -> [M, inter] in x's dtype, silu(gate) * up. Each task computes a tile
// pair into a small buffer in x's dtype and writes its SiLU-and-mul: the values gemv followed by
// gate_up_tiles give, bit for bit, without the [M, 2 inter] output, its second pass over it, and that
// call's parallel region (SmolLM2 Q4_1, one sequence, a Zen 4: ~2.5 us a layer).
at::Tensor gemv_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t inter,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(gate_up_supported(), "quant_gate_up: this build has no AVX-512 with BF16");
  TORCH_CHECK(inter > 0 && inter % kTile == 0, "quant_gate_up: inter must be a positive multiple of 16");
  check_call(x, packed, format, 2 * inter, bias, "quant_gate_up");
  const int64_t k = x.size(1), m = x.size(0);
  at::Tensor out = at::empty({m, inter}, x.options());
#ifdef KVTOP_QUANT_PACKED
  if (m == 0) return out;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  with_rows(x, format, [&](auto f, const RowsI16& rows, const float* xsum) {
    constexpr int64_t F = decltype(f)::value;
    with_lanes(out, [&](auto* op) {
      using T = std::remove_pointer_t<decltype(op)>;
      at::parallel_for(0, inter / kTile, std::max<int64_t>(1, tiles_per_task(packed) / 2), [&](int64_t p0, int64_t p1) {
        alignas(64) T pair[4 * 2 * kTile];  // up to 4 rows of a gate tile, then its up tile
        for (int64_t p = p0; p < p1; ++p) {
          for (int64_t half = 0; half < 2; ++half) {
            const int64_t t = 2 * p + half;
            tile<F>(rows, m, k, xsum, wp, t, bp ? bp + t * kTile : nullptr, pair + half * kTile, 2 * kTile);
          }
          for (int64_t r = 0; r < m; ++r)
            silu_mul_row16(pair + r * 2 * kTile, pair + r * 2 * kTile + kTile, op + r * inter + p * kTile);
        }
      });
    });
  });
#endif
  return out;
}

// Tile t's 16 columns of every sub-block as a 16-lane segment of the panel rows (dequant_panel, below).
namespace {
#ifdef KVTOP_QUANT_PACKED
template <int64_t F>
void panel_rows(const uint8_t* w, int64_t t, int64_t nb, int64_t width, float* seg) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t b = 0; b < nb; ++b) {
    const Sub sub = packed_sub<F>(w, t, b, nb);
    prefetch_block<F>(sub.values);
    float* rows = seg + b * kBlock * width;
    if constexpr (F == kQ8_0) {
      for (int r = 0; r < 16; ++r) {  // row r's (column, parity) lanes: even and odd into rows 2r, 2r + 1
        __m512 lo, hi;
        q8_row(sub.values, r, lo, hi);
        _mm512_storeu_ps(rows + (2 * r) * width, _mm512_mul_ps(sub.d, _mm512_permutex2var_ps(lo, even, hi)));
        _mm512_storeu_ps(rows + (2 * r + 1) * width, _mm512_mul_ps(sub.d, _mm512_permutex2var_ps(lo, odd, hi)));
      }
    } else {
      for (int g = 0; g < 4; ++g)
        for (int i = 0; i < 8; ++i)
          _mm512_storeu_ps(rows + (8 * g + i) * width, packed_weight<F>(sub, 8 * g + i));
    }
  }
}
#elif defined(KVTOP_QUANT_PACKING)
using avx2::panel_rows;
#endif
}  // namespace

// Columns [p * width, p * width + width) of a packed weight as fp32 panel rows: out [K, width], row k
// holding W[col, k] — the reference's values (mul then add; Q4_0's d * (q - 8); Q8_0's d * q), zero
// past N — for quant_gemm.cpp's panels (fp32 rows past the decode rows, and bf16 ones without AMX).
// A tile's 16 columns are a 16-lane segment of every panel row: no transpose.
void dequant_panel(const uint8_t* w, int64_t format, int64_t p, int64_t n, int64_t k, int64_t width, float* out) {
#ifdef KVTOP_QUANT_PACKING
  const int64_t nb = k / kBlock;
  for (int64_t i = 0; i < width / kTile; ++i) {
    const int64_t t = p * (width / kTile) + i;
    float* seg = out + i * kTile;
    if (t * kTile >= n) {
      for (int64_t row = 0; row < k; ++row) std::memset(seg + row * width, 0, kTile * sizeof(float));
      continue;
    }
    kvtop_quant::by_format(format, [&](auto f) { panel_rows<decltype(f)::value>(w, t, nb, width, seg); });
  }
#else
  (void)w, (void)format, (void)p, (void)n, (void)k, (void)width, (void)out;
  TORCH_CHECK(false, "quant_packed: this build has no AVX2 with FMA and F16C");
#endif
}

// The output of a gate/up weight packed with gate and up tiles alternating (quant_linear.py's
// QuantGateUp: columns 32g .. 32g + 15 are gate columns 16g .. 16g + 15, the next 16 the same up
// columns), y [M, 2I] float32 or bfloat16: silu false, the dense [gate, up] order [M, 2I]; silu true,
// SiLU-and-mul [M, I] — fused_ops.cpp's silu_and_mul on the dense order, bit for bit (bf16_simd.h's
// silu_mul16, which the AMX epilogue runs too).
at::Tensor gate_up_tiles(const at::Tensor& y, int64_t inter, bool silu) {
  TORCH_CHECK(y.dim() == 2 && y.size(1) == 2 * inter && inter % kTile == 0 && y.is_contiguous() &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              "quant_gate_up: a contiguous [M, 2I] float32 or bfloat16 output of 16k-column tiles expected");
  const int64_t m = y.size(0), width = silu ? inter : 2 * inter;
  at::Tensor out = at::empty({m, width}, y.options());
#ifdef KVTOP_QUANT_PACKED
  with_lanes(out, [&](auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    const T* yp = reinterpret_cast<const T*>(y.data_ptr());
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* src = yp + r * 2 * inter;
        T* dst = op + r * width;
        for (int64_t g = 0; g < inter / kTile; ++g) {
          const T* gate = src + 2 * kTile * g;
          if (silu) {
            silu_mul_row16(gate, gate + kTile, dst + kTile * g);
          } else {
            std::memcpy(dst + kTile * g, gate, kTile * sizeof(T));
            std::memcpy(dst + inter + kTile * g, gate + kTile, kTile * sizeof(T));
          }
        }
      }
    });
  });
#else
  TORCH_CHECK(false, "quant_gate_up: this build has no AVX-512 with BF16");
#endif
  return out;
}

}  // namespace kvtop_packed

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def("quant_packed_supported() -> bool", &kvtop_packed::supported);
  m.def("quant_gate_up_supported() -> bool", &kvtop_packed::gate_up_supported);
  m.def("quant_pack(Tensor blocks, int format, int n) -> Tensor", &kvtop_packed::pack);
  m.def("quant_unpack(Tensor packed, int format, int n) -> Tensor", &kvtop_packed::unpack);
  m.def("quant_packed_rows(Tensor packed, Tensor ids, int n) -> Tensor", &kvtop_packed::packed_q8_rows);
  m.def("quant_packed_gemv(Tensor x, Tensor packed, int format, int n, Tensor? bias) -> Tensor", &kvtop_packed::gemv);
}
