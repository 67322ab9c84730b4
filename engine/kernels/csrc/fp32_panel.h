// fp32_gemm.cpp's register blocks and work item over a weight packed in panels of 48 columns
// ([K, 48] per panel), shared with csrc/quant_gemm.cpp, which de-quantizes a GGUF weight's panel into
// such a buffer and multiplies it with the same code. Inline, in a namespace of its own: each file
// that includes it compiles its own copy, for its own target. KVTOP_FP32_GEMM is defined where the
// target has AVX-512F, or AVX2 with FMA; panel_item exists only there.
#pragma once

#include <algorithm>
#include <cstdint>

#include "panel_gemm.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define KVTOP_FP32_GEMM 1
#include <immintrin.h>
#include <cstring>
#endif

namespace kvtop_fp32 {

constexpr int64_t kNR = kvtop_panels::kPanel;  // output columns per panel: three vectors of 16, or six of 8

#ifdef KVTOP_FP32_GEMM
// The one thing that differs between the two targets: the vector and how many rows a register
// block holds. AVX-512 has 32 registers: 8 rows x 3 accumulators, 3 panel vectors, a broadcast.
// AVX2 (AMD Zen 3, older Intel) has 16: 2 rows x 6 accumulators, one panel vector at a time, two
// broadcasts — 8 loads per 12 FMAs, inside what both cores' load ports sustain from L1.
#ifdef __AVX512F__
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int64_t kMR = 8;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vbroadcast(float x) { return _mm512_set1_ps(x); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#else
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int64_t kMR = 2;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vbroadcast(float x) { return _mm256_set1_ps(x); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int kVecs = kNR / kLanes;
// K per pass. AVX-512: up to 1,536 (a panel's slice of 288 KiB, in L2 beside the item's x rows). A
// register block reads 3 panel lines per 24 FMAs, 16 B a cycle, well inside L2's 64; what fewer passes
// save is the partial sums' round trip through the buffer and the block set-up of each pass. Zen 5, 2
// threads, SmolLM2's 30 layers' four projections, alternated in one process: 2,048 rows 865 -> 815 ms,
// 64 rows 29.0 -> 27.1 ms against 128 (256: 841 / 28.1; 576: 829 / 27.2). Each output's FMAs are the
// same sequence whatever the pass length, so results do not change. AVX2 keeps 128 (24 KiB, in L1):
// its block reads 6 panel vectors per 12 FMAs, 32 B a cycle, all that a Zen 3's L2 gives L1.
#ifdef __AVX512F__
constexpr int64_t kKC = 1536;
#else
constexpr int64_t kKC = 128;
#endif
constexpr int64_t kMC = 64;   // rows per work item (its x rows stay in L2 across panels; 128 and 256 measured slower)

// out[0..MR) x [0..48) = in (or the bias, or zero, where in is null) + a[0..MR) x [0, kc) . b (the
// panel's slice). `in` is the item's contiguous buffer (row stride 48), `out` that buffer or y (row
// stride ldo); `bias` is 48 floats (a short last panel's padded with zeros).
template <int MR>
inline void block(const float* a, int64_t lda, const float* b, int64_t kc, const float* in, const float* bias, float* out,
           int64_t ldo, const char* pf, int64_t pf_lines) {
  Vec acc[MR][kVecs];
  for (int v = 0; v < kVecs; ++v) {
    const Vec init = bias ? vload(bias + kLanes * v) : vzero();
    for (int m = 0; m < MR; ++m) acc[m][v] = in ? vload(in + m * kNR + kLanes * v) : init;
  }
  const int64_t per = (pf_lines + kc - 1) / kc;  // prefetches per K step
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t j = k * per; j < std::min(pf_lines, (k + 1) * per); ++j) _mm_prefetch(pf + 64 * j, _MM_HINT_T1);
    const float* bk = b + k * kNR;
    if constexpr (kVecs == 3) {  // AVX-512: the panel's row in three registers, one broadcast at a time
      const Vec b0 = vload(bk), b1 = vload(bk + kLanes), b2 = vload(bk + 2 * kLanes);
      for (int m = 0; m < MR; ++m) {
        const Vec av = vbroadcast(a[m * lda + k]);
        acc[m][0] = vfma(av, b0, acc[m][0]);
        acc[m][1] = vfma(av, b1, acc[m][1]);
        acc[m][2] = vfma(av, b2, acc[m][2]);
      }
    } else {  // AVX2: every row's broadcast held, the panel's row one register at a time
      Vec av[MR];
      for (int m = 0; m < MR; ++m) av[m] = vbroadcast(a[m * lda + k]);
      for (int v = 0; v < kVecs; ++v) {
        const Vec bv = vload(bk + kLanes * v);
        for (int m = 0; m < MR; ++m) acc[m][v] = vfma(av[m], bv, acc[m][v]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) vstore(out + m * ldo + kLanes * v, acc[m][v]);
}

template <int MR>
inline void block_or_smaller(int64_t mr, const float* a, int64_t lda, const float* b, int64_t kc, const float* in,
                      const float* bias, float* out, int64_t ldo, const char* pf, int64_t pf_lines) {
  if constexpr (MR > 1) {
    if (mr < MR) return block_or_smaller<MR - 1>(mr, a, lda, b, kc, in, bias, out, ldo, pf, pf_lines);
  }
  block<MR>(a, lda, b, kc, in, bias, out, ldo, pf, pf_lines);
}

// One work item: rows [m0, m1) of x against panel p, all of K. Partial sums between K's passes live
// in a contiguous buffer, not in y, whose rows (N floats apart: SmolLM2's 3,072 is 12 KiB) would all
// fall in the same few cache sets. A short last panel's rows are written to the buffer, then their
// valid columns copied out.
inline void panel_item(const float* x, int64_t m0, int64_t m1, int64_t k, const float* panel, int64_t n0, int64_t n,
                const float* bias, float* y, const float* next) {
  alignas(64) float buf[kMC * kNR];
  alignas(64) float padded_bias[kNR] = {};
  const int64_t cols = std::min(kNR, n - n0);
  const bool whole = cols == kNR;
  if (bias) std::memcpy(padded_bias, bias + n0, cols * sizeof(float));
  for (int64_t k0 = 0; k0 < k; k0 += kKC) {
    const int64_t kc = std::min(kKC, k - k0);
    const bool last = k0 + kc >= k, to_y = last && whole;
    // the next panel's slice, into L2 while this one is multiplied, spread over the row blocks: the
    // weights of a decode step come from DRAM, and with the hardware prefetcher alone SmolLM2's
    // linears at 64 rows took ~1.3x as long
    const kvtop_panels::PrefetchShare prefetch(next ? kc * kNR * 4 / 64 : 0, (m1 - m0 + kMR - 1) / kMR);
    for (int64_t m = m0; m < m1; m += kMR) {
      const int64_t i = (m - m0) / kMR;
      const char* pf = reinterpret_cast<const char*>(next + k0 * kNR) + 64 * prefetch.first(i);
      float* slot = buf + (m - m0) * kNR;
      if (to_y && m + kMR < m1) {  // the next block's output lines, for writing, while this one multiplies
        for (int64_t r = m + kMR; r < std::min(m1, m + 2 * kMR); ++r)
          for (int64_t c = 0; c < kNR; c += 16)
            _mm_prefetch(reinterpret_cast<const char*>(y + r * n + n0 + c), _MM_HINT_ET0);
      }
      block_or_smaller<kMR>(std::min(kMR, m1 - m), x + m * k + k0, k, panel + k0 * kNR, kc,
                            k0 == 0 ? nullptr : slot, (k0 == 0 && bias) ? padded_bias : nullptr,
                            to_y ? y + m * n + n0 : slot, to_y ? n : kNR, pf, prefetch.count(i));
    }
  }
  if (!whole)
    for (int64_t r = m0; r < m1; ++r) std::memcpy(y + r * n + n0, buf + (r - m0) * kNR, cols * sizeof(float));
}
#endif

}  // namespace kvtop_fp32
