// fp32 linear layers on AVX-512 or AVX2 over a weight packed in column panels (issue #13).
//
// Why: at a decode step's batch (16-64 rows) MKL's sgemm, which nn.Linear calls, repacks the weight
// on every call and, the weight coming from DRAM, does not overlap that stream with its multiplies:
// SmolLM2-135M's projections at 64 rows ran at ~170 GFLOP/s in a decode step where the two cores'
// FMA units allow ~335. This kernel holds the weight packed once, as panels of 48 output columns
// ([ceil(N/48), K, 48], zero-padded: one contiguous stream per panel), and computes y = x W^T + b
// with an 8-row x 48-column block of 24 accumulators, x's values broadcast along K. K runs in
// passes of kKC (on AVX-512 all of SmolLM2's K in one: the panel's slice is read from L2; AVX2 keeps
// it in L1, see kKC);
// the next panel is prefetched into L2 meanwhile. Any number of rows (a 2,048-token prefill step
// runs about even with MKL). Sums run in another order than MKL's: results agree to fp32 rounding
// (tests/test_packed_linear.py), not bit for bit; but each output is one fixed sequence of FMAs, so
// a row's result does not depend on how many rows the call has.
//
// Built where the target has AVX-512F, or AVX2 with FMA (-march=native: an AMD Zen 3 takes the AVX2
// block below, 1.6x MKL's AVX2 sgemm at 64 rows); elsewhere `fp32_linear_supported()` is false and
// engine/model/panel_linear.py keeps nn.Linear.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "panel_gemm.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define KVTOP_FP32_GEMM 1
#include <immintrin.h>
#include <cstring>
#endif

// As in fused_ops.cpp: no mul+add turned into an fma, so that bf16_simd.h's SiLU-and-mul in the gate/up
// epilogue below computes exactly as the separate op does. (The GEMM itself calls fma explicitly.)
#pragma GCC optimize("fp-contract=off")
#include "bf16_simd.h"

namespace {

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
void block(const float* a, int64_t lda, const float* b, int64_t kc, const float* in, const float* bias, float* out,
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
void block_or_smaller(int64_t mr, const float* a, int64_t lda, const float* b, int64_t kc, const float* in,
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
void panel_item(const float* x, int64_t m0, int64_t m1, int64_t k, const float* panel, int64_t n0, int64_t n,
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
    const int64_t blocks = (m1 - m0 + kMR - 1) / kMR, lines = next ? kc * kNR * 4 / 64 : 0;
    const int64_t share = (lines + blocks - 1) / blocks;
    for (int64_t m = m0; m < m1; m += kMR) {
      const int64_t first_line = std::min(lines, (m - m0) / kMR * share);
      const char* pf = reinterpret_cast<const char*>(next + k0 * kNR) + 64 * first_line;
      float* slot = buf + (m - m0) * kNR;
      if (to_y && m + kMR < m1) {  // the next block's output lines, for writing, while this one multiplies
        for (int64_t r = m + kMR; r < std::min(m1, m + 2 * kMR); ++r)
          for (int64_t c = 0; c < kNR; c += 16)
            _mm_prefetch(reinterpret_cast<const char*>(y + r * n + n0 + c), _MM_HINT_ET0);
      }
      block_or_smaller<kMR>(std::min(kMR, m1 - m), x + m * k + k0, k, panel + k0 * kNR, kc,
                            k0 == 0 ? nullptr : slot, (k0 == 0 && bias) ? padded_bias : nullptr,
                            to_y ? y + m * n + n0 : slot, to_y ? n : kNR, pf, std::min(share, lines - first_line));
    }
  }
  if (!whole)
    for (int64_t r = m0; r < m1; ++r) std::memcpy(y + r * n + n0, buf + (r - m0) * kNR, cols * sizeof(float));
}
#endif

bool fp32_linear_supported() {
#ifdef KVTOP_FP32_GEMM
  return true;
#else
  return false;
#endif
}

// What fp32_gemm and fp32_gate_up_silu take: fp32 CPU tensors, W packed as a contiguous [ceil(N/48),
// K, 48] with x's last dim as K, N matching it, the bias a float32 [N]. `op` names the op in the error.
void check_operands(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                    const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat && !x.is_cuda() &&
                  !packed.is_cuda(),
              op, ": float32 CPU tensors expected");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kNR && x.size(-1) == packed.size(1),
              op, ": the weight must be packed as a contiguous [ceil(N/48), K, 48] with x's last dim as K");
  kvtop_panels::check_n_and_bias(packed, n, bias, op);
}

// x [..., K] fp32 @ W^T (+ bias [N]) -> [..., N] fp32, W packed as [ceil(N/48), K, 48].
at::Tensor fp32_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n) {
#ifndef KVTOP_FP32_GEMM
  TORCH_CHECK(false, "fp32_gemm: this build has neither AVX-512 nor AVX2 with FMA");
#endif
  check_operands(x, packed, n, bias, "fp32_gemm");
  const int64_t k = packed.size(1);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  at::Tensor out = kvtop_panels::output_for(x, n);
#ifdef KVTOP_FP32_GEMM
  if (m == 0) return out;
  const float* xp = x2.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const int64_t panels = packed.size(0);
  kvtop_panels::for_each_item(m, panels, kMC, [&](int64_t m0, int64_t m1, int64_t p) {
    const float* next = p + 1 < panels ? wp + (p + 1) * k * kNR : nullptr;
    panel_item(xp, m0, m1, k, wp + p * k * kNR, p * kNR, n, bp, yp, next);
  });
#endif
  return out;
}

bool fp32_gate_up_supported() {
#if defined(KVTOP_FP32_GEMM) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// An MLP's gate/up projection with SiLU-and-mul in its epilogue: x [..., K] fp32 @ W^T (+ bias) for a
// gate/up weight W [2I, K] packed as fp32_gemm's panels (I a multiple of 48: gate panels 0..I/48-1, up
// panels after them), then silu(gate) * up -> [..., I]. A work item computes one gate panel and its up
// panel for its rows into two buffers (the same sums as fp32_gemm's) and writes the 48 products: the
// [rows, 2I] output is never written nor read back. Bit for bit silu_and_mul(fp32_gemm(...)) on
// AVX-512 (the same silu_mul16); tests/test_gate_up_silu.py.
at::Tensor fp32_gate_up_silu(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                             int64_t inter) {
  TORCH_CHECK(fp32_gate_up_supported(), "fp32_gate_up_silu: this build has no AVX-512");
  TORCH_CHECK(inter > 0 && inter % kNR == 0, "fp32_gate_up_silu: the intermediate size must be a multiple of 48");
  check_operands(x, packed, 2 * inter, bias, "fp32_gate_up_silu");
  const int64_t k = packed.size(1);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  at::Tensor out = kvtop_panels::output_for(x, inter);
#if defined(KVTOP_FP32_GEMM) && defined(__AVX512F__)
  if (m == 0) return out;
  const float* xp = x2.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const int64_t half = inter / kNR;  // gate panels; up panel j + half pairs with gate panel j
  kvtop_panels::for_each_item(m, half, kMC, [&](int64_t m0, int64_t m1, int64_t j) {
    alignas(64) float gate[kMC * kNR];
    alignas(64) float up[kMC * kNR];
    const float* xr = xp + m0 * k;
    const float* gate_panel = wp + j * k * kNR;
    const float* up_panel = wp + (j + half) * k * kNR;
    const float* next_gate = j + 1 < half ? gate_panel + k * kNR : nullptr;
    panel_item(xr, 0, m1 - m0, k, gate_panel, 0, kNR, bp ? bp + j * kNR : nullptr, gate, up_panel);
    panel_item(xr, 0, m1 - m0, k, up_panel, 0, kNR, bp ? bp + inter + j * kNR : nullptr, up, next_gate);
    for (int64_t r = 0; r < m1 - m0; ++r)
      for (int64_t c = 0; c < kNR; c += 16)
        _mm512_storeu_ps(yp + (m0 + r) * inter + j * kNR + c,
                         kvtop_simd::silu_mul16<false>(_mm512_load_ps(gate + r * kNR + c),
                                                       _mm512_load_ps(up + r * kNR + c)));
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def("fp32_linear_supported() -> bool", &fp32_linear_supported);
  m.def("fp32_gemm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &fp32_gemm);
  m.def("fp32_gate_up_supported() -> bool", &fp32_gate_up_supported);
  m.def("fp32_gate_up_silu(Tensor x, Tensor packed, Tensor? bias, int inter) -> Tensor", &fp32_gate_up_silu);
}
