// What the causal prefill attention kernels share (amx_attention.cpp in bf16, fp32_attention.cpp in
// fp32): the contract's checks and how a call is cut into tasks.
//
// q [S, N, Hq, D], k and v [S, L, Hkv, D] (S sequences of N new tokens over L keys each, the new
// tokens the last N; last dims contiguous; Hq a multiple of Hkv). One task is (sequence, KV head,
// up to 256 queries): a kernel lays out the keys that task's queries can see once and runs every
// query head of the group over them.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

namespace kvtop_causal {

constexpr int64_t kTaskQueries = 256;  // queries per task
constexpr int64_t kMaxHeadDim = 256;

struct Shape {
  int64_t s, n, hq, d, l, hkv;
  int64_t chunks() const { return (n + kTaskQueries - 1) / kTaskQueries; }
  int64_t tasks() const { return s * hkv * chunks(); }
};

// The contract's checks, each failing with `name: what`; the head size a multiple of `dim_multiple`.
inline Shape check(const char* name, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                   at::ScalarType dtype, int64_t dim_multiple) {
  TORCH_CHECK(q.scalar_type() == dtype && k.scalar_type() == dtype && v.scalar_type() == dtype && !q.is_cuda() &&
                  !k.is_cuda() && !v.is_cuda(),
              name, ": ", dtype == at::kFloat ? "float32" : "bfloat16", " CPU q, k, v expected");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, name, ": [S, N, H, D] tensors expected");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3), name,
              ": k and v must be [S, L, Hkv, D] with q's S and D");
  const Shape sh{q.size(0), q.size(1), q.size(2), q.size(3), k.size(1), k.size(2)};
  TORCH_CHECK(sh.hkv > 0 && sh.hq % sh.hkv == 0, name, ": query heads must be a multiple of KV heads");
  TORCH_CHECK(sh.d % dim_multiple == 0 && sh.d <= kMaxHeadDim, name, ": head_dim must be a multiple of ", dim_multiple,
              " up to 256");
  TORCH_CHECK(sh.n <= sh.l, name, ": more queries than keys");
  TORCH_CHECK(scale > 0, name, ": the scale must be positive");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, name, ": last dims must be contiguous");
  return sh;
}

struct Task {
  int64_t b, h, q0, q1;  // sequence, KV head, queries [q0, q1)
};

// Task t of a call. A head's chunks go in the order first, last, second, second to last...: later
// chunks see more keys, and a thread's run of tasks then mixes heavy and light ones.
inline Task task(const Shape& sh, int64_t t) {
  const int64_t chunks = sh.chunks();
  const int64_t z = t % chunks, c = z % 2 == 0 ? z / 2 : chunks - 1 - z / 2;
  const int64_t q0 = c * kTaskQueries;
  return {t / (sh.hkv * chunks), (t / chunks) % sh.hkv, q0, std::min(sh.n, q0 + kTaskQueries)};
}

}  // namespace kvtop_causal
