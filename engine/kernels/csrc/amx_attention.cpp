// Causal prefill attention in bf16 on Intel AMX for the CPU engine (issue #13).
//
// Why: in a bf16 prefill step of SmolLM2 (8 prompts x 256 tokens) torch's CPU flash attention took
// 17 % of the step, 3.3-4.0 ms a layer: it computed the tiles above the diagonal too (causal was no
// faster than full) and ran its products at ~0.5 TFLOP/s. Here the products run on the tile unit
// and a query tile stops at its last visible key.
//
// q [S, N, Hq, D], k and v [S, L, Hkv, D] (S sequences of N new tokens over L keys each, the new
// tokens the last N; last dims contiguous, any other strides; Hq a multiple of Hkv: GQA), bf16,
// D a multiple of 32 up to 256. Query i of a sequence sees keys 0 .. L - N + i. One task is
// (sequence, KV head, 256 queries): it lays out the keys and values it can see as AMX B tiles once
// (K transposed in bf16 pairs of dims, V in pairs of keys) and runs every query head of the group
// over them, 16 queries at a time: scores on the tiles (fp32), the softmax in fp32 (AVX-512; the
// probabilities rounded to bf16 for the second product, as torch's flash kernel does), P V on the
// tiles, divided by the row sums and rounded to bf16 once. Within bf16 rounding of SDPA
// (tests/test_amx_attention.py); engine/kernels/cpu_prefill.py uses it where the CPU has AMX.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "aligned_vector.h"
#include "amx_tiles.h"
#include "causal_tasks.h"
#include "cephes_exp.h"

namespace {

constexpr int64_t kQ = 16;          // queries per tile

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

#ifdef KVTOP_AMX
using Bits = uint16_t;

// Rows of the buffers below are this much longer than their keys: a row pitch of a power of two
// (1 KiB for 256 keys) put a tile's 16 rows in a few L1 sets, and the products stalled on misses.
constexpr int64_t kPitchPad = 16;

// Keys [0, nk) of one (sequence, KV head) as B tiles of the scores' product: kt [D/2][pitch][2], the
// pair of dims (2p, 2p + 1) of key j at kt[(p * pitch + j) * 2 ..]; zeros past nk.
void layout_keys(const Bits* k, int64_t k_stride, int64_t nk, int64_t pitch, int64_t d, Bits* kt) {
  std::memset(kt, 0, sizeof(Bits) * d * pitch);
  for (int64_t j = 0; j < nk; ++j) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(k + j * k_stride);
    uint32_t* col = reinterpret_cast<uint32_t*>(kt) + j;
    for (int64_t p = 0; p < d / 2; ++p) col[p * pitch] = row[p];
  }
}

// Values of keys [0, nk) as B tiles of the second product: vp [kpad/2][D][2], the values of keys
// (2p, 2p + 1) at dim c at vp[(p * D + c) * 2 ..]; zeros past nk.
void layout_values(const Bits* v, int64_t v_stride, int64_t nk, int64_t kpad, int64_t d, Bits* vp) {
  std::memset(vp, 0, sizeof(Bits) * d * kpad);
  for (int64_t j = 0; j < nk; ++j) {
    const Bits* row = v + j * v_stride;
    Bits* out = vp + (j / 2) * d * 2 + (j & 1);
    for (int64_t c = 0; c < d; ++c) out[c * 2] = row[c];
  }
}

// The 16-row A tile at `a` times the B tiles at b, b + 32, b + 64, b + 96 (two or four of them),
// added into C tiles 0..3: one A load for every product, the products independent of each other.
inline void a_times_bs(const Bits* a, int64_t a_stride, const Bits* b, int64_t b_stride, bool four) {
  _tile_loadd(4, a, a_stride);
  _tile_loadd(6, b, b_stride);
  _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(7, b + 32, b_stride);
  _tile_dpbf16ps(1, 4, 7);
  if (four) {
    _tile_loadd(6, b + 64, b_stride);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, b + 96, b_stride);
    _tile_dpbf16ps(3, 4, 7);
  }
}

inline void zero_cs() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// C tiles 0..3 (or 0..1) to dst, dst + 16, ... (fp32, rows `stride` bytes apart).
inline void store_cs(float* dst, int64_t stride, bool four) {
  _tile_stored(0, dst, stride);
  _tile_stored(1, dst + 16, stride);
  if (four) {
    _tile_stored(2, dst + 32, stride);
    _tile_stored(3, dst + 48, stride);
  }
}

// The first n of 16 lanes (none for n <= 0, all for n >= 16).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
}

struct Scratch {
  kvtop::AlignedVector<Bits> kt, vp, q, p;
  kvtop::AlignedVector<float> s, o;
};

// One task: queries [q0, q1) of sequence `b`, every query head of KV head `h`.
void attend_task(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, int64_t b,
                 int64_t h, int64_t q0, int64_t q1, float scale, Scratch& w) {
  const int64_t n = q.size(1), hq = q.size(2), d = q.size(3), l = k.size(1), hkv = k.size(2);
  const int64_t group = hq / hkv, offset = l - n;
  const int64_t nk = std::min(l, offset + q1);  // the keys the task's last query sees
  const int64_t kpad = round_up(nk, 64), kt_pitch = kpad + kPitchPad;
  w.kt.resize(d * kt_pitch);
  w.vp.resize(d * kpad);
  w.q.resize(kQ * d);
  w.p.resize(kQ * (kpad + kPitchPad));
  w.s.resize(kQ * (kpad + kPitchPad));
  w.o.resize(kQ * d);
  const Bits* kb = reinterpret_cast<const Bits*>(k.data_ptr<c10::BFloat16>()) + b * k.stride(0) + h * k.stride(2);
  const Bits* vb = reinterpret_cast<const Bits*>(v.data_ptr<c10::BFloat16>()) + b * v.stride(0) + h * v.stride(2);
  layout_keys(kb, k.stride(1), nk, kt_pitch, d, w.kt.data());
  layout_values(vb, v.stride(1), nk, kpad, d, w.vp.data());
  const Bits* qbase = reinterpret_cast<const Bits*>(q.data_ptr<c10::BFloat16>()) + b * q.stride(0);
  Bits* obase = reinterpret_cast<Bits*>(out.data_ptr<c10::BFloat16>()) + b * out.stride(0);
  const int64_t kt_stride = kt_pitch * 4, vp_stride = d * 4;  // bytes between the rows of a B tile

  for (int64_t head = h * group; head < (h + 1) * group; ++head) {
    for (int64_t t = q0; t < q1; t += kQ) {
      const int64_t rows = std::min(kQ, q1 - t);
      const int64_t seen = std::min(l, offset + t + rows);  // keys the tile's last query sees
      const int64_t ks = round_up(seen, 16), kp = round_up(seen, 32), s_stride = kp + kPitchPad;
      // the queries, zero rows past the last
      std::fill(w.q.begin(), w.q.end(), Bits{0});
      for (int64_t i = 0; i < rows; ++i)
        std::memcpy(&w.q[i * d], qbase + (t + i) * q.stride(1) + head * q.stride(2), sizeof(Bits) * d);
      // scores: 16 queries x 64 keys a pass, four C tiles (independent products in flight), all of D
      int64_t j = 0;
      for (; j + 64 <= ks; j += 64) {
        zero_cs();
        for (int64_t kk = 0; kk < d; kk += 32)
          a_times_bs(&w.q[kk], d * 2, &w.kt[(kk / 2) * kt_pitch * 2 + j * 2], kt_stride, true);
        store_cs(&w.s[j], s_stride * 4, true);
      }
      for (; j < ks; j += 16) {  // the last 16..48 keys up to the diagonal, a tile at a time
        _tile_zero(0);
        for (int64_t kk = 0; kk < d; kk += 32) {
          _tile_loadd(4, &w.q[kk], d * 2);
          _tile_loadd(6, &w.kt[(kk / 2) * kt_pitch * 2 + j * 2], kt_stride);
          _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, &w.s[j], s_stride * 4);
      }
      // softmax over each query's visible keys; probabilities (unnormalized) in bf16, zeros past them
      alignas(64) float inv_sum[kQ];
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int64_t i = 0; i < kQ; ++i) {
        Bits* prow = &w.p[i * s_stride];
        if (i >= rows) {
          std::memset(prow, 0, sizeof(Bits) * kp);
          continue;
        }
        const float* srow = &w.s[i * s_stride];
        const int64_t live = std::min(l, offset + t + i + 1);
        __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (j = 0; j < live; j += 16) {
          const __mmask16 on = first_lanes(live - j);
          vmax = _mm512_mask_max_ps(vmax, on, vmax, _mm512_maskz_loadu_ps(on, srow + j));
        }
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * scale);
        __m512 vsum = _mm512_setzero_ps();
        for (j = 0; j < kp; j += 16) {
          const __m512 e = _mm512_maskz_mov_ps(first_lanes(live - j), kvtop_exp::exp16(_mm512_fmsub_ps(_mm512_loadu_ps(srow + j), vscale, m)));
          vsum = _mm512_add_ps(vsum, e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
        }
        inv_sum[i] = 1.f / _mm512_reduce_add_ps(vsum);
      }
      // P V: 16 queries x 64 dims a pass (four C tiles), keys 32 at a time
      for (int64_t c0 = 0; c0 < d; c0 += 64) {
        const bool four = d - c0 >= 64;  // else the last 32 dims
        zero_cs();
        for (int64_t kk = 0; kk < kp; kk += 32)
          a_times_bs(&w.p[kk], s_stride * 2, &w.vp[(kk / 2) * d * 2 + c0 * 2], vp_stride, four);
        store_cs(&w.o[c0], d * 4, four);
      }
      for (int64_t i = 0; i < rows; ++i) {
        Bits* orow = obase + (t + i) * out.stride(1) + head * out.stride(2);
        const __m512 inv = _mm512_set1_ps(inv_sum[i]);
        for (int64_t c = 0; c < d; c += 16) {
          const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(&w.o[i * d + c]), inv);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + c), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
        }
      }
    }
  }
}
#endif  // KVTOP_AMX

at::Tensor amx_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
#ifdef KVTOP_AMX
  TORCH_CHECK(kvtop_amx::supported(), "amx_causal_attention: this CPU or kernel does not allow AMX");
#else
  TORCH_CHECK(false, "amx_causal_attention: built without AMX");
#endif
  const kvtop_causal::Shape sh = kvtop_causal::check("amx_causal_attention", q, k, v, scale, at::kBFloat16, 32);
  at::Tensor out = at::empty({sh.s, sh.n, sh.hq, sh.d}, q.options());
  if (sh.s == 0 || sh.n == 0) return out;
#ifdef KVTOP_AMX
  at::parallel_for(0, sh.tasks(), 1, [&](int64_t t0, int64_t t1) {
    kvtop_amx::configure_tiles();
    thread_local Scratch w;  // grown once per thread, reused by every layer's call
    for (int64_t t = t0; t < t1; ++t) {
      const kvtop_causal::Task task = kvtop_causal::task(sh, t);
      attend_task(q, k, v, out, task.b, task.h, task.q0, task.q1, static_cast<float>(scale), w);
    }
    kvtop_amx::release_tiles();
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def("amx_causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", &amx_causal_attention);
}
