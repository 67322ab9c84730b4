// bf16 linear layers on AVX512-BF16 without AMX (AMD Zen 4 and later) over a weight packed in column
// panels (issue #13).
//
// Why: on a CPU with AVX512_BF16 but no AMX tiles, bf16 linears ran on oneDNN's packed GEMM, which
// at a decode step's 1-16 rows streamed the weights at 14-18 GB/s on a 2-core Zen 4 and a 64-sequence
// decode step spent ~55 of its ~90 ms there. This kernel is csrc/fp32_gemm.cpp's design in bf16: the
// weight packed once as panels of 48 output columns, K in pairs ([ceil(N/48), K/2, 48, 2],
// zero-padded: one contiguous stream per panel), an 8-row x 48-column block of 24 fp32 accumulators,
// each step a pair of x's values broadcast as one 32-bit lane against three vectors of the panel's
// pairs (VDPBF16PS: acc += x[k] w[k] + x[k+1] w[k+1], products exact, sums in fp32). K runs in passes
// of kKC; partial sums stay in fp32 in a contiguous buffer, the output is rounded to bf16 once, as
// c10 rounds (nearest even). SmolLM2's linears against oneDNN's: 1.5-1.6x at 1-4 rows, 1.3x at 16,
// 1.1x at 64, 0.92-0.95x from 256 rows, where both are near the cores' VDPBF16PS peak (one 512-bit
// instruction a cycle: ~410 GFLOP/s on two cores; ours ~390) (benchmarks/HISTORY.md, "Twelfth pass").
// Sums run in another order than oneDNN's: results agree to one bf16 rounding of the exact product
// (tests/test_bf16_panels.py), not bit for bit; each output is one fixed sequence of operations, so
// a row's result does not depend on how many rows the call has.
//
// Built where the target has AVX512_BF16; elsewhere `bf16_linear_supported()` is false and
// engine/model/packed_linear.py keeps oneDNN's (or AMX where the CPU has it: AMX comes first).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "bf16_panel.h"  // the register blocks and work item, shared with quant_gemm.cpp
#include "panel_gemm.h"

namespace {

constexpr int64_t kNR = kvtop_bf16::kNR;

bool bf16_linear_supported() {
#ifdef KVTOP_BF16_GEMM
  return true;
#else
  return false;
#endif
}

// x [..., K] bf16 @ W^T (+ bias [N], fp32) -> [..., N] bf16, W packed as [ceil(N/48), K/2, 48, 2].
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n) {
#ifndef KVTOP_BF16_GEMM
  TORCH_CHECK(false, "bf16_gemm: this build has no AVX512_BF16");
#endif
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && !x.is_cuda() &&
                  !packed.is_cuda(),
              "bf16_gemm: bfloat16 CPU tensors expected");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kNR && packed.size(3) == 2 &&
                  x.size(-1) == 2 * packed.size(1),
              "bf16_gemm: the weight must be packed as a contiguous [ceil(N/48), K/2, 48, 2] with x's last dim as K");
  kvtop_panels::check_n_and_bias(packed, n, bias, "bf16_gemm");
  const int64_t k = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  at::Tensor out = kvtop_panels::output_for(x, n);
#ifdef KVTOP_BF16_GEMM
  if (m == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t panels = packed.size(0);
  kvtop_panels::for_each_item(m, panels, kvtop_bf16::kMC, [&](int64_t m0, int64_t m1, int64_t p) {
    const uint16_t* next = p + 1 < panels ? wp + (p + 1) * k * kNR : nullptr;
    kvtop_bf16::panel_item(xp, m0, m1, k, wp + p * k * kNR, p * kNR, n, bp, yp, next);
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def("bf16_linear_supported() -> bool", &bf16_linear_supported);
  m.def("bf16_gemm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &bf16_gemm);
}
