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

// As in fused_ops.cpp: no mul+add turned into an fma, so that bf16_simd.h's SiLU-and-mul in the gate/up
// epilogue below computes exactly as the separate op does. (The GEMM itself calls fma explicitly.)
#pragma GCC optimize("fp-contract=off")
#include "bf16_simd.h"
#include "fp32_panel.h"  // the register blocks and the work item (shared with csrc/quant_gemm.cpp)

namespace {

using namespace kvtop_fp32;

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
