// Prefill attention in bf16 over the paged cache with AVX512-BF16's vdpbf16ps, for CPUs that have it
// without AMX (AMD Zen 4; issue #13).
//
// Why: there, a bf16 prefill step's attention went to the fp32 kernel (fp32_attention.cpp) on fp32
// copies of q and of every sequence's K/V gathered out of the cache, one call per shape of sequence:
// 15 % of a 2,048-token step of SmolLM2 (8 calls a layer of 3 tasks each on 2 threads). Here the
// products take bf16 pairs (twice fp32's products an instruction), K and V are read where they lie in
// the blocks, and one call serves every sequence of the step.
//
// q [T, Hq, D] bf16: the new tokens of every sequence packed (sequence s owns rows cu[s] .. cu[s + 1]);
// k_cache, v_cache [blocks, block_size, Hkv, D] bf16 through block_tables [S, W] int32; seq_lens [S]
// counts each sequence's keys, its new tokens the last ones: new token i of s sees keys 0 .. seq_lens[s]
// - n_s + i. One task is (sequence, KV head, up to kTaskQueries new tokens): it lays out the keys its
// last query sees once (K transposed in pairs of dims, V in pairs of keys, as vdpbf16ps reads them)
// and runs every query head of the group over them, kRows queries at a time: the scores (fp32 sums of
// exact bf16 products), the exact softmax of each row over its visible keys in fp32 (cephes_exp.h),
// the probabilities rounded to bf16 for P V (as torch's flash kernel and amx_attention.cpp do), the
// output divided by the row sums and rounded to bf16 once. Tasks go out heaviest first, each to the
// next thread that is free. Within bf16 rounding of the reference (tests/test_bf16_attention.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "aligned_vector.h"
#include "bf16_simd.h"
#include "cephes_exp.h"
#include "row_blocks.h"

namespace {

using kvtop_rows::kRows;               // queries per pass
constexpr int64_t kTaskQueries = 64;   // new tokens per task
constexpr int64_t kPad = 16;           // a row pitch of a power of two puts a pass's rows in a few L1 sets
constexpr int64_t kMaxHeadDim = 256;

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// One call's inputs as the tasks read them.
struct Call {
  const uint16_t *q, *k, *v;
  uint16_t* out;
  int64_t q_token, q_head;                         // q's strides (elements)
  int64_t block_stride, row_stride, head_stride;   // the caches' (the same for K and V)
  int64_t block_size, hq, hkv, d;
  const int32_t* tables;
  int64_t table_width;
  const int64_t *cu, *lens;
  float scale;
};

struct Task {
  int64_t seq, head, q0, q1, cost;
};

#if defined(__AVX512BF16__)
// acc[m][v] = sum over k < kc of a[m * lda + k] . b[k * ldb + 16 v] (each a bf16 pair: vdpbf16ps), for
// m < MR, v < NV; stored to out[m * ldo + 16 v].
struct Product {
  template <int MR, int NV>
  static void run(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t kc, float* out,
                  int64_t ldo) {
    __m512 acc[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; ++k) {
      __m512bh bv[NV];
      for (int v = 0; v < NV; ++v) bv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + k * ldb + 16 * v));
      for (int m = 0; m < MR; ++m) {
        const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(a[m * lda + k])));
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], av, bv[v]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + m * ldo + 16 * v, acc[m][v]);
  }
};

// Key (or value) row j of one sequence's KV head, found through its block table.
inline const uint16_t* cache_row(const Call& c, const uint16_t* cache, const int32_t* table, int64_t head, int64_t j) {
  return cache + table[j / c.block_size] * c.block_stride + (j % c.block_size) * c.row_stride + head * c.head_stride;
}

// Keys [0, nk) transposed in pairs of dims: kt[p * pitch + j] holds dims (2p, 2p + 1) of key j; zeros
// from nk to the pitch.
void layout_keys(const Call& c, const int32_t* table, int64_t head, int64_t nk, int64_t pitch, uint32_t* kt) {
  const int64_t pairs = c.d / 2;
  for (int64_t p = 0; p < pairs; ++p) std::fill(kt + p * pitch + nk, kt + (p + 1) * pitch, 0u);
  for (int64_t j = 0; j < nk; ++j) {
    const auto* row = reinterpret_cast<const uint32_t*>(cache_row(c, c.k, table, head, j));
    for (int64_t p = 0; p < pairs; ++p) kt[p * pitch + j] = row[p];
  }
}

// Values of keys [0, nk) in pairs of keys: vp[t * D + i] holds dim i of keys (2t, 2t + 1); a last odd
// key's partner is zero.
void layout_values(const Call& c, const int32_t* table, int64_t head, int64_t nk, uint32_t* vp) {
  for (int64_t j = 0; j < nk; j += 2) {
    const uint16_t* lo = cache_row(c, c.v, table, head, j);
    const uint16_t* hi = j + 1 < nk ? cache_row(c, c.v, table, head, j + 1) : nullptr;
    uint32_t* dst = vp + (j / 2) * c.d;
    for (int64_t i = 0; i < c.d; i += 16) {
      const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + i)));
      const __m512i b = hi ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + i)))
                           : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + i, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// The first n of 16 lanes (none for n <= 0, all for n >= 16).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
}

// One row's softmax numerators exp(scale * (s - max)) over its `live` keys, rounded to bf16 into p
// (zeros from live to width, a multiple of 16); returns their fp32 sum.
float softmax_row(const float* s, int64_t live, int64_t width, float scale, uint16_t* p) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < live; j += 16) {
    const __mmask16 on = first_lanes(live - j);
    vmax = _mm512_mask_max_ps(vmax, on, vmax, _mm512_maskz_loadu_ps(on, s + j));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * scale), vscale = _mm512_set1_ps(scale);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), vscale, m);
    const __m512 e = _mm512_maskz_mov_ps(first_lanes(live - j), kvtop_exp::exp16(x));
    vsum = _mm512_add_ps(vsum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return _mm512_reduce_add_ps(vsum);
}

struct Scratch {
  kvtop::AlignedVector<uint32_t> kt, vp, q, p;  // keys, values, a pass's queries and probabilities (bf16 pairs)
  kvtop::AlignedVector<float> s, o;             // a pass's scores and output
};

// Query rows [i0, i0 + rows) of `head` for sequence t.seq, over the laid-out keys (pitch `pitch`).
void attend_rows(const Call& c, const Task& t, int64_t head, int64_t i0, int64_t rows, int64_t pitch, Scratch& w) {
  const int64_t n = c.cu[t.seq + 1] - c.cu[t.seq], offset = c.lens[t.seq] - n, half = c.d / 2;
  const int64_t keys = offset + i0 + rows, width = round_up(keys, 16);  // what the pass's last query sees
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(&w.q[r * half], c.q + (c.cu[t.seq] + i0 + r) * c.q_token + head * c.q_head, sizeof(uint16_t) * c.d);
  kvtop_rows::rows_product<Product>(rows, w.q.data(), half, w.kt.data(), pitch, half, width, w.s.data(), pitch);
  float inv[kRows];
  auto* p = reinterpret_cast<uint16_t*>(w.p.data());
  for (int64_t r = 0; r < rows; ++r)
    inv[r] = 1.f / softmax_row(&w.s[r * pitch], offset + i0 + r + 1, width, c.scale, p + r * pitch);
  kvtop_rows::rows_product<Product>(rows, w.p.data(), pitch / 2, w.vp.data(), c.d, (keys + 1) / 2, c.d, w.o.data(),
                                    c.d);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* dst = c.out + ((c.cu[t.seq] + i0 + r) * c.hq + head) * c.d;
    const __m512 iv = _mm512_set1_ps(inv[r]);
    for (int64_t i = 0; i < c.d; i += 16) {
      const __m256i bits = kvtop_simd::bf16_pack(_mm512_mul_ps(_mm512_loadu_ps(&w.o[r * c.d + i]), iv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), bits);
    }
  }
}

void attend_task(const Call& c, const Task& t, Scratch& w) {
  const int64_t n = c.cu[t.seq + 1] - c.cu[t.seq], nk = c.lens[t.seq] - n + t.q1;
  const int64_t pitch = round_up(nk, 16) + kPad;
  const int32_t* table = c.tables + t.seq * c.table_width;
  w.kt.resize(c.d / 2 * pitch);
  w.vp.resize((nk + 1) / 2 * c.d);
  w.q.resize(kRows * c.d / 2);
  w.p.resize(kRows * pitch / 2);
  w.s.resize(kRows * pitch);
  w.o.resize(kRows * c.d);
  layout_keys(c, table, t.head, nk, pitch, w.kt.data());
  layout_values(c, table, t.head, nk, w.vp.data());
  const int64_t group = c.hq / c.hkv;
  for (int64_t head = t.head * group; head < (t.head + 1) * group; ++head)
    for (int64_t i0 = t.q0; i0 < t.q1; i0 += kRows) attend_rows(c, t, head, i0, std::min(kRows, t.q1 - i0), pitch, w);
}

void run(const Call& c, int64_t seqs) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t n = c.cu[s + 1] - c.cu[s], offset = c.lens[s] - n;
    for (int64_t h = 0; h < c.hkv; ++h)
      for (int64_t q0 = 0; q0 < n; q0 += kTaskQueries) {
        const int64_t q1 = std::min(n, q0 + kTaskQueries);
        tasks.push_back({s, h, q0, q1, (q1 - q0) * (offset + (q0 + q1) / 2)});
      }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<size_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    thread_local Scratch w;  // grown once per thread, reused by every layer's call
    for (size_t i = next++; i < tasks.size(); i = next++) attend_task(c, tasks[i], w);
  });
}
#endif  // __AVX512BF16__

bool bf16_attention_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// The contract's checks; a wrong table is an error, not a read of some other memory.
void check(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
           const int64_t* cu, const int64_t* lens, int64_t seqs) {
  constexpr const char* kName = "bf16_paged_prefill: ";
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && !q.is_cuda() && !k_cache.is_cuda(),
              kName, "bfloat16 CPU q and caches expected");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.strides() == v_cache.strides(), kName, "q [tokens, heads, dim] and two caches alike [blocks, block_size, kv_heads, dim] expected");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1, kName, "the head dim must be contiguous");
  const int64_t d = q.size(2), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && d % 16 == 0 && d <= kMaxHeadDim, kName, "head_dim must be a multiple of 16 up to 256, the same in q and the cache");
  TORCH_CHECK(hkv > 0 && q.size(1) % hkv == 0, kName, "query heads must be a multiple of KV heads");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.is_contiguous() && tables.size(0) >= seqs,
              kName, "block_tables: int32 [num_seqs, width]");
  TORCH_CHECK(cu[0] == 0 && cu[seqs] == q.size(0), kName, "cu_seqlens_q must run from 0 to the number of query tokens");
  const int64_t bs = k_cache.size(1), width = tables.size(1);
  const int32_t* t = tables.data_ptr<int32_t>();
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t n = cu[s + 1] - cu[s];
    TORCH_CHECK(n >= 0, kName, "cu_seqlens_q must not decrease");
    TORCH_CHECK(n <= lens[s], kName, "sequence ", s, " has more new tokens than keys");
    const int64_t needed = (lens[s] + bs - 1) / bs;
    TORCH_CHECK(n == 0 || needed <= width, kName, "seq_lens reach past the block table");
    for (int64_t b = 0; n > 0 && b < needed; ++b)
      TORCH_CHECK(t[s * width + b] >= 0 && t[s * width + b] < k_cache.size(0), kName, "block table entry ",
                  t[s * width + b], " is not a block of the cache");
  }
}

at::Tensor bf16_paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                              const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(bf16_attention_supported(), "bf16_paged_prefill: this build has no AVX512-BF16");
  const at::Tensor cu = cu_seqlens_q.to(at::kLong).contiguous(), lens = seq_lens.to(at::kLong).contiguous();
  const int64_t seqs = lens.numel();
  TORCH_CHECK(cu.numel() == seqs + 1, "bf16_paged_prefill: cu_seqlens_q must be [num_seqs + 1]");
  check(q, k_cache, v_cache, block_tables, cu.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), seqs);
  TORCH_CHECK(scale > 0, "bf16_paged_prefill: the scale must be positive");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
#if defined(__AVX512BF16__)
  const Call c{reinterpret_cast<const uint16_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
               reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
               q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.size(1),
               q.size(1), k_cache.size(2), q.size(2), block_tables.data_ptr<int32_t>(), block_tables.size(1),
               cu.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), static_cast<float>(scale)};
  run(c, seqs);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def("bf16_attention_supported() -> bool", &bf16_attention_supported);
  m.def(
      "bf16_paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q, "
      "Tensor seq_lens, float scale) -> Tensor",
      &bf16_paged_prefill);
}
