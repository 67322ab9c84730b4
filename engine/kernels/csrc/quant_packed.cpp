// Q4_0 and Q4_1 weights repacked at load for bf16 decode: the same bytes in the order AVX512-BF16's
// dot product wants (issue #41).
//
// Why: at one to four rows a decode step's time on the file's layout (quant_gemm.cpp's quant_gemv) is
// the de-quantization, not the memory: each nibble is widened to a 32-bit lane, converted and
// multiplied alone, and every block's scale is applied with a horizontal sum. Here 16 output columns
// sit in a register's 16 lanes and one vdpbf16ps multiplies two K values of all 16 columns:
//   - a nibble's value 0..15 is an exact bf16 (a 32-entry vpermw table), and a bf16 activation times
//     it is exact in fp32, so per block of 32 the kernel sums S = sum_k x_k q_k in fp32 and applies
//     the block's scale and offset once for the 16 columns: y += d * S + m * sum_k x_k
//     (Q4_0: m = -8 d). The results are the de-quantized weights' products up to summation order,
//     as quant_gemv's are; the activations must already be bf16 (a bf16 model's).
//   - the per-block sums of x are computed once per call.
//
// The packed layout, for N a multiple of 16: the [N, row bytes] tensor keeps its shape and byte count
// (resident bytes are the file's); its rows 16t .. 16t + 15 (tile t) hold, for each block b of 32 K
// values in turn, 16 * block bytes:
//   d[16] fp16 (one per column), Q4_1 only: m[16] fp16, then 8 chunks of 32 bytes: chunk s, byte
//   2c + e holds column c's element 4s + e in its low nibble and element 4s + 2 + e in its high one,
// so that one chunk widened to 32 words gives, through the table, lanes c = (q[4s], q[4s+1]) from the
// low nibbles and (q[4s+2], q[4s+3]) from the high ones: the pairs vdpbf16ps multiplies by the
// broadcast x pairs (x[4s], x[4s+1]) and (x[4s+2], x[4s+3]).
//
// Q8_0 (the logits head of the default model, packed where AMX takes its batched rows): per tile block
// d[16] fp16, then 16 rows of 32 bytes, row r's byte 2c + e column c's int8 element 2r + e. Its decode
// kernel stays in fp32 (int8 is not a bf16 the table gives): a row widened to 16 lanes of (column,
// parity) is multiplied by the broadcast fp32 pair (x[2r], x[2r + 1]) — one FMA for 8 columns' two
// K values, no horizontal sum until the tile's end; bf16 or fp32 activations alike. Row r is also
// row r of an AMX B tile (amx_linear.cpp).
//
// Every other use of a packed weight (more rows, fp32 activations, the reference) unpacks it to the
// file's layout first (quant_unpack, a copy of the weight's bytes); quant_linear (quant_gemm.cpp)
// routes a packed format (its ggml type + kPackedFormat) here or there.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "quant_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KVTOP_QUANT_PACKED 1
#endif

namespace kvtop_packed {

using kvtop_quant::kBlock;
using kvtop_quant::kQ4_0;
using kvtop_quant::kQ4_1;
using kvtop_quant::kQ8_0;
constexpr int64_t kTile = 16;           // columns per tile: one fp32 register's lanes

bool supported() {
#ifdef KVTOP_QUANT_PACKED
  return true;
#else
  return false;
#endif
}

namespace {

// Bytes before the values in a tile's block: d[16], and m[16] for Q4_1.
constexpr int64_t scale_bytes(int64_t format) { return format == kQ4_1 ? 64 : 32; }

void check_packable(const at::Tensor& blocks, int64_t format, int64_t n, const char* op) {
  TORCH_CHECK(format == kQ4_0 || format == kQ4_1 || format == kQ8_0, op,
              ": only Q4_0, Q4_1 and Q8_0 weights are packed, not ggml type ", format);
  TORCH_CHECK(n % kTile == 0, op, ": N must be a multiple of ", kTile);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() && blocks.size(0) == n,
              op, ": the weight must be a contiguous uint8 [N, row bytes]");
  TORCH_CHECK(blocks.size(1) % kvtop_quant::group_bytes(format) == 0, op, ": a row must be whole blocks");
}

// Element k (0..31) of a file block's nibbles: byte k's low half for k < 16, byte k - 16's high half.
inline uint8_t file_nibble(const uint8_t* qs, int k) { return k < 16 ? qs[k] & 0x0F : qs[k - 16] >> 4; }

// Where Q8_0 element k of column c sits in a tile block's values.
inline int q8_place(int c, int k) { return 32 * (k / 2) + 2 * c + (k & 1); }

// Where element k of column c sits in a tile block's nibbles: the byte, and whether the high half.
inline void packed_place(int c, int k, int& byte, bool& high) {
  const int s = k / 4, r = k % 4;
  byte = 32 * s + 2 * c + (r & 1);
  high = r >= 2;
}

}  // namespace

// The file's blocks [N, row bytes] of Q4_0, Q4_1 or Q8_0 in the packed layout: same shape, same bytes.
at::Tensor pack(const at::Tensor& blocks, int64_t format, int64_t n) {
  check_packable(blocks, format, n, "quant_pack");
  const int64_t bytes = kvtop_quant::group_bytes(format), nb = blocks.size(1) / bytes;
  const int64_t head = format == kQ4_1 ? 4 : 2, scales = scale_bytes(format);
  at::Tensor out = at::empty_like(blocks);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* tb = dst + (t * nb + b) * kTile * bytes;
        std::memset(tb + scales, 0, 256);
        for (int c = 0; c < kTile; ++c) {
          const uint8_t* blk = src + ((t * kTile + c) * nb + b) * bytes;
          std::memcpy(tb + 2 * c, blk, 2);                                // d
          if (format == kQ4_1) std::memcpy(tb + 32 + 2 * c, blk + 2, 2);  // m
          if (format == kQ8_0) {
            for (int k = 0; k < kBlock; ++k) tb[scales + q8_place(c, k)] = blk[2 + k];
            continue;
          }
          for (int k = 0; k < kBlock; ++k) {
            int byte;
            bool high;
            packed_place(c, k, byte, high);
            tb[scales + byte] |= static_cast<uint8_t>(file_nibble(blk + head, k) << (high ? 4 : 0));
          }
        }
      }
  });
  return out;
}

#ifdef KVTOP_QUANT_PACKED
namespace {

// One tile block back to the file's 16 blocks (the scales copied by the caller): chunk s, as 16 words
// (column c: its byte pair), becomes per column the nibbles of elements 4s .. 4s + 3 in four bytes;
// the 8 chunks' dwords are gathered per column (elements 0..31, a byte each), and a file block's
// byte j is element j | element j + 16 << 4.
inline void unpack_nibbles(const uint8_t* nib, uint8_t* const blk[kTile]) {
  alignas(64) uint32_t quads[8][kTile];
  const __m512i mask = _mm512_set1_epi32(0x0F0F);
  for (int s = 0; s < 8; ++s) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + 32 * s)));
    const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), mask);
    _mm512_store_si512(quads[s], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
  const __m256i rows = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);  // quads[s][c]: s * 16 + c
  for (int c = 0; c < kTile; ++c) {
    const __m256i q = _mm256_i32gather_epi32(reinterpret_cast<const int*>(&quads[0][c]), rows, 4);
    const __m128i low = _mm256_castsi256_si128(q), high = _mm256_extracti128_si256(q, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(blk[c]), _mm_or_si128(low, _mm_slli_epi16(high, 4)));
  }
}

}  // namespace
#endif

// The packed weight back in the file's layout (bit for bit the blocks it was packed from).
at::Tensor unpack(const at::Tensor& packed, int64_t format, int64_t n) {
  check_packable(packed, format, n, "quant_unpack");
  TORCH_CHECK(supported(), "quant_unpack: this build has no AVX-512 with BF16");
  at::Tensor out = at::empty_like(packed);
#ifdef KVTOP_QUANT_PACKED
  const int64_t bytes = kvtop_quant::group_bytes(format), nb = packed.size(1) / bytes;
  const int64_t head = format == kQ4_1 ? 4 : 2, scales = scale_bytes(format);
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* tb = src + (t * nb + b) * kTile * bytes;
        uint8_t* blk[kTile];
        for (int c = 0; c < kTile; ++c) {
          blk[c] = dst + ((t * kTile + c) * nb + b) * bytes;
          std::memcpy(blk[c], tb + 2 * c, 2);
          if (format == kQ4_1) std::memcpy(blk[c] + 2, tb + 32 + 2 * c, 2);
          if (format == kQ8_0)
            for (int k = 0; k < kBlock; ++k) blk[c][2 + k] = tb[scales + q8_place(c, k)];
          blk[c] += head;
        }
        if (format != kQ8_0) unpack_nibbles(tb + scales, blk);
      }
  });
#endif
  return out;
}

#ifdef KVTOP_QUANT_PACKED
namespace {

constexpr int kMaxRows = 4;  // quant_linear's decode rows (quant_gemm.cpp's kGemvRows)

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// The nibble table: word i holds bf16(i % 16) (the widened byte's bit 4, the high nibble's lowest,
// lands in the index's top bit for the low-nibble lookup: both halves of the table are the same).
inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(i % 16);
    uint32_t u;
    std::memcpy(&u, &v, 4);
    t[i] = static_cast<uint16_t>(u >> 16);  // exact: an integer below 256 has no bits past bf16's
  }
  return _mm512_load_si512(t);
}

// Tile t's 16 columns for rows [0, R): x bf16 [R, K] (row stride k), xsum fp32 [R, nb] (row stride
// nb), y bf16 [R, 16] at stride ldy (the fp32 sums + bias rounded once, to nearest even). kChains dot-product chains per row (even and odd chunks, low
// and high nibbles for one row) keep the adder busy while the next chunk is widened.
template <int64_t F, int R>
void tile_rows(const uint16_t* x, int64_t k, const float* xsum, const uint8_t* tile, int64_t nb, const __m512i table,
               const float* bias, uint16_t* y, int64_t ldy) {
  constexpr int64_t bytes = F == kQ4_1 ? 20 : 18, scales = scale_bytes(F);
  constexpr int kChains = R == 1 ? 4 : 2;  // a multiple of 2: chain (s % (kChains / 2)) * 2 + high
  __m512 acc[R], macc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), macc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tb = tile + b * kTile * bytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb)));
    const __m512 m = F == kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 32)))
                                : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    const uint8_t* nib = tb + scales;
    __m512 sum[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) sum[r][c] = _mm512_setzero_ps();
    for (int s = 0; s < 8; ++s) {
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + 32 * s)));
      const __m512bh lo = as_bh(_mm512_permutexvar_epi16(w, table));
      const __m512bh hi = as_bh(_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table));
      const int c = (s % (kChains / 2)) * 2;
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * k + b * kBlock + 4 * s;
        int32_t pair_lo, pair_hi;
        std::memcpy(&pair_lo, xr, 4);
        std::memcpy(&pair_hi, xr + 2, 4);
        sum[r][c] = _mm512_dpbf16_ps(sum[r][c], as_bh(_mm512_set1_epi32(pair_lo)), lo);
        sum[r][c + 1] = _mm512_dpbf16_ps(sum[r][c + 1], as_bh(_mm512_set1_epi32(pair_hi)), hi);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 total = _mm512_add_ps(sum[r][0], sum[r][1]);
      for (int c = 2; c < kChains; c += 2) total = _mm512_add_ps(total, _mm512_add_ps(sum[r][c], sum[r][c + 1]));
      acc[r] = _mm512_fmadd_ps(total, d, acc[r]);
      macc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * nb + b]), macc[r]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r], macc[r]), bv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
  }
}

// Q8_0 tile t's 16 columns for rows [0, R): x fp32 [R, K] (row stride k), y [R, 16] of T (bf16 or
// fp32) at stride ldy. Lanes are (column, parity) for columns 0..7 (lo) and 8..15 (hi), summed in
// pairs at the end.
template <typename T, int R>
void q8_tile_rows(const float* x, int64_t k, const uint8_t* tile, int64_t nb, const float* bias, T* y, int64_t ldy) {
  const __m512i pairs_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i pairs_hi = _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tb = tile + b * kTile * 34;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb)));
    __m512 sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_ps();
    for (int row = 0; row < 16; ++row) {
      const uint8_t* q = tb + 32 + 32 * row;
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
      const __m512 hi =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
      for (int r = 0; r < R; ++r) {
        double pair;  // x[2 row], x[2 row + 1], broadcast as one 64-bit lane
        std::memcpy(&pair, x + r * k + b * kBlock + 2 * row, 8);
        const __m512 xp = _mm512_castpd_ps(_mm512_set1_pd(pair));
        sum[r][0] = _mm512_fmadd_ps(lo, xp, sum[r][0]);
        sum[r][1] = _mm512_fmadd_ps(hi, xp, sum[r][1]);
      }
    }
    const __m512 d_lo = _mm512_permutexvar_ps(pairs_lo, d), d_hi = _mm512_permutexvar_ps(pairs_hi, d);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_fmadd_ps(sum[r][0], d_lo, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(sum[r][1], d_hi, acc[r][1]);
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512 cols = _mm512_add_ps(_mm512_permutex2var_ps(acc[r][0], even, acc[r][1]),
                                      _mm512_permutex2var_ps(acc[r][0], odd, acc[r][1]));
    const __m512 out = _mm512_add_ps(cols, bv);
    if constexpr (std::is_same_v<T, float>)
      _mm512_storeu_ps(y + r * ldy, out);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(out)));
  }
}

template <typename T>
void q8_tiles(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t t0, int64_t t1, const float* bias, T* y,
              int64_t n) {
  const int64_t nb = k / kBlock, tile_bytes = kTile * nb * 34;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * tile_bytes;
    const float* bt = bias ? bias + t * kTile : nullptr;
    T* yt = y + t * kTile;
    switch (m) {
      case 1: q8_tile_rows<T, 1>(x, k, tile, nb, bt, yt, n); break;
      case 2: q8_tile_rows<T, 2>(x, k, tile, nb, bt, yt, n); break;
      case 3: q8_tile_rows<T, 3>(x, k, tile, nb, bt, yt, n); break;
      default: q8_tile_rows<T, 4>(x, k, tile, nb, bt, yt, n); break;
    }
  }
}

template <int64_t F>
void tiles(const uint16_t* x, int64_t m, int64_t k, const float* xsum, const uint8_t* w, int64_t t0, int64_t t1,
           const float* bias, uint16_t* y, int64_t n) {
  const int64_t nb = k / kBlock, tile_bytes = kTile * nb * (F == kQ4_1 ? 20 : 18);
  const __m512i table = nibble_table();
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * tile_bytes;
    const float* bt = bias ? bias + t * kTile : nullptr;
    uint16_t* yt = y + t * kTile;
    switch (m) {
      case 1: tile_rows<F, 1>(x, k, xsum, tile, nb, table, bt, yt, n); break;
      case 2: tile_rows<F, 2>(x, k, xsum, tile, nb, table, bt, yt, n); break;
      case 3: tile_rows<F, 3>(x, k, xsum, tile, nb, table, bt, yt, n); break;
      default: tile_rows<F, 4>(x, k, xsum, tile, nb, table, bt, yt, n); break;
    }
  }
}

}  // namespace
#endif

// Whether gemv takes these rows: up to 4; bf16 (Q4_0, Q4_1) or bf16 / fp32 (Q8_0).
bool gemv_takes(const at::Tensor& x, int64_t format) {
  return supported() && x.dim() == 2 && x.size(0) <= 4 &&
         (x.scalar_type() == at::kBFloat16 || (format == kQ8_0 && x.scalar_type() == at::kFloat));
}

#ifdef KVTOP_QUANT_PACKED
namespace {

void q4_gemv(const at::Tensor& x, const uint8_t* wp, int64_t format, int64_t n, int64_t row_bytes, const float* bp,
             at::Tensor& y) {
  const int64_t k = x.size(1), m = x.size(0), nb = k / kBlock;
  const at::Tensor xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  std::vector<float> xsum(m * nb);  // the offset term's per-block sums of x, once per call
  for (int64_t i = 0; i < m * nb; ++i) {
    const __m512 lo = _mm512_cvtpbh_ps(
        reinterpret_cast<__m256bh>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + i * kBlock))));
    const __m512 hi = _mm512_cvtpbh_ps(
        reinterpret_cast<__m256bh>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + i * kBlock + 16))));
    xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // grain: ~16 KiB of weight a task, so that the small projections still split across threads
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / (kTile * row_bytes));
  at::parallel_for(0, n / kTile, grain, [&](int64_t t0, int64_t t1) {
    if (format == kQ4_1)
      tiles<kQ4_1>(xp, m, k, xsum.data(), wp, t0, t1, bp, yp, n);
    else
      tiles<kQ4_0>(xp, m, k, xsum.data(), wp, t0, t1, bp, yp, n);
  });
}

void q8_gemv(const at::Tensor& x, const uint8_t* wp, int64_t n, int64_t row_bytes, const float* bp, at::Tensor& y) {
  const int64_t k = x.size(1), m = x.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / (kTile * row_bytes));
  at::parallel_for(0, n / kTile, grain, [&](int64_t t0, int64_t t1) {
    if (y.scalar_type() == at::kFloat)
      q8_tiles<float>(xp, m, k, wp, t0, t1, bp, y.data_ptr<float>(), n);
    else
      q8_tiles<uint16_t>(xp, m, k, wp, t0, t1, bp, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), n);
  });
}

}  // namespace
#endif

// x [M <= 4, K] @ W^T (+ bias fp32 [N]) -> [M, N] in x's dtype, W packed (pack above): bf16 x for
// Q4_0 and Q4_1, bf16 or fp32 for Q8_0 (gemv_takes).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t n,
                const std::optional<at::Tensor>& bias) {
  check_packable(packed, format, n, "quant_packed_gemv");
  TORCH_CHECK(supported(), "quant_packed_gemv: this build has no AVX-512 with BF16");
  TORCH_CHECK(!x.is_cuda() && gemv_takes(x, format),
              "quant_packed_gemv: x must be a bfloat16 [M <= 4, K] (Q8_0: or float32)");
  const int64_t k = x.size(1), m = x.size(0);
  TORCH_CHECK(k % kBlock == 0 && packed.size(1) == k / kBlock * kvtop_quant::group_bytes(format),
              "quant_packed_gemv: x's K does not match the weight's");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "quant_packed_gemv: bias must be a contiguous float32 [N]");
  at::Tensor y = at::empty({m, n}, x.options());
#ifdef KVTOP_QUANT_PACKED
  if (m > 0) {
    const uint8_t* wp = packed.data_ptr<uint8_t>();
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    if (format == kQ8_0)
      q8_gemv(x, wp, n, packed.size(1), bp, y);
    else
      q4_gemv(x, wp, format, n, packed.size(1), bp, y);
  }
#endif
  return y;
}

}  // namespace kvtop_packed

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def("quant_packed_supported() -> bool", &kvtop_packed::supported);
  m.def("quant_pack(Tensor blocks, int format, int n) -> Tensor", &kvtop_packed::pack);
  m.def("quant_unpack(Tensor packed, int format, int n) -> Tensor", &kvtop_packed::unpack);
  m.def("quant_packed_gemv(Tensor x, Tensor packed, int format, int n, Tensor? bias) -> Tensor", &kvtop_packed::gemv);
}
