// What csrc/fp32_gemm.cpp and csrc/bf16_gemm.cpp share: a weight packed in panels of kPanel output
// columns, the checks on a call's n and bias, its output, the split of the work into
// (row chunk, panel) items, and an item's share of the next panel to prefetch. Plain C++: both kernels
// include it in every build (AVX2 too).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace kvtop_panels {

constexpr int64_t kPanel = 48;  // output columns per panel

// n matches the packed weight's panel count and K is not 0; the bias, where given, is a contiguous
// float32 [n] (both kernels add it in fp32). `op` names the op in the error.
inline void check_n_and_bias(const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                             const char* op) {
  TORCH_CHECK(n > 0 && (n + kPanel - 1) / kPanel == packed.size(0) && packed.size(1) > 0, op,
              ": n does not match the packed weight, or K is 0");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                op, ": bias must be a contiguous float32 [N]");
  }
}

// x's shape and dtype with the last dim n, uninitialized.
inline at::Tensor output_for(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return at::empty(shape, x.options());
}

// An item's share of the next panel's slice, prefetched into L2 while this panel is multiplied, spread
// over its register blocks: block i's first line and line count.
struct PrefetchShare {
  int64_t lines, share;
  PrefetchShare(int64_t lines, int64_t blocks) : lines(lines), share((lines + blocks - 1) / blocks) {}
  int64_t first(int64_t block) const { return std::min(lines, block * share); }
  int64_t count(int64_t block) const { return std::min(share, lines - first(block)); }
};

// item(m0, m1, p) for every chunk of `mc` of the m rows against every panel, in parallel. Item i is
// row chunk i / panels, panel i % panels: a thread's run of items shares its x rows.
template <typename Item>
void for_each_item(int64_t m, int64_t panels, int64_t mc, const Item& item) {
  const int64_t chunks = (m + mc - 1) / mc;
  at::parallel_for(0, chunks * panels, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m0 = i / panels * mc;
      item(m0, std::min(m, m0 + mc), i % panels);
    }
  });
}

}  // namespace kvtop_panels
