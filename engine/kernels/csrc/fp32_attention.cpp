// Causal prefill attention in fp32 on AVX-512 for the CPU engine (issue #13).
//
// Why: in an fp32 prefill step of SmolLM2 (8 prompts x 256 tokens) torch's CPU flash attention took
// ~200 ms of ~1,800 (11 %), ~90 GFLOP/s counting only the causal half. Here a block of 6 queries
// stops at its last visible key and both products run on the register blocking of fp32_gemm.cpp.
//
// q [S, N, Hq, D], k and v [S, L, Hkv, D] (S sequences of N new tokens over L keys each, the new
// tokens the last N; last dims contiguous, any other strides; Hq a multiple of Hkv: GQA), fp32, D a
// multiple of 16 up to 256. Query i of a sequence sees keys 0 .. L - N + i. One task is (sequence,
// KV head, 256 queries): it lays the keys it can see out transposed ([D][keys], zero-padded) once
// and runs every query head of the group over them, 6 queries at a time: scores, the exact softmax
// of each row over its visible keys (cephes_exp.h's exp), P V with V read in place, divided by the
// row sums. Within fp32 rounding of SDPA (tests/test_fp32_attention.py); engine/kernels/cpu_prefill.py
// uses it where the build has AVX-512.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "aligned_vector.h"
#include "causal_tasks.h"
#include "cephes_exp.h"
#include "row_blocks.h"

namespace {


#ifdef __AVX512F__
using kvtop_rows::kRows;

// acc[m][v] = sum over k < kc of a[m * lda + k] * b[k * ldb + 16 v], for m < MR, v < NV; stored to
// out[m * ldo + 16 v].
struct Product {
  template <int MR, int NV>
  static void run(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc, float* out, int64_t ldo) {
    __m512 acc[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; ++k) {
      __m512 bv[NV];
      for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(b + k * ldb + 16 * v);
      for (int m = 0; m < MR; ++m) {
        const __m512 av = _mm512_set1_ps(a[m * lda + k]);
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(av, bv[v], acc[m][v]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + m * ldo + 16 * v, acc[m][v]);
  }
};

struct Scratch {
  kvtop::AlignedVector<float> kt, s, o;  // keys transposed [D][pitch]; a block's scores and output
};

// Row i of s (width `visible` valid, the rest up to `width` zeroed): exp(scale * (s - max)), the
// softmax's numerator; returns its sum.
float softmax_row(float* row, int64_t visible, int64_t width, float scale) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= visible; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + j));
  const __mmask16 tail = static_cast<__mmask16>((1u << (visible - j)) - 1);
  if (j < visible) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, row + j));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * scale), sc = _mm512_set1_ps(scale);
  __m512 vsum = _mm512_setzero_ps();
  for (j = 0; j < width; j += 16) {
    const int64_t left = visible - j;
    const __mmask16 valid = left >= 16 ? 0xffff : left > 0 ? static_cast<__mmask16>((1u << left) - 1) : 0;
    const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(row + j), sc, m);
    const __m512 e = _mm512_maskz_mov_ps(valid, kvtop_exp::exp16(x));
    vsum = _mm512_add_ps(vsum, e);
    _mm512_storeu_ps(row + j, e);
  }
  return _mm512_reduce_add_ps(vsum);
}

void attend_task(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, int64_t b,
                 int64_t h, int64_t q0, int64_t q1, float scale, Scratch& w) {
  const int64_t n = q.size(1), hq = q.size(2), d = q.size(3), l = k.size(1), hkv = k.size(2);
  const int64_t offset = l - n;                       // query i sees keys 0 .. offset + i
  const int64_t nk = offset + q1;                     // keys the task's last query sees
  const int64_t pitch = (nk + 15) / 16 * 16 + 16;     // +16: a pitch of a power of two shares L1 sets
  w.kt.assign(d * pitch, 0.0f);
  // the strides and the buffer in locals: read through the tensors and the thread_local inside the
  // loop, they were reloaded for every element; that transposition and the queries' copy took a
  // third of the kernel's time (16 prompts of 32..482, one thread: 12.2 ms a layer, now 9.1)
  const float* kb = k.data_ptr<float>() + b * k.stride(0) + h * k.stride(2);
  const int64_t kstride = k.stride(1);
  float* kt = w.kt.data();
  // 16 keys at a time: a gather down the keys' rows for each dim, stored along kt's row (the tail's
  // lanes zero, as the padding must be)
  if (kstride < (int64_t{1} << 26)) {  // 16 rows' offsets fit the gather's 32 bits
    const __m512i rows16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(static_cast<int>(kstride)));
    for (int64_t j0 = 0; j0 < nk; j0 += 16) {
      const __mmask16 live = nk - j0 >= 16 ? 0xffff : static_cast<__mmask16>((1u << (nk - j0)) - 1u);
      const float* src = kb + j0 * kstride;
      for (int64_t c = 0; c < d; ++c)
        _mm512_storeu_ps(kt + c * pitch + j0, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, rows16, src + c, 4));
    }
  } else {  // one element at a time
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t c = 0; c < d; ++c) kt[c * pitch + j] = kb[j * kstride + c];
  }
  w.s.resize(kRows * pitch);
  w.o.resize(kRows * d);
  const float* vb = v.data_ptr<float>() + b * v.stride(0) + h * v.stride(2);
  const int64_t vstride = v.stride(1), qstride = q.stride(1), ostride = out.stride(1);
  float* s = w.s.data();
  float* o = w.o.data();
  const int64_t group = hq / hkv;
  for (int64_t head = h * group; head < (h + 1) * group; ++head) {
    const float* qb = q.data_ptr<float>() + b * q.stride(0) + head * q.stride(2);
    float* ob = out.data_ptr<float>() + b * out.stride(0) + head * out.stride(2);
    for (int64_t i0 = q0; i0 < q1; i0 += kRows) {
      const int64_t rows = std::min(kRows, q1 - i0);
      const int64_t keys = offset + i0 + rows;            // the block's last query sees this many
      const int64_t width = (keys + 15) / 16 * 16;
      // the block's queries read where they lie (row stride qstride)
      kvtop_rows::rows_product<Product>(rows, qb + i0 * qstride, qstride, kt, pitch, d, width, s, pitch);
      float inv[kRows];
      for (int64_t r = 0; r < rows; ++r) inv[r] = 1.0f / softmax_row(s + r * pitch, offset + i0 + r + 1, width, scale);
      kvtop_rows::rows_product<Product>(rows, s, pitch, vb, vstride, keys, d, o, d);
      for (int64_t r = 0; r < rows; ++r) {
        float* orow = ob + (i0 + r) * ostride;
        const __m512 iv = _mm512_set1_ps(inv[r]);
        for (int64_t c = 0; c < d; c += 16)
          _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + c), iv));
      }
    }
  }
}
#endif  // __AVX512F__

bool fp32_attention_supported() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

at::Tensor fp32_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
#ifndef __AVX512F__
  TORCH_CHECK(false, "fp32_causal_attention: this build has no AVX-512");
#endif
  const kvtop_causal::Shape sh = kvtop_causal::check("fp32_causal_attention", q, k, v, scale, at::kFloat, 16);
  at::Tensor out = at::empty({sh.s, sh.n, sh.hq, sh.d}, q.options());
  if (sh.s == 0 || sh.n == 0) return out;
#ifdef __AVX512F__
  at::parallel_for(0, sh.tasks(), 1, [&](int64_t t0, int64_t t1) {
    thread_local Scratch w;  // grown once per thread, reused by every layer's call
    for (int64_t t = t0; t < t1; ++t) {
      const kvtop_causal::Task task = kvtop_causal::task(sh, t);
      attend_task(q, k, v, out, task.b, task.h, task.q0, task.q1, static_cast<float>(scale), w);
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def("fp32_attention_supported() -> bool", &fp32_attention_supported);
  m.def("fp32_causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", &fp32_causal_attention);
}
