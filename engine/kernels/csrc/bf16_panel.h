// bf16_gemm.cpp's register blocks and work item over a bf16 weight packed in panels of 48 columns,
// K in pairs ([K/2, 48, 2] per panel), shared with csrc/quant_gemm.cpp, which de-quantizes a packed
// GGUF weight's panel into such a buffer and multiplies it with the same code (as fp32_panel.h is
// shared with its fp32 panels). Inline, in a namespace of its own: each file that includes it compiles
// its own copy. KVTOP_BF16_GEMM is defined where the target has AVX512-BF16 (and BW); panel_item exists
// only there.
#pragma once

#include <algorithm>
#include <cstdint>

#include "panel_gemm.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVTOP_BF16_GEMM 1
#include <immintrin.h>

#include <cstring>

#include "bf16_simd.h"
#endif

namespace kvtop_bf16 {

constexpr int64_t kNR = kvtop_panels::kPanel;  // output columns per panel: three vectors of 16 fp32 accumulators

#ifdef KVTOP_BF16_GEMM
constexpr int64_t kMR = 8;    // rows per register block: 24 accumulators, 3 panel vectors, a broadcast
// K per pass: up to 1,536 (a panel's slice of 144 KiB, read from L2), as csrc/fp32_gemm.cpp's kKC and
// for its reasons. SmolLM2's four projections, 30 layers, Zen 5, alternated in one process, against 256
// (24 KiB, in L1): 2,048 rows 482.6 -> 462.7 ms, 64 rows 15.9 -> 15.1 ms; outputs bit for bit the same.
// On the Zen 4 (32 KiB of L1), 1,536 against 288 and 192: within 1 % at 64, 256 and 2,048 rows.
constexpr int64_t kKC = 1536;
constexpr int64_t kMC = 64;   // rows per work item

// Pairs of K before a block's end at which it takes its output rows' lines for writing (PREFETCHW, as
// fp32_panel.h's item does a block ahead): a GEMM's output is a fresh buffer, and the epilogue's stores
// that missed the caches held the loop up behind them. ~1,150 cycles of multiply-adds ahead; SmolLM2's
// projections at 2,048 rows on the Zen 4, both ways in one process: 2-9 % faster (benchmarks/HISTORY.md,
// #41's seventeenth pass).
constexpr int64_t kOwnAhead = 48;

// Rows [0, MR) of y's 48 columns (96 bytes a row, two or three lines), owned for writing.
template <int MR>
inline void own_rows(const uint16_t* y, int64_t ldy) {
  for (int m = 0; m < MR; ++m) {
    const char* row = reinterpret_cast<const char*>(y + m * ldy);
    _mm_prefetch(row, _MM_HINT_ET0);
    _mm_prefetch(row + 64, _MM_HINT_ET0);
    _mm_prefetch(row + 2 * kNR - 1, _MM_HINT_ET0);
  }
}

// Work run beside a block's multiply-adds, a piece every few pairs of K, where the out-of-order core
// overlaps it with them: quant_gemm.cpp's de-quantization of the next panel (its NextPanel). `unit()`
// is called after every `every` pairs; NoSide, bf16_gemm's, has none.
struct NoSide {
  static constexpr bool kActive = false;
  static constexpr int64_t every = 1;
  void unit() {}
};

// out[0..MR) x [0..48) = in (or the bias, or zero, where in is null) + a[0..MR) x [0, kc) . b, fp32.
// a: bf16 rows (stride lda elements), read as 32-bit pairs; b: the panel's slice, kc/2 rows of 48
// pairs. `in`/`out`: the item's fp32 buffer (row stride 48). On the last pass `y` (bf16, row stride
// ldy) takes the rounded result instead of `out`, when `y` is set.
template <int MR, typename Side>
inline void block(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kc, const float* in, const float* bias,
                  float* out, uint16_t* y, int64_t ldy, const char* pf, int64_t pf_lines, Side* side) {
  __m512 acc[MR][3];
  for (int v = 0; v < 3; ++v) {
    const __m512 init = bias ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) acc[m][v] = in ? _mm512_loadu_ps(in + m * kNR + 16 * v) : init;
  }
  const int64_t pairs = kc / 2, per = (pf_lines + pairs - 1) / std::max<int64_t>(pairs, 1);
  const int64_t own_at = y ? pairs - std::min(pairs, kOwnAhead) : -1;
  // in stretches of the side work's pairs, each a loop of its own: a call inside the multiply-adds' loop
  // would make the compiler keep the accumulators in memory across all of it
  const int64_t stretch = Side::kActive ? side->every : pairs;
  for (int64_t k0 = 0; k0 < pairs; k0 += stretch) {
    const int64_t k1 = std::min(pairs, k0 + stretch);
    for (int64_t kk = k0; kk < k1; ++kk) {
      if (kk == own_at) own_rows<MR>(y, ldy);
      for (int64_t j = kk * per; j < std::min(pf_lines, (kk + 1) * per); ++j) _mm_prefetch(pf + 64 * j, _MM_HINT_T1);
      const uint16_t* bk = b + kk * 2 * kNR;
      const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bk));
      const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bk + 32));
      const __m512bh b2 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bk + 64));
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, a + m * lda + 2 * kk, sizeof(pair));
        const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], av, b0);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], av, b1);
        acc[m][2] = _mm512_dpbf16_ps(acc[m][2], av, b2);
      }
    }
    if constexpr (Side::kActive) side->unit();
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 3; ++v) {
      if (y)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + 16 * v), kvtop_simd::bf16_pack(acc[m][v]));
      else
        _mm512_storeu_ps(out + m * kNR + 16 * v, acc[m][v]);
    }
}

template <int MR, typename Side>
inline void block_or_smaller(int64_t mr, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kc,
                             const float* in, const float* bias, float* out, uint16_t* y, int64_t ldy, const char* pf,
                             int64_t pf_lines, Side* side) {
  if constexpr (MR > 1) {
    if (mr < MR) return block_or_smaller<MR - 1>(mr, a, lda, b, kc, in, bias, out, y, ldy, pf, pf_lines, side);
  }
  block<MR>(a, lda, b, kc, in, bias, out, y, ldy, pf, pf_lines, side);
}

// One work item: rows [m0, m1) of x against panel p, all of K (fp32_gemm.cpp's panel_item). A short
// last panel's rows end in the fp32 buffer; their valid columns are rounded into y from there. `side`:
// work to run beside the multiply-adds (NoSide above).
template <typename Side = NoSide>
inline void panel_item(const uint16_t* x, int64_t m0, int64_t m1, int64_t k, const uint16_t* panel, int64_t n0,
                       int64_t n, const float* bias, uint16_t* y, const uint16_t* next, Side* side = nullptr) {
  alignas(64) float buf[kMC * kNR];
  alignas(64) float padded_bias[kNR] = {};
  const int64_t cols = std::min(kNR, n - n0);
  const bool whole = cols == kNR;
  if (bias) std::memcpy(padded_bias, bias + n0, cols * sizeof(float));
  for (int64_t k0 = 0; k0 < k; k0 += kKC) {
    const int64_t kc = std::min(kKC, k - k0);
    const bool to_y = k0 + kc >= k && whole;
    // the next panel's slice, into L2 while this one is multiplied, spread over the row blocks
    const kvtop_panels::PrefetchShare prefetch(next ? kc * kNR * 2 / 64 : 0, (m1 - m0 + kMR - 1) / kMR);
    for (int64_t m = m0; m < m1; m += kMR) {
      const int64_t i = (m - m0) / kMR;
      const char* pf = reinterpret_cast<const char*>(next + k0 * kNR) + 64 * prefetch.first(i);
      float* slot = buf + (m - m0) * kNR;
      block_or_smaller<kMR>(std::min(kMR, m1 - m), x + m * k + k0, k, panel + k0 * kNR, kc, k0 == 0 ? nullptr : slot,
                            (k0 == 0 && bias) ? padded_bias : nullptr, slot, to_y ? y + m * n + n0 : nullptr, n, pf,
                            prefetch.count(i), side);
    }
  }
  if (!whole) {
    alignas(64) uint16_t row[kNR];
    for (int64_t r = m0; r < m1; ++r) {
      for (int v = 0; v < 3; ++v)
        _mm256_store_si256(reinterpret_cast<__m256i*>(row + 16 * v),
                           kvtop_simd::bf16_pack(_mm512_load_ps(buf + (r - m0) * kNR + 16 * v)));
      std::memcpy(y + r * n + n0, row, cols * sizeof(uint16_t));
    }
  }
}
#endif

}  // namespace kvtop_bf16
