// Paged attention on the CPU, reading K/V where they lie in the block layout
// [num_blocks, block_size, kv_heads, head_dim] (no gather into a contiguous copy).
//
// One work item is one KV head of one sequence with a set of query rows: decode takes the
// GQA group of the sequence's one token (G rows), prefill a tile of up to kTileTokens new
// tokens times G heads. Each K/V row is loaded (and dequantized) once for all the rows of the
// item; the softmax is online, one key block at a time. Items run in parallel through
// at::parallel_for. Accumulation is fp32 whatever the query and cache dtypes.
//
// Built by engine/kernels/cpu.py (-O3 -march=native -fopenmp); plain omp-simd loops, no vec.h.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "aligned_vector.h"
#include "cephes_exp.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define KVTOP_DECODE_FAST 1  // a decode kernel in intrinsics: AVX-512 (16 lanes) or AVX2 (8 lanes)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTileTokens = 16;
constexpr int64_t kTileRows = 12, kTileBlock = 16;  // prefill tiles of this many rows, blocks of 16: tile_scores
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// fp8 e4m3 to float through a table: the bit-level conversion does not vectorize.
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) {
      t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    }
    return t;
  }();
  return table.data();
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t d, float s) {
  if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    const float* lut = fp8_table();
    const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
    for (int64_t i = 0; i < d; ++i) dst[i] = lut[bits[i]] * s;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * s;
  }
}

inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// exp(x) for x <= 0 (a score minus its row's running max), by cephes_exp.h.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // 2^n stays a normal float; exp(-87) is 1.6e-38, nothing next to 1
  const float n = kvtop_exp::exponent(x);
  return kvtop_exp::reduced(x, n) * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// Softmax numerators of one row's visible scores in place; returns their sum.
inline float exp_row(float* sc, int64_t n, float m) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    sc[j] = exp_nonpositive(sc[j] - m);
    sum += sc[j];
  }
  return sum;
}

template <typename T>
inline void prefetch_rows(const T* base, int64_t n, int64_t row_stride, int64_t d) {
  for (int64_t j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(base + j * row_stride);
    for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(row + off);
  }
}

// One layer's K or V cache and its dequantization scales, as one KV head sees it.
struct CacheView {
  const void* data;
  int64_t block_stride, row_stride, head_stride;
  const float* scales = nullptr;  // int8: per token per head; fp8: per tensor (one element)
  int64_t scale_block_stride = 0, scale_row_stride = 0, scale_head_stride = 0;
  bool per_token = false;

  CacheView(const at::Tensor& cache, const std::optional<at::Tensor>& scale)
      : data(cache.data_ptr()), block_stride(cache.stride(0)), row_stride(cache.stride(1)),
        head_stride(cache.stride(2)) {
    if (!scale.has_value() || !scale->defined()) return;
    scales = scale->data_ptr<float>();
    per_token = cache.scalar_type() == at::kChar;
    if (per_token) std::tie(scale_block_stride, scale_row_stride, scale_head_stride) =
        std::make_tuple(scale->stride(0), scale->stride(1), scale->stride(2));
  }

  float scale_of(int64_t block, int64_t row, int64_t head) const {
    if (scales == nullptr) return 1.f;
    if (!per_token) return scales[0];
    return scales[block * scale_block_stride + row * scale_row_stride + head * scale_head_stride];
  }
};

// Per-thread buffers, sized once per parallel chunk.
struct Scratch {
  kvtop::AlignedVector<float> q, acc, scores, m, l, kbuf, vbuf, kt;
  std::vector<int64_t> limit;
  Scratch(int64_t rows, int64_t block_size, int64_t d)
      : q(rows * d), acc(rows * d), scores(rows * block_size), m(rows), l(rows), kbuf(block_size * d),
        vbuf(block_size * d), kt(block_size * d), limit(rows) {}
};

// A prefill tile's scores against one block of 16 keys: K transposed once, then each row's 16
// scores are one vector accumulated along the head dim, with no horizontal sum per (row, key)
// as a dot product needs. Scores past n are junk the caller never reads.
inline void tile_scores(const float* __restrict k, int64_t kstride, int64_t n, int64_t d, const float* __restrict q,
                        int64_t rows, float* __restrict kt, float* __restrict scores) {
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < d; ++i) kt[i * kTileBlock + j] = k[j * kstride + i];
  }
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kTileBlock] = {};
    const float* qr = q + r * d;
    for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
      for (int64_t j = 0; j < kTileBlock; ++j) acc[j] += qr[i] * kt[i * kTileBlock + j];
    }
    std::copy(acc, acc + kTileBlock, scores + r * kTileBlock);
  }
}

template <int kD>
inline void row_pv(const float* __restrict p, const float* __restrict v, int64_t vstride, int64_t n, int64_t dd,
                   float* __restrict acc) {
  const int64_t d = kD > 0 ? kD : dd;
  for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] += p[j] * v[j * vstride + i];
  }
}

// Rows of one block for one head as fp32: the cache itself when it is fp32, else a dequantized copy.
template <typename T>
inline const float* block_rows(const CacheView& c, int64_t block, int64_t head, int64_t n, int64_t d, float* buf,
                               int64_t* stride) {
  const T* base = static_cast<const T*>(c.data) + block * c.block_stride + head * c.head_stride;
  if constexpr (std::is_same_v<T, float>) {
    *stride = c.row_stride;
    return base;
  } else {
    for (int64_t j = 0; j < n; ++j) load_row<T>(base + j * c.row_stride, buf + j * d, d, c.scale_of(block, j, head));
    *stride = d;
    return buf;
  }
}

// Attention of `rows` prescaled query rows (s.q) over the first s.limit[r] keys of one KV head of
// one sequence; the result, normalized, lands in s.acc. kD > 0 fixes the head dim at compile time
// (64 and 128: the loops unroll); 0 reads it from d.
template <typename T, int kD>
void attend(Scratch& s, int64_t rows, const int32_t* table, int64_t block_size, int64_t dyn_d, int64_t head,
            const CacheView& kc, const CacheView& vc) {
  const int64_t d = kD > 0 ? kD : dyn_d;
  const int64_t max_limit = *std::max_element(s.limit.begin(), s.limit.begin() + rows);
  std::fill(s.acc.begin(), s.acc.begin() + rows * d, 0.f);
  std::fill(s.m.begin(), s.m.begin() + rows, kNegInf);
  std::fill(s.l.begin(), s.l.begin() + rows, 0.f);
  const int64_t nblocks = (max_limit + block_size - 1) / block_size;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t start = b * block_size;
    const int64_t n = std::min(block_size, max_limit - start);  // never read past the longest row
    const int64_t block = table[b];
    if (b + 1 < nblocks) {  // the next block is anywhere in the cache: ask for it while this one runs
      const int64_t next = table[b + 1], next_n = std::min(block_size, max_limit - start - block_size);
      const int64_t off_k = next * kc.block_stride + head * kc.head_stride;
      const int64_t off_v = next * vc.block_stride + head * vc.head_stride;
      prefetch_rows(static_cast<const T*>(kc.data) + off_k, next_n, kc.row_stride, d);
      prefetch_rows(static_cast<const T*>(vc.data) + off_v, next_n, vc.row_stride, d);
    }
    int64_t kstride, vstride;
    const float* k = block_rows<T>(kc, block, head, n, d, s.kbuf.data(), &kstride);
    if (rows >= kTileRows && block_size == kTileBlock) {
      tile_scores(k, kstride, n, d, s.q.data(), rows, s.kt.data(), s.scores.data());
    } else {  // row by row, each row's keys up to its limit
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t visible = std::clamp<int64_t>(s.limit[r] - start, 0, n);
        const float* qr = s.q.data() + r * d;
        float* sc = s.scores.data() + r * block_size;
        for (int64_t j = 0; j < visible; ++j) sc[j] = dot(qr, k + j * kstride, d);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::clamp<int64_t>(s.limit[r] - start, 0, n);
      if (visible == 0) continue;
      float* sc = s.scores.data() + r * block_size;
      const float m_new = std::max(s.m[r], *std::max_element(sc, sc + visible));
      const float alpha = std::exp(s.m[r] - m_new);  // 0 on the first block (m = -inf)
      s.l[r] = s.l[r] * alpha + exp_row(sc, visible, m_new);
      s.m[r] = m_new;
      if (alpha != 1.f) {
        float* a = s.acc.data() + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) a[i] *= alpha;
      }
    }
    const float* v = block_rows<T>(vc, block, head, n, d, s.vbuf.data(), &vstride);
    for (int64_t r = 0; r < rows; ++r) {  // row-major: each row's accumulator stays in registers over the block
      const int64_t visible = std::clamp<int64_t>(s.limit[r] - start, 0, n);
      row_pv<kD>(s.scores.data() + r * block_size, v, vstride, visible, d, s.acc.data() + r * d);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / s.l[r];
    float* a = s.acc.data() + r * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) a[i] *= inv;
  }
}

#ifdef KVTOP_DECODE_FAST
// fp8 e4m3 to float for both decode items' gathers (the table above, looked up once)
const float* const kFp8Table = fp8_table();
#endif

#if defined(__AVX512F__)
// ---- decode on AVX-512: one query token per sequence, a GQA group of up to 8 rows -----------------
// The portable `attend` above is general (tiles, causal limits, any block size) but spends most of a
// decode item on bookkeeping: it dequantizes each block into a buffer, scores key by key through a
// buffer, and runs the softmax scalar per row. Here a K/V row is loaded straight into registers
// (16 lanes, converted on the fly), every row of the group is scored against it, the block's 16
// scores of a row are one register, and the group's accumulators stay in registers over the block.
// Quantization scales fold into the scores (K) and the probabilities (V). It runs at about one
// core's memory bandwidth here: a decode step of SmolLM2 (30 layers x 64 sequences x 384 tokens,
// bf16 cache, one thread) 120 -> 63 ms, fp32 164 -> 96 ms; the prefetch of the next block, spread
// over the keys, is half of that (without it, 131 ms bf16).

template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else {  // fp8 e4m3 through the table
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_i32gather_ps(idx, kFp8Table, 4);
  }
}

using kvtop_exp::exp16;

// Scales of one block's n rows for one head (int8: per token; fp8: per tensor; else 1), as 16 lanes.
inline __m512 block_scales(const CacheView& c, int64_t block, int64_t head, int64_t n) {
  if (c.scales == nullptr) return _mm512_set1_ps(1.f);
  if (!c.per_token) return _mm512_set1_ps(c.scales[0]);
  alignas(64) float s[16] = {};
  for (int64_t j = 0; j < n; ++j) s[j] = c.scale_of(block, j, head);
  return _mm512_load_ps(s);
}

// One sequence's KV head: G (<= GM) prescaled query rows `q` [G, D] over its keys in blocks [b0, b1)
// of its first `len` (blocks of 16 rows). The normalized result goes to `out` [G, D]; where `ml` is
// given, a part's instead (decode_parts): `out` unnormalized, ml [G, 2] each row's running max and sum.
template <typename T, int D, int GM>
void decode_item(const float* __restrict q, int64_t G, int64_t len, const int32_t* table, int64_t head,
                 const CacheView& kc, const CacheView& vc, float* __restrict out, int64_t b0, int64_t b1,
                 float* ml) {
  constexpr int V = D / 16;
  __m512 acc[GM][V];
  float m[GM], l[GM];
  for (int g = 0; g < GM; ++g) {
    m[g] = kNegInf;
    l[g] = 0.f;
    for (int v = 0; v < V; ++v) acc[g][v] = _mm512_setzero_ps();
  }
  const T* kbase = static_cast<const T*>(kc.data) + head * kc.head_stride;
  const T* vbase = static_cast<const T*>(vc.data) + head * vc.head_stride;
  alignas(64) float p[GM][16];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = std::min<int64_t>(16, len - b * 16), block = table[b];
    const T* kb = kbase + block * kc.block_stride;
    const T* vb = vbase + block * vc.block_stride;
    // the next block is anywhere in the cache: ask for its rows one per key scored here, spread out
    // so that the requests do not all wait at once for the core's few line-fill buffers; the block
    // after it into L2 only (hint T1: the L2's queue, not L1's fill buffers), so that its memory
    // latency is hidden behind two blocks' work. 64 x 384 bf16, 30 layers, 2 threads, 7 alternated
    // runs: 33.1-44.9 -> 30.1-42.7 ms (median ratio 1.13x); a third block ahead added nothing.
    const T* nk = b + 1 < b1 ? kbase + table[b + 1] * kc.block_stride : kb;
    const T* nv = b + 1 < b1 ? vbase + table[b + 1] * vc.block_stride : vb;
    const T* fk = b + 2 < b1 ? kbase + table[b + 2] * kc.block_stride : nk;
    const T* fv = b + 2 < b1 ? vbase + table[b + 2] * vc.block_stride : nv;
    // scores: each key row once, against every row of the group
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(nk + j * kc.row_stride) + off);
        __builtin_prefetch(reinterpret_cast<const char*>(nv + j * vc.row_stride) + off);
        __builtin_prefetch(reinterpret_cast<const char*>(fk + j * kc.row_stride) + off, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(fv + j * vc.row_stride) + off, 0, 2);
      }
      __m512 k[V];
      for (int v = 0; v < V; ++v) k[v] = load16<T>(kb + j * kc.row_stride + 16 * v);
      for (int g = 0; g < GM; ++g) {
        if (g >= G) break;
        __m512 t = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), k[0]);
        for (int v = 1; v < V; ++v) t = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * v), k[v], t);
        p[g][j] = _mm512_reduce_add_ps(t);
      }
    }
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    const __m512 ks = block_scales(kc, block, head, n), vs = block_scales(vc, block, head, n);
    for (int g = 0; g < GM; ++g) {
      if (g >= G) break;
      const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), live, _mm512_load_ps(p[g]), ks);
      const float m_new = std::max(m[g], _mm512_reduce_max_ps(s));
      // 0 on the first block (m = -inf); 1 where the block did not raise the max (most blocks past the
      // first few), without a call to exp
      const float alpha = m_new == m[g] ? 1.f : std::exp(m[g] - m_new);
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
      l[g] = l[g] * alpha + _mm512_reduce_add_ps(e);
      m[g] = m_new;
      _mm512_store_ps(p[g], _mm512_mul_ps(e, vs));
      if (alpha != 1.f) {
        const __m512 a = _mm512_set1_ps(alpha);
        for (int v = 0; v < V; ++v) acc[g][v] = _mm512_mul_ps(acc[g][v], a);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      __m512 x[V];
      for (int v = 0; v < V; ++v) x[v] = load16<T>(vb + j * vc.row_stride + 16 * v);
      for (int g = 0; g < GM; ++g) {
        if (g >= G) break;
        const __m512 pj = _mm512_set1_ps(p[g][j]);
        for (int v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(pj, x[v], acc[g][v]);
      }
    }
  }
  for (int g = 0; g < GM; ++g) {
    if (g >= G) break;
    const __m512 inv = _mm512_set1_ps(ml ? 1.f : 1.f / l[g]);
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + g * D + 16 * v, _mm512_mul_ps(acc[g][v], inv));
    if (ml) ml[2 * g] = m[g], ml[2 * g + 1] = l[g];
  }
}

#elif defined(KVTOP_DECODE_FAST)
// ---- decode on AVX2 (AMD Zen 3, older Intel): the same item in 8 lanes ----------------------------
// 16 registers do not hold a group's accumulators (3 rows x 64 dims are 24 vectors), so the item
// goes a block at a time in three passes: each key row once against every row of the group (a
// horizontal sum of 8 lanes per score), the softmax of each row's 16 scores, then P V row by row of
// the group with its accumulators in registers and the block's V rows in L1 after the first row.
// Against the generic `attend` it replaces, an AVX2 build on a Zen 5, 64 x 336 tokens, 30 layers, 2
// threads: fp32 53-55 -> 26-37 ms, int8 32-33 -> 24-25, fp8 60-61 -> 46-49 (benchmarks/cpu_attention.py).

template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else {  // fp8 e4m3 through the table
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_i32gather_ps(kFp8Table, idx, 4);
  }
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// Key row `kr`'s scores against the group's G query rows, times the row's scale (int8 per token, fp8
// per tensor, else 1), into p[g][j].
template <typename U, int D, int GM>
inline void score_row(const float* __restrict q, int64_t G, const U* kr, float scale, float (*p)[16], int64_t j) {
  for (int g = 0; g < GM; ++g) {
    if (g >= G) break;
    __m256 t = _mm256_mul_ps(_mm256_loadu_ps(q + g * D), load8<U>(kr));
    for (int v = 1; v < D / 8; ++v) t = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * v), load8<U>(kr + 8 * v), t);
    p[g][j] = hsum8(t) * scale;
  }
}

// acc (one row of the group, D floats) = acc * alpha + sum over j < n of p[j] * V row j.
template <typename U, int D>
inline void pv_row(const float* p, const U* vb, int64_t vstride, int64_t n, float alpha, float* acc) {
  constexpr int V = D / 8;
  __m256 a[V];
  const __m256 al = _mm256_set1_ps(alpha);
  for (int v = 0; v < V; ++v) a[v] = _mm256_mul_ps(_mm256_load_ps(acc + 8 * v), al);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int v = 0; v < V; ++v) a[v] = _mm256_fmadd_ps(pj, load8<U>(vb + j * vstride + 8 * v), a[v]);
  }
  for (int v = 0; v < V; ++v) _mm256_store_ps(acc + 8 * v, a[v]);
}

// fp8's rows go through a table gather: converted once a block into floats, not once per row of the
// group (which made the fp8 step 2x slower than the generic path)
template <typename T>
constexpr bool kConvertBlock = std::is_same_v<T, c10::Float8_e4m3fn>;

template <typename T, int D, int GM>
void decode_item(const float* __restrict q, int64_t G, int64_t len, const int32_t* table, int64_t head,
                 const CacheView& kc, const CacheView& vc, float* __restrict out, int64_t b0, int64_t b1,
                 float* ml) {
  constexpr int V = D / 8;
  alignas(32) float acc[GM][D] = {};
  alignas(32) float p[GM][16];
  alignas(32) float conv[kConvertBlock<T> ? 16 * D : 1];
  float m[GM], l[GM];
  for (int g = 0; g < GM; ++g) m[g] = kNegInf, l[g] = 0.f;
  const T* kbase = static_cast<const T*>(kc.data) + head * kc.head_stride;
  const T* vbase = static_cast<const T*>(vc.data) + head * vc.head_stride;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = std::min<int64_t>(16, len - b * 16), block = table[b];
    const T* kb = kbase + block * kc.block_stride;
    const T* vb = vbase + block * vc.block_stride;
    // the next block's rows, one per key scored here (as the AVX-512 item does)
    const T* nk = b + 1 < b1 ? kbase + table[b + 1] * kc.block_stride : kb;
    const T* nv = b + 1 < b1 ? vbase + table[b + 1] * vc.block_stride : vb;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(nk + j * kc.row_stride) + off);
        __builtin_prefetch(reinterpret_cast<const char*>(nv + j * vc.row_stride) + off);
      }
      const T* kr = kb + j * kc.row_stride;
      if constexpr (kConvertBlock<T>) {
        for (int v = 0; v < V; ++v) _mm256_store_ps(conv + 8 * v, load8<T>(kr + 8 * v));
        score_row<float, D, GM>(q, G, conv, kc.scale_of(block, j, head), p, j);
      } else {
        score_row<T, D, GM>(q, G, kr, kc.scale_of(block, j, head), p, j);
      }
    }
    if constexpr (kConvertBlock<T>) {
      for (int64_t j = 0; j < n; ++j)
        for (int v = 0; v < V; ++v) _mm256_store_ps(conv + j * D + 8 * v, load8<T>(vb + j * vc.row_stride + 8 * v));
    }
    for (int g = 0; g < GM; ++g) {
      if (g >= G) break;
      const float m_new = std::max(m[g], *std::max_element(p[g], p[g] + n));
      const float alpha = m_new == m[g] ? 1.f : std::exp(m[g] - m_new);  // 0 on the first block
      l[g] = l[g] * alpha + exp_row(p[g], n, m_new);
      m[g] = m_new;
      for (int64_t j = 0; j < n; ++j) p[g][j] *= vc.scale_of(block, j, head);
      if constexpr (kConvertBlock<T>) pv_row<float, D>(p[g], conv, D, n, alpha, acc[g]);
      else pv_row<T, D>(p[g], vb, vc.row_stride, n, alpha, acc[g]);
    }
  }
  for (int g = 0; g < GM; ++g) {
    if (g >= G) break;
    const __m256 inv = _mm256_set1_ps(ml ? 1.f : 1.f / l[g]);
    for (int v = 0; v < V; ++v)
      _mm256_storeu_ps(out + g * D + 8 * v, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * v), inv));
    if (ml) ml[2 * g] = m[g], ml[2 * g + 1] = l[g];
  }
}
#endif  // __AVX512F__, AVX2

// Whether this build's decode kernel (run_decode_fast) covers these shapes.
bool decode_fast_covers(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size) {
#ifdef KVTOP_DECODE_FAST
  return block_size == 16 && heads / kv_heads <= 8 && (head_dim == 64 || head_dim == 128);
#else
  return false;
#endif
}

#ifdef KVTOP_DECODE_FAST
template <typename T, int D>
void decode_item_any(const float* q, int64_t G, int64_t len, const int32_t* table, int64_t head,
                     const CacheView& kc, const CacheView& vc, float* out, int64_t b0, int64_t b1, float* ml) {
  if (G == 1) decode_item<T, D, 1>(q, G, len, table, head, kc, vc, out, b0, b1, ml);
  else if (G == 2) decode_item<T, D, 2>(q, G, len, table, head, kc, vc, out, b0, b1, ml);
  else if (G == 3) decode_item<T, D, 3>(q, G, len, table, head, kc, vc, out, b0, b1, ml);
  else if (G == 4) decode_item<T, D, 4>(q, G, len, table, head, kc, vc, out, b0, b1, ml);
  else decode_item<T, D, 8>(q, G, len, table, head, kc, vc, out, b0, b1, ml);
}

// Parts a (sequence, KV head) item's keys are split in. Fewer items than twice the threads (one
// sequence's 3 KV heads on 2 threads: one thread would do two, the other one) leave a thread idle for
// part of the call; split in runs of blocks, merged after (decode_merge), the parts balance. Not below
// kMinPartBlocks blocks a part: a part's fixed cost (its query, its output, the merge) must stay small.
// SmolLM2's heads, one sequence at 320 tokens, bf16 cache, 2 threads, a call from Python: 17.4 ->
// 15.6-16.3 us (and 12.3-12.8 with the bf16 query read here rather than converted around the call).
constexpr int64_t kMinPartBlocks = 4;

int64_t decode_parts(int64_t items, int64_t min_len) {
  const int64_t threads = at::get_num_threads();
  if (threads < 2 || items >= 2 * threads) return 1;
  const int64_t by_length = (min_len + 15) / 16 / kMinPartBlocks;
  return std::max<int64_t>(1, std::min((2 * threads + items - 1) / items, by_length));
}

// One item's parts (each [G, D] unnormalized, ml [G, 2]: max and sum) merged into its normalized
// result: each part weighted by exp(its max - the overall max). A part over no key has sum 0.
void decode_merge(const float* parts, int64_t count, int64_t G, int64_t d, float* out) {
  const int64_t stride = G * (d + 2);
  for (int64_t g = 0; g < G; ++g) {
    float top = kNegInf;
    for (int64_t p = 0; p < count; ++p) {
      const float* ml = parts + p * stride + G * d + 2 * g;
      if (ml[1] > 0.f) top = std::max(top, ml[0]);
    }
    float sum = 0.f;
    float* dst = out + g * d;
    std::fill(dst, dst + d, 0.f);
    for (int64_t p = 0; p < count; ++p) {
      const float* part = parts + p * stride;
      const float* ml = part + G * d + 2 * g;
      if (ml[1] <= 0.f) continue;
      const float w = std::exp(ml[0] - top);
      sum += ml[1] * w;
      for (int64_t x = 0; x < d; ++x) dst[x] += w * part[g * d + x];
    }
    const float inv = 1.f / sum;
    for (int64_t x = 0; x < d; ++x) dst[x] *= inv;
  }
}

// Rows [G, d] of fp32 results into the output's dtype: fp32 as they are, bf16 rounded (nearest even,
// as Tensor.to).
inline void store_rows(const float* src, int64_t count, float* dst) { std::copy(src, src + count, dst); }
inline void store_rows(const float* src, int64_t count, c10::BFloat16* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = c10::BFloat16(src[i]);
}

// Every (sequence, KV head) of a decode step in parallel, each in decode_parts runs of its blocks.
// The query and the output in Q: fp32, or the bf16 model's own (read and rounded here, rather than
// by a conversion op each way a layer). True if it ran (shapes it covers).
template <typename T, typename Q>
bool run_decode_fast(const at::Tensor& q, at::Tensor& out, const CacheView& kc, const CacheView& vc,
                     const at::Tensor& block_tables, const int64_t* lens, int64_t kv_heads, int64_t block_size,
                     double scale) {
  const int64_t seqs = q.size(0), heads = q.size(1), d = q.size(2), group = heads / kv_heads;
  if (!decode_fast_covers(heads, kv_heads, d, block_size)) return false;
  const Q* qp = q.data_ptr<Q>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  Q* op = out.data_ptr<Q>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.size(1);
  const auto sc = static_cast<float>(scale);
  const int64_t items = seqs * kv_heads;
  const int64_t parts = decode_parts(items, *std::min_element(lens, lens + seqs));
  const int64_t part_floats = group * (d + 2);
  constexpr bool kFloatOut = std::is_same_v<Q, float>;
  std::vector<float> partial(parts > 1 ? items * parts * part_floats : 0);
  at::parallel_for(0, items * parts, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qbuf[8 * 128];
    alignas(64) float result[8 * 128];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t item = unit / parts, part = unit % parts;
      const int64_t s = item / kv_heads, h = item % kv_heads;
      for (int64_t g = 0; g < group; ++g) {
        const Q* src = qp + s * qs0 + (h * group + g) * qs1;
        for (int64_t x = 0; x < d; ++x) qbuf[g * d + x] = static_cast<float>(src[x]) * sc;
      }
      const int64_t nblocks = (lens[s] + 15) / 16;
      const int64_t b0 = nblocks * part / parts, b1 = nblocks * (part + 1) / parts;
      // a part's partial sums, or the result: fp32 straight into the output, bf16 through `result`
      Q* out_rows = op + (s * heads + h * group) * d;
      float* dst = result;
      if (parts > 1) dst = partial.data() + unit * part_floats;
      else if constexpr (kFloatOut) dst = out_rows;
      float* ml = parts > 1 ? dst + group * d : nullptr;
      const int32_t* table = tables + s * table_stride;
      if (d == 64) decode_item_any<T, 64>(qbuf, group, lens[s], table, h, kc, vc, dst, b0, b1, ml);
      else decode_item_any<T, 128>(qbuf, group, lens[s], table, h, kc, vc, dst, b0, b1, ml);
      if (parts == 1 && !kFloatOut) store_rows(result, group * d, out_rows);
    }
  });
  if (parts > 1) {
    alignas(64) float result[8 * 128];
    for (int64_t item = 0; item < items; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      decode_merge(partial.data() + item * parts * part_floats, parts, group, d, result);
      store_rows(result, group * d, op + (s * heads + h * group) * d);
    }
  }
  return true;
}
#endif  // KVTOP_DECODE_FAST

void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: [tokens, heads, dim], dim contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache: [blocks, bs, kvh, d]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache differ in dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
}

// A query token's place: its row in q and out, its sequence, and how many keys it sees.
struct Tile {
  int64_t seq, first_token, num_tokens, first_limit;
};

template <typename T>
void run_tiles(const at::Tensor& q, at::Tensor& out, const CacheView& kc, const CacheView& vc,
               const at::Tensor& block_tables, const std::vector<Tile>& tiles, int64_t kv_heads, int64_t block_size,
               double scale) {
  const int64_t heads = q.size(1), d = q.size(2), group = heads / kv_heads;
  int64_t max_rows = 0;
  for (const Tile& t : tiles) max_rows = std::max(max_rows, t.num_tokens * group);
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  float* op = out.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.size(1);
  const auto sc = static_cast<float>(scale);
  const int64_t items = static_cast<int64_t>(tiles.size()) * kv_heads;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Scratch s(max_rows, block_size, d);
    for (int64_t item = begin; item < end; ++item) {
      const Tile& t = tiles[item / kv_heads];
      const int64_t h = item % kv_heads;
      const int64_t rows = t.num_tokens * group;
      for (int64_t i = 0; i < t.num_tokens; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const float* src = qp + (t.first_token + i) * qs0 + (h * group + g) * qs1;
          float* dst = s.q.data() + (i * group + g) * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * sc;
          s.limit[i * group + g] = t.first_limit + i;
        }
      }
      const int32_t* table = tables + t.seq * table_stride;
      if (d == 64) {
        attend<T, 64>(s, rows, table, block_size, d, h, kc, vc);
      } else if (d == 128) {
        attend<T, 128>(s, rows, table, block_size, d, h, kc, vc);
      } else {
        attend<T, 0>(s, rows, table, block_size, d, h, kc, vc);
      }
      for (int64_t i = 0; i < t.num_tokens; ++i) {
        float* dst = op + ((t.first_token + i) * heads + h * group) * d;
        std::copy(s.acc.data() + i * group * d, s.acc.data() + (i + 1) * group * d, dst);
      }
    }
  });
}

// A wrong table must be an error, not a read of some other process's memory.
void check_tables(const std::vector<Tile>& tiles, const at::Tensor& block_tables, int64_t block_size,
                  int64_t num_blocks) {
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  for (const Tile& t : tiles) {
    const int64_t keys = t.first_limit + t.num_tokens - 1;
    TORCH_CHECK(t.first_limit >= 1 && t.seq < block_tables.size(0), "every query must see at least one key");
    const int64_t needed = (keys + block_size - 1) / block_size;
    TORCH_CHECK(needed <= width, "seq_lens reach past the block table");
    for (int64_t b = 0; b < needed; ++b) {
      const int32_t block = tables[t.seq * width + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block table entry ", block, " is not a block of the cache");
    }
  }
}

at::Tensor dispatch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const std::vector<Tile>& tiles, double scale,
                    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                    const int64_t* decode_lens = nullptr) {
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  if (tiles.empty()) return out;
  check_tables(tiles, block_tables, k_cache.size(1), k_cache.size(0));
  const CacheView kc(k_cache, k_scale), vc(v_cache, v_scale);
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  const auto st = k_cache.scalar_type();
  const bool quantized = st == at::kChar || st == at::kFloat8_e4m3fn;
  TORCH_CHECK(!quantized || (kc.scales && vc.scales), "an int8 or fp8 cache needs k_scale and v_scale");
  auto run = [&](auto tag) {
#ifdef KVTOP_DECODE_FAST
    if (decode_lens != nullptr) {
      const bool ran = q.scalar_type() == at::kBFloat16
                           ? run_decode_fast<decltype(tag), c10::BFloat16>(q, out, kc, vc, block_tables, decode_lens,
                                                                           kv_heads, block_size, scale)
                           : run_decode_fast<decltype(tag), float>(q, out, kc, vc, block_tables, decode_lens,
                                                                   kv_heads, block_size, scale);
      if (ran) return;
    }
#endif
    run_tiles<decltype(tag)>(q, out, kc, vc, block_tables, tiles, kv_heads, block_size, scale);
  };
  if (st == at::kFloat) run(float{});
  else if (st == at::kBFloat16) run(c10::BFloat16{});
  else if (st == at::kHalf) run(c10::Half{});
  else if (st == at::kChar) run(int8_t{});
  else if (st == at::kFloat8_e4m3fn) run(c10::Float8_e4m3fn{});
  else TORCH_CHECK(false, "unsupported KV cache dtype ", st);
  return out;
}

// A decode step's sequence lengths as int64: the engine's int32 tensor read in place; any other integer
// dtype through a conversion, whose op call and allocation took ~2 of a ~19 us call (SmolLM2, one
// sequence, a layer of a fused decode step on a Zen 4).
std::vector<int64_t> host_lengths(const at::Tensor& seq_lens) {
  std::vector<int64_t> lens(seq_lens.numel());
  if (seq_lens.scalar_type() == at::kInt) {
    const int32_t* src = seq_lens.data_ptr<int32_t>();
    for (int64_t i = 0; i < seq_lens.numel(); ++i) lens[i] = src[i * seq_lens.stride(0)];
  } else {
    const at::Tensor wide = seq_lens.to(at::kLong).contiguous();
    std::copy_n(wide.data_ptr<int64_t>(), lens.size(), lens.begin());
  }
  return lens;
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_floating_point() && k_cache.dim() == 4, "q: [tokens, heads, dim], floating point");
  // the kernels read float32 rows, and bf16 ones on the fast path (rounding the result as .to would);
  // any other query goes in as float32 rows and its result comes back in the query's dtype
  const bool as_is = q.scalar_type() == at::kFloat ||
                     (q.scalar_type() == at::kBFloat16 &&
                      decode_fast_covers(q.size(1), k_cache.size(2), q.size(2), k_cache.size(1)));
  if (!as_is || q.stride(2) != 1)
    return paged_decode((as_is ? q : q.to(at::kFloat)).contiguous(), k_cache, v_cache, block_tables, seq_lens, scale,
                        k_scale, v_scale)
        .to(q.scalar_type());
  check_inputs(q, k_cache, v_cache, block_tables);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.numel() == q.size(0), "one seq_len per query token");
  const std::vector<int64_t> lens = host_lengths(seq_lens);
  std::vector<Tile> tiles;
  tiles.reserve(q.size(0));
  for (int64_t s = 0; s < q.size(0); ++s) tiles.push_back({s, s, 1, lens[s]});
  return dispatch(q, k_cache, v_cache, block_tables, tiles, scale, k_scale, v_scale, lens.data());
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                         double scale, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_floating_point(), "q: [tokens, heads, dim], floating point");
  if (q.scalar_type() != at::kFloat || q.stride(2) != 1)  // the kernels read float32 rows
    return paged_prefill(q.to(at::kFloat).contiguous(), k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                         k_scale, v_scale)
        .to(q.scalar_type());
  check_inputs(q, k_cache, v_cache, block_tables);
  const at::Tensor cu = cu_seqlens_q.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const int64_t *cp = cu.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  TORCH_CHECK(cu.numel() == lens.numel() + 1 && cp[0] == 0 && cp[lens.numel()] == q.size(0),
              "cu_seqlens_q: [num_seqs + 1], from 0 to the number of query tokens");
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < lens.size(0); ++s) {
    const int64_t q_len = cp[s + 1] - cp[s];
    // query i of the sequence sits at position seq_len - q_len + i and sees the keys up to it
    for (int64_t i = 0; i < q_len; i += kTileTokens) {
      tiles.push_back({s, cp[s] + i, std::min(kTileTokens, q_len - i), lp[s] - q_len + i + 1});
    }
  }
  return dispatch(q, k_cache, v_cache, block_tables, tiles, scale, k_scale, v_scale);
}

}  // namespace

TORCH_LIBRARY(kvtop_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, "
      "Tensor? k_scale, Tensor? v_scale) -> Tensor",
      &paged_decode);
  m.def(
      "paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q, "
      "Tensor seq_lens, float scale, Tensor? k_scale, Tensor? v_scale) -> Tensor",
      &paged_prefill);
}
