// fp32 linear layers for a few rows (a decode step's batch) on AVX-512 (issue #13).
//
// Why: MKL's sgemm, which nn.Linear calls, multiplies 16 rows by SmolLM2's fp32 weights at about
// 100 GFLOP/s on a 2-core Sapphire Rapids (12 GB/s of weights), where the cores' FMA units allow
// ~300 and memory ~38 GB/s (MKL's own 1-row GEMV reaches that). At 16 rows a decode step of kvctl
// serve spends most of its time there. This kernel reads the weight as nn.Linear holds it (W [N, K]
// row-major: no second copy) and computes y = x W^T + b as dot products along K: a block of 4 rows
// of x against 4 rows of W, 16 accumulators of 16 lanes, each W row one sequential stream, and the
// lanes summed once at the end. Sums run in another order than MKL's: results agree to fp32
// rounding (tests/test_packed_linear.py), not bit for bit.
//
// Built where the target has AVX-512F (-march=native on such a CPU); elsewhere `fp32_linear_supported()`
// is false and engine/model/packed_linear.py keeps nn.Linear.

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

#ifdef __AVX512F__
constexpr int64_t kRowsW = 4;  // rows of W (outputs) per block
constexpr int64_t kRowsX = 4;  // rows of x per block (8 x 2, 8 x 3 and 6 x 4 measured no better)

// y[0..MR) x [0..NR) = x rows . W rows, over all of K (masked tail), plus bias.
template <int MR, int NR>
void dot_block(const float* x, int64_t ldx, const float* w, int64_t k, const float* bias, float* y, int64_t ldy) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
    __m512 wv[NR];
    for (int n = 0; n < NR; ++n) {
      // the next block's rows (the weight is one stream): loaded while this block is multiplied,
      // which for more than 4 rows of x takes several passes over it
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + NR) * k + kk), _MM_HINT_T0);
      wv[n] = _mm512_loadu_ps(w + n * k + kk);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + kk);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  if (kk < k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - kk)) - 1);
    __m512 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm512_maskz_loadu_ps(mask, w + n * k + kk);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * ldx + kk);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) y[m * ldy + n] = _mm512_reduce_add_ps(acc[m][n]) + (bias ? bias[n] : 0.0f);
}

template <int MR>
void rows_block(const float* x, int64_t ldx, const float* w, int64_t k, const float* bias, float* y, int64_t ldy,
                int64_t nr) {
  switch (nr) {
    case 4: return dot_block<MR, 4>(x, ldx, w, k, bias, y, ldy);
    case 3: return dot_block<MR, 3>(x, ldx, w, k, bias, y, ldy);
    case 2: return dot_block<MR, 2>(x, ldx, w, k, bias, y, ldy);
    default: return dot_block<MR, 1>(x, ldx, w, k, bias, y, ldy);
  }
}

void block(const float* x, int64_t ldx, const float* w, int64_t k, const float* bias, float* y, int64_t ldy,
           int64_t mr, int64_t nr) {
  switch (mr) {
    case 8: return rows_block<8>(x, ldx, w, k, bias, y, ldy, nr);
    case 7: return rows_block<7>(x, ldx, w, k, bias, y, ldy, nr);
    case 6: return rows_block<6>(x, ldx, w, k, bias, y, ldy, nr);
    case 5: return rows_block<5>(x, ldx, w, k, bias, y, ldy, nr);
    case 4: return rows_block<4>(x, ldx, w, k, bias, y, ldy, nr);
    case 3: return rows_block<3>(x, ldx, w, k, bias, y, ldy, nr);
    case 2: return rows_block<2>(x, ldx, w, k, bias, y, ldy, nr);
    default: return rows_block<1>(x, ldx, w, k, bias, y, ldy, nr);
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

// x [..., K] fp32 @ W[N, K]^T (+ bias [N]) -> [..., N] fp32.
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(fp32_linear_supported(), "fp32_linear: this build has no AVX-512");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && !x.is_cuda() && !weight.is_cuda(),
              "fp32_linear: float32 CPU tensors expected");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && x.size(-1) == weight.size(1),
              "fp32_linear: weight must be a contiguous [N, K] with x's last dim as K");
  const int64_t n = weight.size(0), k = weight.size(1);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "fp32_linear: bias must be a contiguous float32 [N]");
  }
#ifdef __AVX512F__
  const float* xp = x2.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const int64_t blocks = (n + kRowsW - 1) / kRowsW;
  // a thread takes a run of W's rows (one stream each) and every row of x against them
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRowsW, nr = std::min(kRowsW, n - n0);
      for (int64_t m0 = 0; m0 < m; m0 += kRowsX) {
        block(xp + m0 * k, k, wp + n0 * k, k, bp ? bp + n0 : nullptr, yp + m0 * n + n0, n,
              std::min(kRowsX, m - m0), nr);
      }
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def("fp32_linear_supported() -> bool", &fp32_linear_supported);
  m.def("fp32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &fp32_linear);
}
