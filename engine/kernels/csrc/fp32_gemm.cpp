// fp32 linear layers on AVX-512 over a weight packed in column panels (issue #13).
//
// Why: at a decode step's batch (16-64 rows) MKL's sgemm, which nn.Linear calls, repacks the weight
// on every call and, the weight coming from DRAM, does not overlap that stream with its multiplies:
// SmolLM2-135M's projections at 64 rows ran at ~170 GFLOP/s in a decode step where the two cores'
// FMA units allow ~335. This kernel holds the weight packed once, as panels of 48 output columns
// ([ceil(N/48), K, 48], zero-padded: one contiguous stream per panel), and computes y = x W^T + b
// with an 8-row x 48-column block of 24 accumulators, x's values broadcast along K. K runs in
// passes of kKC so a panel's slice (24 KiB) stays in L1 across all the row blocks of a work item;
// the next panel is prefetched into L2 meanwhile. Any number of rows (a 2,048-token prefill step
// runs about even with MKL). Sums run in another order than MKL's: results agree to fp32 rounding
// (tests/test_packed_linear.py), not bit for bit; but each output is one fixed sequence of FMAs, so
// a row's result does not depend on how many rows the call has.
//
// Built where the target has AVX-512F (-march=native on such a CPU); elsewhere
// `fp32_linear_supported()` is false and engine/model/panel_linear.py keeps nn.Linear.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kNR = 48;  // output columns per panel: three vectors of 16

#ifdef __AVX512F__
constexpr int64_t kMR = 8;    // rows per register block: 8 x 3 accumulators
constexpr int64_t kKC = 128;  // K per pass: the panel's 128 x 48 floats stay in L1 over the row blocks
constexpr int64_t kMC = 64;    // rows per work item (its x rows stay in L2 across panels; 128 and 256 measured slower)

// out[0..MR) x [0..48) = in (or the bias, or zero, where in is null) + a[0..MR) x [0, kc) . b (the
// panel's slice). `in` is the item's contiguous buffer (row stride 48); `out` that buffer, or y (row
// stride ldo) on K's last pass, where `masks` keep the valid columns of a short last panel.
template <int MR>
void block(const float* a, int64_t lda, const float* b, int64_t kc, const float* in, const float* bias, float* out,
           int64_t ldo, const __mmask16 (&masks)[3], const char* pf, int64_t pf_lines) {
  __m512 acc[MR][3];
  for (int v = 0; v < 3; ++v) {
    const __m512 init = bias ? _mm512_maskz_loadu_ps(masks[v], bias + 16 * v) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) acc[m][v] = in ? _mm512_loadu_ps(in + m * kNR + 16 * v) : init;
  }
  const int64_t per = (pf_lines + kc - 1) / kc;  // prefetches per K step
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t j = k * per; j < std::min(pf_lines, (k + 1) * per); ++j) _mm_prefetch(pf + 64 * j, _MM_HINT_T1);
    const float* bk = b + k * kNR;
    const __m512 b0 = _mm512_loadu_ps(bk), b1 = _mm512_loadu_ps(bk + 16), b2 = _mm512_loadu_ps(bk + 32);
    for (int m = 0; m < MR; ++m) {
      const __m512 av = _mm512_set1_ps(a[m * lda + k]);
      acc[m][0] = _mm512_fmadd_ps(av, b0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(av, b1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(av, b2, acc[m][2]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 3; ++v) _mm512_mask_storeu_ps(out + m * ldo + 16 * v, masks[v], acc[m][v]);
}

void rows_block(int64_t mr, const float* a, int64_t lda, const float* b, int64_t kc, const float* in,
                const float* bias, float* out, int64_t ldo, const __mmask16 (&masks)[3], const char* pf,
                int64_t pf_lines) {
  switch (mr) {
    case 8: return block<8>(a, lda, b, kc, in, bias, out, ldo, masks, pf, pf_lines);
    case 7: return block<7>(a, lda, b, kc, in, bias, out, ldo, masks, pf, pf_lines);
    case 6: return block<6>(a, lda, b, kc, in, bias, out, ldo, masks, pf, pf_lines);
    case 5: return block<5>(a, lda, b, kc, in, bias, out, ldo, masks, pf, pf_lines);
    case 4: return block<4>(a, lda, b, kc, in, bias, out, ldo, masks, pf, pf_lines);
    case 3: return block<3>(a, lda, b, kc, in, bias, out, ldo, masks, pf, pf_lines);
    case 2: return block<2>(a, lda, b, kc, in, bias, out, ldo, masks, pf, pf_lines);
    default: return block<1>(a, lda, b, kc, in, bias, out, ldo, masks, pf, pf_lines);
  }
}

// One work item: rows [m0, m1) of x against panel p, all of K. Partial sums between K's passes live
// in a contiguous buffer, not in y, whose rows (N floats apart: SmolLM2's 3,072 is 12 KiB) would all
// fall in the same few cache sets.
void panel_item(const float* x, int64_t m0, int64_t m1, int64_t k, const float* panel, int64_t n0, int64_t n,
                const float* bias, float* y, const float* next) {
  alignas(64) float buf[kMC * kNR];
  const int64_t cols = std::min(kNR, n - n0);
  __mmask16 masks[3];
  const __mmask16 all[3] = {0xffff, 0xffff, 0xffff};
  for (int v = 0; v < 3; ++v) {
    const int64_t valid = std::clamp<int64_t>(cols - 16 * v, 0, 16);
    masks[v] = static_cast<__mmask16>((1u << valid) - 1);
  }
  for (int64_t k0 = 0; k0 < k; k0 += kKC) {
    const int64_t kc = std::min(kKC, k - k0);
    const bool last = k0 + kc >= k;
    // the next panel's slice, into L2 while this one is multiplied, spread over the row blocks: the
    // weights of a decode step come from DRAM, and with the hardware prefetcher alone SmolLM2's
    // linears at 64 rows took ~1.3x as long
    const int64_t blocks = (m1 - m0 + kMR - 1) / kMR, lines = next ? kc * kNR * 4 / 64 : 0;
    const int64_t share = (lines + blocks - 1) / blocks;
    for (int64_t m = m0; m < m1; m += kMR) {
      const int64_t first_line = std::min(lines, (m - m0) / kMR * share);
      const char* pf = reinterpret_cast<const char*>(next + k0 * kNR) + 64 * first_line;
      float* slot = buf + (m - m0) * kNR;
      if (last && m + kMR < m1) {  // the next block's output lines, for writing, while this one multiplies
        for (int64_t r = m + kMR; r < std::min(m1, m + 2 * kMR); ++r)
          for (int64_t c = 0; c < cols; c += 16)
            _mm_prefetch(reinterpret_cast<const char*>(y + r * n + n0 + c), _MM_HINT_ET0);
      }
      rows_block(std::min(kMR, m1 - m), x + m * k + k0, k, panel + k0 * kNR, kc, k0 == 0 ? nullptr : slot,
                 (k0 == 0 && bias) ? bias + n0 : nullptr, last ? y + m * n + n0 : slot, last ? n : kNR,
                 last ? masks : all, pf, std::min(share, lines - first_line));
    }
  }
}
#endif

bool fp32_linear_supported() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

// x [..., K] fp32 @ W^T (+ bias [N]) -> [..., N] fp32, W packed as [ceil(N/48), K, 48].
at::Tensor fp32_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n) {
#ifndef __AVX512F__
  TORCH_CHECK(false, "fp32_gemm: this build has no AVX-512");
#endif
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat && !x.is_cuda() &&
                  !packed.is_cuda(),
              "fp32_gemm: float32 CPU tensors expected");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kNR && x.size(-1) == packed.size(1),
              "fp32_gemm: the weight must be packed as a contiguous [ceil(N/48), K, 48] with x's last dim as K");
  TORCH_CHECK(n > 0 && (n + kNR - 1) / kNR == packed.size(0) && packed.size(1) > 0,
              "fp32_gemm: n does not match the packed weight, or K is 0");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "fp32_gemm: bias must be a contiguous float32 [N]");
  }
  const int64_t k = packed.size(1);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options());
#ifdef __AVX512F__
  if (m == 0) return out;
  const float* xp = x2.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const int64_t panels = packed.size(0), chunks = (m + kMC - 1) / kMC;
  // item i: row chunk i / panels, panel i % panels; a thread's run of items shares its x rows
  at::parallel_for(0, chunks * panels, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t chunk = i / panels, p = i % panels;
      const int64_t m0 = chunk * kMC, m1 = std::min(m, m0 + kMC);
      const float* next = p + 1 < panels ? wp + (p + 1) * k * kNR : nullptr;
      panel_item(xp, m0, m1, k, wp + p * k * kNR, p * kNR, n, bp, yp, next);
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def("fp32_linear_supported() -> bool", &fp32_linear_supported);
  m.def("fp32_gemm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &fp32_gemm);
}
