// Linear layers on GGUF block-quantized weights, computed on the blocks (issue #41).
//
// Why: a decode step reads every weight once, so its time is the weights' bytes over the memory
// bandwidth; SmolLM2-135M's Q4_1 projections are 0.625 bytes a weight against fp32's 4. The weight
// stays as the file holds it: one row of groups per output column, a group being
//   Q8_0 (ggml type 8):  32 values: fp16 d, int8 q[32]                 w = d * q
//   Q4_0 (ggml type 2):  32 values: fp16 d, 16 bytes of nibbles        w = d * (q - 8)
//   Q4_1 (ggml type 3):  32 values: fp16 d, fp16 m, 16 bytes of nibbles w = d * q + m
//   (nibble j of the 16 bytes: the low half of byte j is element j, the high half element j + 16)
//   Q4_K (ggml type 12): 256 values, 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and
//     mins, 128 bytes of nibbles; sub-block j of 32: w = (d * sc_j) * q - dmin * min_j, its nibbles
//     the low (j even) or high (j odd) halves of bytes 32 (j / 2) .. + 32
//   Q6_K (ggml type 14): 256 values, 210 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), int8
//     scales[16] (one per 16 values), fp16 d; w = (d * scale) * (q - 32)
//   Q5_0, Q5_1, Q5_K (ggml types 6, 7, 13): Q4_0's, Q4_1's and Q4_K's with a high bit per value
//     (4 bytes a block, 32 a super-block) making q 5 bits; Q5_0's w = d * (q - 16) (quant_blocks.h)
// The kernels walk a column in sub-blocks of 32 values, each with one scale d and offset m (Q6_K's
// two scales of 16 are folded into its values, which are then the reference's exactly, d = 1).
//
// Two kernels on the file's layout, both AVX2 + FMA + F16C, and quant_linear, which picks one by the
// row count (a loaded model's weights are packed instead, quant_packed.cpp; these run for a weight left
// in the file's layout: N not a multiple of 16, or KVTOP_QUANT_PACK=0):
// - quant_gemv, for a few rows (decode): one work item is a run of output columns; each block of a
//   column is de-quantized into four 8-lane registers once and multiplied into every row's
//   accumulator (up to kRows rows at a time). The block's scale comes out of the sum: per row,
//   sum_k x_k w_k = d * sum_k x_k q_k + m * sum_k x_k, with sum_k x_k per block computed once per
//   call. The activations stay fp32: the results are the de-quantized weights' products up to
//   summation order (tests/test_quant_linear.py compares them with the reference within fp32 rounding).
// - quant_gemm, for many rows (prefill): a work item de-quantizes one panel of 48 columns into a
//   thread's [K, 48] fp32 buffer — exactly the values the reference de-quantizes — and multiplies it
//   into up to 256 rows with fp32_gemm's register blocks (csrc/fp32_panel.h): the de-quantization is
//   paid once for all those rows, and the fp32 panel lives in the cache, never in memory as a copy.
//
// bf16 rows past quant_gemv's count go to AMX where the CPU has it (amx_linear.cpp's amx_quant_linear),
// else to quant_bf16_gemm where it has AVX512-BF16 (AMD Zen 4 and later): quant_gemm's panels de-quantized
// into bf16 pairs and multiplied with bf16_gemm's VDPBF16PS blocks (csrc/bf16_panel.h), bit for bit a
// bf16 model's panels; else to quant_gemm in fp32.
// Elsewhere (no AVX2 + FMA + F16C) `quant_linear_supported()` is false and quant_linear.py
// de-quantizes with the reference instead. No AVX-512 path for fp32 rows: an AVX-512 gemv (16-lane
// blocks, 4 columns a tile) measured no faster than this AVX2 one — its port-0/5 work per weight
// (expand, convert, multiply) is about the same; the block layouts: csrc/quant_blocks.h.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <optional>

#include "aligned_vector.h"
#include "panel_gemm.h"

// Explicit mul then add where the reference does (d * q + m): no contraction into an fma, so the
// panels hold exactly the reference's values.
#pragma GCC optimize("fp-contract=off")
#include "bf16_panel.h"  // bf16_gemm's register blocks, which multiply a de-quantized bf16 panel
#include "fp32_panel.h"  // fp32_gemm's register blocks, which multiply a de-quantized panel
#include "quant_blocks.h"  // the formats' blocks in registers (KVTOP_QUANT_GEMM where AVX2, FMA and F16C)
#include "quant_packed.h"  // a packed weight's tiles in registers (KVTOP_QUANT_PACKED where AVX-512 with BF16)

namespace kvtop_amx {  // csrc/amx_linear.cpp: many bf16 rows on AMX tiles de-quantized a group at a time
bool quant_tiles_supported();
at::Tensor quant_tiles_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t n,
                              const std::optional<at::Tensor>& bias);
at::Tensor quant_tiles_gate_up(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t inter,
                               const std::optional<at::Tensor>& bias, bool silu);
}  // namespace kvtop_amx

namespace kvtop_packed {  // csrc/quant_packed.cpp: the GGUF weights repacked for decode
bool supported();
bool gate_up_supported();
bool gemv_takes(const at::Tensor& x);
void dequant_panel(const uint8_t* w, int64_t format, int64_t p, int64_t n, int64_t k, int64_t width, float* out);
at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t n,
                const std::optional<at::Tensor>& bias);
at::Tensor gate_up_tiles(const at::Tensor& y, int64_t inter, bool silu);
at::Tensor gemv_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t inter,
                         const std::optional<at::Tensor>& bias);
}  // namespace kvtop_packed

namespace {

using namespace kvtop_quant;
constexpr int64_t kNR = kvtop_panels::kPanel;

bool quant_linear_supported() {
#ifdef KVTOP_QUANT_GEMM
  return true;
#else
  return false;
#endif
}

#ifdef KVTOP_QUANT_GEMM
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

constexpr int kRows = 4;  // rows per pass over a column: 4 accumulators + 4 block registers + temporaries

// y[r, col] for rows [r0, r0 + R) and one column: the column's blocks de-quantized once per block
// and multiplied into every row. xsum[r * nb + b]: the sum of row r's block b (for the m term).
template <int64_t F, int R>
inline void column_rows(const float* x, int64_t k, const float* xsum, const uint8_t* col, int64_t bytes, float* y,
                        int64_t ldy) {
  constexpr int64_t kG = group_blocks(F);
  const int64_t nb = k / kBlock;
  __m256 acc[R];
  float macc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), macc[r] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const Block blk = load_block<F>(col + b / kG * bytes, b % kG);
    const __m256 d = _mm256_set1_ps(blk.d);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * k + b * kBlock;
      __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xb), blk.q[0]);
      p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), blk.q[1], p);
      p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), blk.q[2], p);
      p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), blk.q[3], p);
      acc[r] = _mm256_fmadd_ps(p, d, acc[r]);
      if constexpr (F != kQ8_0 && F != kQ6_K) macc[r] += blk.m * xsum[r * nb + b];
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(acc[r]) + macc[r];
}

template <int64_t F>
void gemv_columns(const float* x, int64_t m, int64_t k, const float* xsum, const uint8_t* w, int64_t bytes,
                  int64_t n0, int64_t n1, int64_t n, float* y) {
  const int64_t nb = k / kBlock, row_bytes = nb / group_blocks(F) * bytes;
  for (int64_t c = n0; c < n1; ++c) {
    const uint8_t* col = w + c * row_bytes;
    if (c + 1 < n1) _mm_prefetch(reinterpret_cast<const char*>(col + row_bytes), _MM_HINT_T0);
    int64_t r = 0;
    for (; r + kRows <= m; r += kRows)
      column_rows<F, kRows>(x + r * k, k, xsum + r * nb, col, bytes, y + r * n + c, n);
    switch (m - r) {
      case 3: column_rows<F, 3>(x + r * k, k, xsum + r * nb, col, bytes, y + r * n + c, n); break;
      case 2: column_rows<F, 2>(x + r * k, k, xsum + r * nb, col, bytes, y + r * n + c, n); break;
      case 1: column_rows<F, 1>(x + r * k, k, xsum + r * nb, col, bytes, y + r * n + c, n); break;
      default: break;
    }
  }
}

// 8 registers of 8 (row i: column i's 8 consecutive K values) transposed: row j holds K value j of
// the 8 columns.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

// Panel p of the de-quantized weight: out [K, 48], row k holding W[48p + c, k] (zero past N).
template <int64_t F>
void dequant_panel(const uint8_t* w, int64_t bytes, int64_t p, int64_t n, int64_t k, float* out) {
  constexpr int64_t kG = group_blocks(F);
  const int64_t nb = k / kBlock, row_bytes = nb / kG * bytes;
  for (int64_t g = 0; g < kNR / 8; ++g) {  // 8 columns at a time
    const int64_t c0 = p * kNR + g * 8;
    for (int64_t b = 0; b < nb; ++b) {
      __m256 vals[8][4];
      for (int c = 0; c < 8; ++c) {
        if (c0 + c < n) {
          dequant_block<F>(w + (c0 + c) * row_bytes + b / kG * bytes, b % kG, vals[c]);
        } else {
          for (int i = 0; i < 4; ++i) vals[c][i] = _mm256_setzero_ps();
        }
      }
      for (int i = 0; i < 4; ++i) {  // K values 32b + 8i .. + 8
        __m256 r[8];
        for (int c = 0; c < 8; ++c) r[c] = vals[c][i];
        transpose8(r);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + (b * kBlock + 8 * i + j) * kNR + g * 8, r[j]);
      }
    }
  }
}

#endif

// What both ops take: x a float32 [M, K]; the blocks as check_blocks (quant_blocks.h) says; the bias a
// float32 [N].
int64_t check_operands(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t n,
                       const std::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && !x.is_cuda() && x.dim() == 2, op, ": x must be a float32 [M, K]");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                op, ": bias must be a contiguous float32 [N]");
  TORCH_CHECK(quant_linear_supported(), op, ": this build has no AVX2 with FMA and F16C");
  return check_blocks(blocks, format, n, x.size(1), op);
}

// x [M, K] fp32 @ W^T (+ bias) -> [M, N] fp32, W the GGUF blocks [N, K/32 * block bytes] of `format`,
// de-quantized in the registers: for a few rows (decode).
at::Tensor quant_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t n,
                      const std::optional<at::Tensor>& bias) {
  const int64_t bytes = check_operands(x, blocks, format, n, bias, "quant_gemv");
  const int64_t k = x.size(1), m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
#ifdef KVTOP_QUANT_GEMM
  if (m == 0) return out;
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t nb = k / kBlock;
  std::vector<float> xsum(m * nb);  // the m term's per-block sums of x, once per call
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = xp + r * k + b * kBlock;
      __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                               _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
      xsum[r * nb + b] = hsum(s);
    }
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  // grain: a run of columns worth ~16 KiB of weight per task, so that small projections still split
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / (nb / group_blocks(format) * bytes));
  by_format(format, [&](auto f) {
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      gemv_columns<decltype(f)::value>(xp, m, k, xsum.data(), wp, bytes, n0, n1, n, yp);
      if (bp)
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = n0; c < n1; ++c) yp[r * n + c] += bp[c];
    });
  });
#endif
  return out;
}

// Rows per work item of quant_gemm: a panel is de-quantized once per item (48 x K values, about what
// 48 rows' FMAs cost), and the item's x rows stay in L2 across the panels a thread takes.
constexpr int64_t kItemRows = 256;

// x [M, K] fp32 @ W^T (+ bias) -> [M, N] fp32, W as quant_gemv takes it, or packed (format = its ggml
// type + kPackedFormat: quant_packed.cpp reads the panel out of its tiles): for many rows (prefill). A
// work item de-quantizes one panel of 48 columns into a thread's [K, 48] buffer (the reference's
// values) and multiplies it into its rows with fp32_gemm's blocks (csrc/fp32_panel.h).
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t n,
                      const std::optional<at::Tensor>& bias) {
  const bool packed = format >= kPackedFormat;
  if (packed) format -= kPackedFormat;
  TORCH_CHECK(!packed || kvtop_packed::supported(), "quant_gemm: this build has no AVX2 with FMA and F16C");
  const int64_t bytes = check_operands(x, blocks, format, n, bias, "quant_gemm");
  const int64_t k = x.size(1), m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
#if defined(KVTOP_QUANT_GEMM) && defined(KVTOP_FP32_GEMM)
  if (m == 0) return out;
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const int64_t panels = (n + kNR - 1) / kNR;
  by_format(format, [&](auto f) {
    kvtop_panels::for_each_item(m, panels, kItemRows, [&](int64_t m0, int64_t m1, int64_t p) {
      thread_local kvtop::AlignedVector<float> panel;
      panel.resize(k * kNR);
      if (packed)
        kvtop_packed::dequant_panel(wp, format, p, n, k, kNR, panel.data());
      else
        dequant_panel<decltype(f)::value>(wp, bytes, p, n, k, panel.data());
      for (int64_t r = m0; r < m1; r += kvtop_fp32::kMC)
        kvtop_fp32::panel_item(xp, r, std::min(m1, r + kvtop_fp32::kMC), k, panel.data(), p * kNR, n, bp, yp,
                               nullptr);
    });
  });
#endif
  return out;
}

#ifdef KVTOP_BF16_GEMM
// An fp32 panel [K, 48] (dequant_panel) as a bf16 one [K/2, 48, 2]: pair row i holds rows 2i and 2i + 1
// interleaved, column c's at 2c and 2c + 1, rounded to nearest even (quant_packed.h's bf16_pairs, for
// weights in the file's layout).
void bf16_pairs_of(const float* panel, int64_t k, uint16_t* out) {
  for (int64_t i = 0; i < k / 2; ++i)
    for (int64_t v = 0; v < kNR / 16; ++v)
      _mm512_storeu_si512(out + i * 2 * kNR + 32 * v,
                          kvtop_simd::bf16_pairs16(_mm512_loadu_ps(panel + 2 * i * kNR + 16 * v),
                                                   _mm512_loadu_ps(panel + (2 * i + 1) * kNR + 16 * v)));
}
#endif

#if defined(KVTOP_BF16_GEMM) && defined(KVTOP_QUANT_GEMM) && defined(KVTOP_QUANT_PACKED)
// The next panel of a thread's run, de-quantized a few units at a time (a unit: one tile's 32 values of
// K, quant_packed.h's bf16_pairs) every `every` pairs of K of the current panel's multiply-adds
// (bf16_panel.h's side work): VDPBF16PS keeps the FMA pipes busy while the de-quantization's shifts,
// converts and stores mostly take the others, and the out-of-order core runs the two side by side.
// What is left is mostly the de-quantization's own FMA (d * q + m) on those pipes. Units a call: the
// call saves and restores the accumulators around it. SmolLM2's projections at 64 rows on the Zen 4,
// alternated in one process, against each panel de-quantized before its multiply-adds: a unit a call
// 1-6 % faster, 2 units 4-6 % (the Q8_0 head 12 % both), 3 or 4 no better; at 16 rows 1-4 % (the head
// 21 %), at 2,048 5 %; results bit for bit the same (benchmarks/HISTORY.md, #41's eighteenth pass).
constexpr int64_t kUnitsAtOnce = 2;

template <int64_t F>
struct NextPanel {
  static constexpr bool kActive = true;
  static constexpr int64_t kTiles = kNR / kvtop_packed::kTile, kPairRow = 2 * kNR;
  const uint8_t* w;      // the packed weight
  int64_t p, n, nb;      // the panel, N, K's blocks of 32
  uint16_t* out;         // its [K/2, 48, 2] buffer
  int64_t units, every;  // units to make (0: none), pairs of K between calls of unit()
  int64_t done = 0;
  void run(int64_t u1) {
    for (; done < u1; ++done) {
      const int64_t i = done / nb, b = done % nb, t = p * kTiles + i;
      uint16_t* seg = out + i * 2 * kvtop_packed::kTile + b * (kBlock / 2) * kPairRow;
      if (t * kvtop_packed::kTile < n) {
        kvtop_packed::bf16_pairs<F>(w, t, b, nb, seg, kPairRow);
      } else {  // a tile past N (the last panel's): zero
        for (int64_t row = 0; row < kBlock / 2; ++row)
          std::memset(seg + row * kPairRow, 0, 2 * kvtop_packed::kTile * sizeof(uint16_t));
      }
    }
  }
  void unit() { run(std::min(units, done + kUnitsAtOnce)); }
  void finish() { run(units); }
};

// quant_bf16_gemm on a packed weight: a thread's run of (row chunk, panel) items, each item's panel
// de-quantized while the item before multiplies (into the thread's second buffer); only the run's first
// panel is de-quantized on its own.
template <int64_t F>
void packed_bf16_items(const uint16_t* xp, int64_t m, int64_t k, const uint8_t* wp, int64_t n, const float* bp,
                       uint16_t* yp) {
  const int64_t panels = (n + kNR - 1) / kNR, chunks = (m + kItemRows - 1) / kItemRows, nb = k / kBlock;
  const int64_t units = NextPanel<F>::kTiles * nb, calls = (units + kUnitsAtOnce - 1) / kUnitsAtOnce;
  at::parallel_for(0, chunks * panels, 1, [&](int64_t i0, int64_t i1) {
    thread_local kvtop::AlignedVector<uint16_t> buffers[2];
    buffers[0].resize(k * kNR);
    buffers[1].resize(k * kNR);
    uint16_t *panel = buffers[0].data(), *spare = buffers[1].data();
    NextPanel<F>{wp, i0 % panels, n, nb, panel, units, 1}.finish();
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m0 = i / panels * kItemRows, m1 = std::min(m, m0 + kItemRows), p = i % panels;
      const int64_t next = (i + 1) % panels;
      const bool prepare = i + 1 < i1 && next != p;
      // the item's pairs of K: its blocks of kMR rows (kMC is a multiple of kMR), K/2 pairs each
      const int64_t ticks = (m1 - m0 + kvtop_bf16::kMR - 1) / kvtop_bf16::kMR * (k / 2);
      const int64_t every = std::max<int64_t>(1, ticks / calls);
      NextPanel<F> side{wp, next, n, nb, spare, prepare ? units : 0, every};
      for (int64_t r = m0; r < m1; r += kvtop_bf16::kMC)
        kvtop_bf16::panel_item(xp, r, std::min(m1, r + kvtop_bf16::kMC), k, panel, p * kNR, n, bp, yp, nullptr, &side);
      if (prepare) {
        side.finish();
        std::swap(panel, spare);
      }
    }
  });
}
#endif

// x [M, K] bf16 @ W^T (+ bias) -> [M, N] bf16 on AVX512-BF16 without AMX (AMD Zen 4 and later):
// quant_gemm's work items with bf16_gemm's blocks. An item's panel of 48 columns is de-quantized into
// a thread's [K/2, 48, 2] bf16 buffer — the reference's values rounded to bf16, exactly the bf16
// model's weight; from the tiles of a packed weight (format = its ggml type + kPackedFormat) while the
// item before multiplies (packed_bf16_items), else through an fp32 panel — and multiplied into up to
// kItemRows rows with VDPBF16PS (csrc/bf16_panel.h), each output one fixed sequence of operations:
// bit for bit what bf16_gemm gives on the de-quantized weight, at twice the fp32 panels' multiplies a
// cycle.
at::Tensor quant_bf16_gemm(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t n,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && !x.is_cuda() && x.dim() == 2, "quant_bf16_gemm: x must be a bfloat16 [M, K]");
  const bool packed = format >= kPackedFormat;
  if (packed) format -= kPackedFormat;
  const int64_t k = x.size(1), m = x.size(0);
  const int64_t bytes = check_blocks(blocks, format, n, k, "quant_bf16_gemm");
  const std::optional<at::Tensor> bias32 =
      bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
  TORCH_CHECK(!bias32.has_value() || (bias32->dim() == 1 && bias32->size(0) == n), "quant_bf16_gemm: bias must be [N]");
  at::Tensor out = at::empty({m, n}, x.options());
#if defined(KVTOP_BF16_GEMM) && defined(KVTOP_QUANT_GEMM)
  if (m == 0) return out;
  const at::Tensor xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const float* bp = bias32.has_value() ? bias32->data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  if (packed) {
#ifdef KVTOP_QUANT_PACKED
    by_format(format, [&](auto f) { packed_bf16_items<decltype(f)::value>(xp, m, k, wp, n, bp, yp); });
    return out;
#else
    TORCH_CHECK(false, "quant_bf16_gemm: this build has no AVX-512 with BF16 and VNNI for packed weights");
#endif
  }
  by_format(format, [&](auto f) {
    kvtop_panels::for_each_item(m, (n + kNR - 1) / kNR, kItemRows, [&](int64_t m0, int64_t m1, int64_t p) {
      thread_local kvtop::AlignedVector<uint16_t> panel;
      panel.resize(k * kNR);
      thread_local kvtop::AlignedVector<float> fp32_panel;
      fp32_panel.resize(k * kNR);
      dequant_panel<decltype(f)::value>(wp, bytes, p, n, k, fp32_panel.data());
      bf16_pairs_of(fp32_panel.data(), k, panel.data());
      for (int64_t r = m0; r < m1; r += kvtop_bf16::kMC)
        kvtop_bf16::panel_item(xp, r, std::min(m1, r + kvtop_bf16::kMC), k, panel.data(), p * kNR, n, bp, yp, nullptr);
    });
  });
#else
  (void)bytes;
  TORCH_CHECK(false, "quant_bf16_gemm: this build has no AVX512-BF16");
#endif
  return out;
}

// Up to this many rows quant_linear de-quantizes in the registers (quant_gemv, which de-quantizes each
// block again for every kRows rows); above, a panel at a time into a buffer (quant_gemm).
constexpr int64_t kGemvRows = 4;

// Whether bf16 rows past the decode rows run on bf16 panels (quant_bf16_gemm) where there is no AMX:
// the build has AVX512-BF16.
bool bf16_panels_supported() {
#if defined(KVTOP_BF16_GEMM) && defined(KVTOP_QUANT_GEMM)
  return true;
#else
  return false;
#endif
}

// The layer's op (engine/model/quant_linear.py's QuantLinear, and decode_layers' quantized kind):
// x [M, K] float32 or bfloat16 -> [M, N] in x's dtype, computed in fp32 by quant_gemv or quant_gemm;
// bf16 rows past quant_gemv's count go to AMX where the CPU has it (amx_linear.cpp's amx_quant_linear),
// else to the bf16 panels where it has AVX512-BF16 (quant_bf16_gemm) — both with the weights rounded
// to bf16 as a bf16 model's are, its products bit for bit. A packed weight (format = its ggml type +
// kPackedFormat, quant_packed.cpp) runs decode rows there, more bf16 rows on AMX's tiles or the bf16
// panels read from it, and anything else on quant_gemm's panels read from it.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t n,
                        const std::optional<at::Tensor>& bias) {
  static const bool tiles = kvtop_amx::quant_tiles_supported();
  static const bool bf16_panels = bf16_panels_supported();
  const bool packed = format >= kPackedFormat;
  if (packed && x.size(0) <= kGemvRows && kvtop_packed::gemv_takes(x))
    return kvtop_packed::gemv(x, blocks, format - kPackedFormat, n, bias);
  if (x.scalar_type() == at::kBFloat16 && (packed || x.size(0) > kGemvRows)) {  // the weights rounded to bf16
    if (tiles) return kvtop_amx::quant_tiles_linear(x, blocks, format, n, bias);
    if (bf16_panels) return quant_bf16_gemm(x, blocks, format, n, bias);
  }
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor y = !packed && x32.size(0) <= kGemvRows ? quant_gemv(x32, blocks, format, n, bias)
                                                           : quant_gemm(x32, blocks, format, n, bias);
  return y.to(x.scalar_type());
}

// An MLP's gate/up projection, its packed weight holding gate and up tiles in turn (2 * inter columns:
// engine/model/quant_linear.py's QuantGateUp; the bias, if any, in that order): silu false, the
// [..., 2 * inter] output in the dense order (gate, then up), quant_linear's values on the weight as
// the file holds it; silu true, silu_and_mul of that, [..., inter], bit for bit. Many bf16 rows on
// AMX run SiLU-and-mul in the tiles' epilogue (the 2 * inter columns never stored), and so do decode
// rows (quant_packed.cpp's gemv_silu_mul, a tile pair at a time); any other rows through quant_linear,
// then SiLU-and-mul over the tile pairs.
at::Tensor quant_gate_up(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t inter,
                         const std::optional<at::Tensor>& bias, bool silu) {
  static const bool tiles = kvtop_amx::quant_tiles_supported();
  TORCH_CHECK(kvtop_packed::gate_up_supported(), "quant_gate_up: this build has no AVX-512 with BF16");
  TORCH_CHECK(format >= kPackedFormat && inter % 16 == 0, "quant_gate_up: a packed weight of gate/up tile pairs expected");
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  at::Tensor y;
  if (silu && x2.size(0) <= kGemvRows && kvtop_packed::gemv_takes(x2))
    y = kvtop_packed::gemv_silu_mul(x2, blocks, format - kPackedFormat, inter, bias);
  else if (tiles && x2.scalar_type() == at::kBFloat16 && x2.size(0) > kGemvRows)
    y = kvtop_amx::quant_tiles_gate_up(x2, blocks, format, inter, bias, silu);
  else
    y = kvtop_packed::gate_up_tiles(quant_linear(x2, blocks, format, 2 * inter, bias), inter, silu);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = y.size(1);
  return y.view(shape);
}

int64_t quant_gemv_rows() { return kGemvRows; }

// The blocks [N, K/32 * block bytes] of `format` de-quantized into `out`, a contiguous float32 [N, K]:
// the reference's values (dequant_block), for a GGUF file loaded de-quantized (engine/model/gguf_quant.py),
// where the `gguf` package's numpy de-quantization took 43 s of an 8B file's 77.
void quant_dequantize(const at::Tensor& blocks, int64_t format, const at::Tensor& out) {
  TORCH_CHECK(quant_linear_supported(), "quant_dequantize: this build has no AVX2 with FMA and F16C");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous() && !out.is_cuda(),
              "quant_dequantize: out must be a contiguous float32 [N, K] on the CPU");
  const int64_t n = out.size(0), k = out.size(1);
  const int64_t bytes = check_blocks(blocks, format, n, k, "quant_dequantize");
#ifdef KVTOP_QUANT_GEMM
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1), per_group = group_blocks(format);
  by_format(format, [&](auto f) {
    at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < k / kBlock; ++b) {
          __m256 v[4];
          dequant_block<decltype(f)::value>(wp + r * row_bytes + b / per_group * bytes, b % per_group, v);
          for (int i = 0; i < 4; ++i) _mm256_storeu_ps(op + r * k + b * kBlock + 8 * i, v[i]);
        }
    });
  });
#else
  (void)bytes;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def("quant_linear_supported() -> bool", &quant_linear_supported);
  m.def("quant_gemv(Tensor x, Tensor blocks, int format, int n, Tensor? bias) -> Tensor", &quant_gemv);
  m.def("quant_gemm(Tensor x, Tensor blocks, int format, int n, Tensor? bias) -> Tensor", &quant_gemm);
  m.def("quant_linear(Tensor x, Tensor blocks, int format, int n, Tensor? bias) -> Tensor", &quant_linear);
  m.def("quant_bf16_gemm(Tensor x, Tensor blocks, int format, int n, Tensor? bias) -> Tensor", &quant_bf16_gemm);
  m.def("quant_bf16_panels_supported() -> bool", &bf16_panels_supported);
  m.def("quant_gemv_rows() -> int", &quant_gemv_rows);
  m.def("quant_dequantize(Tensor blocks, int format, Tensor(a!) out) -> ()", &quant_dequantize);
  m.def("quant_gate_up(Tensor x, Tensor blocks, int format, int inter, Tensor? bias, bool silu) -> Tensor", &quant_gate_up);
}
