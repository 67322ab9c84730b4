// bf16 linear layers on Intel AMX for the CPU engine's decode steps (issue #13).
//
// Why: a decode step multiplies a few rows (one per running sequence) by every weight of the model,
// so it is bound by how fast the weights stream from memory. oneDNN's packed bf16 GEMM reads them at
// 7-14 GB/s for 1..64 rows on a 2-core Sapphire Rapids whose memory gives 30-38 GB/s (MKL's fp32
// GEMV reaches that): benchmarks/linear.py, and benchmarks/HISTORY.md's "Decode-step linears". Here the weight is laid out once as the
// AMX B tiles in the exact order the kernel reads them (one sequential stream per 32 output columns),
// and each tile is multiplied by every 16-row A tile of the activations while it is in L1.
//
// Layout of the packed weight W [N, K] (N padded to 32, K to 32; built by engine/model/packed_linear.py's
// _pack_tiles, which holds the inverse too): [N/32][K/32][2][16][32] bf16, where
// tile (g, kb, h) row r holds, for the 16 columns n = 32g + 16h + c, the pair W[n, 32kb + 2r + {0,1}]
// (the VNNI pairs TDPBF16PS takes). Products accumulate in fp32 in the tiles; the result is rounded
// to bf16 once (nearest even), with the bias added in fp32 first. The order of the sums differs from
// oneDNN's, so results differ from F.linear by at most the last bf16 bit or so (tests/test_packed_linear.py).
//
// GGUF blocks (amx_quant_linear, for quant_gemm.cpp's quant_linear and quant_gate_up): a bf16 model's
// rows past the decode rows, multiplied by tiles de-quantized a group of 32 columns at a time into
// this same layout (csrc/quant_blocks.h and quant_packed.h read the blocks) — for a decode step's
// rows a K chunk at a time in L1 (up to 32 rows, or 64 with large groups: run_groups_in_l1) or each
// thread's next group while the last one multiplies (Pipelined); for prefill's the same Pipelined
// groups against each thread's own rows where those fit its L2, else a slab shared by the threads —
// and multiplied as above, with amx_gate_up's epilogues for a gate/up weight packed in tile pairs.
//
// The AMX code is compiled only where the build's target has AMX-BF16 and AVX512-BF16 (-march=native
// on such a CPU); elsewhere (an AVX2 machine, KVTOP_CPU_ARCH=x86-64-v3) only the ops' shells are
// built and `amx_supported()` is false. Where it is compiled, `amx_supported()` still asks the CPU
// (CPUID) and Linux (arch_prctl permission for the tile data) once; engine/model/packed_linear.py
// asks it before using any of this.
//
// Each 32 x 32 block's result is rounded and written out while the next block multiplies (see Pending).
// Outputs are written with plain stores: non-temporal ones for large outputs helped while the epilogue
// stalled the tiles (benchmarks/HISTORY.md, "Fifth pass"); with the epilogue in the tiles' shadow they
// measured slower (1,024-token prefill steps 180 vs 164 ms; "Ninth pass").

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

// As in fused_ops.cpp: no mul+add turned into an fma, so bf16_simd.h's SiLU is compiled alike in both.
#pragma GCC optimize("fp-contract=off")
#include "aligned_vector.h"
#include "amx_tiles.h"
#include "bf16_simd.h"
#include "quant_blocks.h"
#include "quant_packed.h"

namespace {

constexpr int64_t kTileRows = 16;  // rows of every tile
constexpr int64_t kTileK = 32;     // bf16 elements of K per tile row (64 bytes)
constexpr int64_t kGroupN = 32;    // output columns per group: two B tiles, read as one stream
constexpr int64_t kTileElems = kTileRows * kTileK;  // 512 bf16 = 1 KiB
constexpr int64_t kBlockM = 256;
constexpr int64_t kPipelinedGroupBytes = 96 << 10;  // 33-64 decode rows: Pipelined up to this group size (quant_tiles)
// Prefill rows of GGUF blocks: each thread its own rows, Pipelined, where they take at most this much
// of its L2 (every AMX core has 2 MiB); slabs shared by the threads past it (quant_tiles)
constexpr int64_t kRowsInL2Bytes = 1280 << 10;
constexpr int64_t kPrefetchTiles = 8;  // 16 KiB ahead: 2 and 4 measured slower (M=16: 8.1 and 9.9 ms vs 7.7 for SmolLM2's linears)

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// What a block's 32 columns are (see amx_gate_up): plain output columns; a gate/up weight's 16 gate
// and 16 up columns, written to their places in the dense order; or the same, with SiLU-and-mul's 16
// results written instead.
enum class Epilogue { kPlain, kGateUp, kSiluMul };

#ifdef KVTOP_AMX

using kvtop_amx::configure_tiles;
using kvtop_amx::release_tiles;

// gcc's tile intrinsics are asm statements that name no memory: without these barriers the compiler
// may move the plain loads of `acc` above the tile stores that fill it.
#define KVTOP_MEMORY_BARRIER() asm volatile("" ::: "memory")

// A finished 32 x 32 fp32 block waiting to be rounded to bf16 and written out. Its rows are written
// a few at a time during the next block's K loop (AVX-512 work in the shadow of the tile multiplies,
// which otherwise sat idle through every epilogue): SmolLM2's projections at 2,048 rows, two threads,
// 2.46 -> 2.81 TFLOP/s in a standalone copy of this loop (benchmarks/HISTORY.md, "Ninth pass").
struct Pending {
  const float* acc = nullptr;  // row stride 32 floats
  int64_t rows = 0, done = 0;
  const float* bias = nullptr;  // 32 floats (zero-padded) or null
  uint16_t* out = nullptr;      // kGateUp: the gate columns' place (the up columns are `up_offset` on)
  int64_t out_stride = 0, cols = 0, up_offset = 0;
  Epilogue kind = Epilogue::kPlain;
};

// Group g's bias (its columns n0 .. n0 + cols) zero-padded to 32 floats in `pad`; null without a bias.
inline const float* group_bias(const float* bias, int64_t n0, int64_t cols, float* pad) {
  if (!bias) return nullptr;
  std::fill(pad, pad + 32, 0.0f);
  std::copy(bias + n0, bias + n0 + cols, pad);
  return pad;
}

// Where the output columns of the group starting at column n0 begin: n0, or for a gate/up weight
// (16 gate and 16 up columns a group) its gate columns' place, n0 / 2.
inline int64_t out_column(Epilogue kind, int64_t n0) { return kind == Epilogue::kPlain ? n0 : n0 / 2; }

// 16 lanes rounded to bf16 as the tiles' epilogue rounds (VCVTNEPS2BF16), widened back to floats.
inline __m512 tile_round(__m512 v) { return kvtop_simd::bf16_widen(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v))); }

// Rows [p.done, upto) of p (+ bias) rounded to bf16 (nearest even) into its output columns.
inline void drain(Pending& p, int64_t upto) {
  upto = std::min(upto, p.rows);
  if (p.done >= upto) return;
  const __mmask32 mask = p.cols >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << p.cols) - 1);
  const __m512 b0 = p.bias ? _mm512_loadu_ps(p.bias) : _mm512_setzero_ps();
  const __m512 b1 = p.bias ? _mm512_loadu_ps(p.bias + 16) : _mm512_setzero_ps();
  for (int64_t r = p.done; r < upto; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(p.acc + r * 32), b0);
    const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(p.acc + r * 32 + 16), b1);
    uint16_t* row = p.out + r * p.out_stride;
    if (p.kind == Epilogue::kPlain) {
      _mm512_mask_storeu_epi16(row, mask, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    } else if (p.kind == Epilogue::kGateUp) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + p.up_offset), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)));
    } else {  // gate and up rounded as the plain output would be, then fused_ops.cpp's SiLU-and-mul
      const __m512 act = kvtop_simd::silu_mul16<true>(tile_round(lo), tile_round(hi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), kvtop_simd::bf16_pack(act));
    }
  }
  p.done = upto;
}

// Rows [m0, m0 + 32) (two A tiles, or one when TWO_A is false) against group g (two B tiles),
// all of K; the 32 x 32 fp32 result into `acc` (row stride 32 floats). Each K step also prefetches
// `next_lines` lines from `next` on into L2 (run_groups: the next group's share for this pass),
// writes out `prev`'s next rows and calls shadow(kb) (run_groups: the source's work in the tiles'
// shadow); what is left of `prev` is written before the tiles are stored.
template <bool TWO_A, bool PREFETCH, class Shadow>
void tile_block(const uint16_t* a, int64_t a_stride_bytes, const uint16_t* b, int64_t kb_count,
                                 float* acc, const char* next, int64_t next_lines, Pending& prev, Shadow&& shadow) {
  const int64_t rows_per_kb = (prev.rows + kb_count - 1) / kb_count;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO_A) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < kb_count; ++kb) {
    const uint16_t* bt = b + kb * 2 * kTileElems;
    if constexpr (PREFETCH) {  // the first pass over a group streams it in; later passes find it in cache
      const char* ahead = reinterpret_cast<const char*>(bt + kPrefetchTiles * 2 * kTileElems);
      for (int line = 0; line < 2 * kTileElems * 2 / 64; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
    }
    for (int64_t line = 0; line < next_lines; ++line) _mm_prefetch(next + (kb * next_lines + line) * 64, _MM_HINT_T1);
    _tile_loadd(4, a + kb * kTileK, a_stride_bytes);
    _tile_loadd(6, bt, 64);
    _tile_loadd(7, bt + kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO_A) {
      _tile_loadd(5, a + kTileRows * a_stride_bytes / 2 + kb * kTileK, a_stride_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    drain(prev, (kb + 1) * rows_per_kb);
    shadow(kb);
  }
  drain(prev, prev.rows);
  KVTOP_MEMORY_BARRIER();  // prev's rows are read before acc (possibly the same buffer's twin) is stored
  _tile_stored(0, acc, 32 * 4);
  _tile_stored(1, acc + 16, 32 * 4);
  if constexpr (TWO_A) {
    _tile_stored(2, acc + 16 * 32, 32 * 4);
    _tile_stored(3, acc + 16 * 32 + 16, 32 * 4);
  }
  KVTOP_MEMORY_BARRIER();  // ... and the tiles are in acc before anything reads it
}

// Where run_groups finds a group's tiles: laid out one group after another from group g0's (a packed
// bf16 weight, or a slab of de-quantized groups), nothing to do in the tiles' shadow.
struct Contiguous {
  static constexpr bool kStreams = true;  // the next group's tiles are in memory: run_groups prefetches them
  const uint16_t* w;
  int64_t g0, group_elems;
  const uint16_t* tiles(int64_t g) const { return w + (g - g0) * group_elems; }
  void shadow(int64_t, int64_t, int64_t) {}
};

// Groups [g0, g1) of M-block mb, their tiles from `source` (Contiguous, or quant_tiles' Pipelined):
// every 32-row chunk of the block against each group's tiles. Each block's result is written out
// during the next block (two fp32 buffers take turns); the last one after the loop. Each K step of
// group g's passes (step s of `steps`) also calls source.shadow(g, s, steps).
template <class Source>
void run_groups(const uint16_t* x, int64_t x_stride, int64_t m_begin, int64_t m_end,
                                 Source& source, int64_t kb_count, const float* bias, int64_t n,
                                 uint16_t* out, int64_t g0, int64_t g1, Epilogue kind) {
  // kGateUp / kSiluMul: group g holds gate columns [16g, 16g + 16) and the same up columns
  const int64_t inter = n / 2, out_stride = kind == Epilogue::kSiluMul ? inter : n;
  configure_tiles();
  alignas(64) float acc[2][32 * 32];
  alignas(64) float bias_pad[2][32];
  Pending prev;
  int which = 0;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * kGroupN, cols = std::min<int64_t>(kGroupN, n - n0);
    // a group's bias has its own buffer: the previous group's last block may still be pending
    const float* bg = group_bias(bias, n0, cols, bias_pad[g & 1]);
    KVTOP_MEMORY_BARRIER();  // the source's stores of group g's tiles come before their tile loads
    const uint16_t* wg = source.tiles(g);
    // With more than one 32-row pass over a group, every pass also pulls a share of the next group's
    // lines into L2 (the passes together: all of it), so the weight keeps streaming from DRAM while
    // later passes reuse this group from cache. SmolLM2's linears, weights from DRAM (linear.py
    // --cold), three alternations: 64 rows 0.95x, 0.96x, 1.01x the time; 256 rows 0.94-0.97x. One
    // pass (up to 32 rows) streams on its own: the extra prefetches measured 1.0-1.06x there, so none.
    const int64_t passes = (m_end - m_begin + 2 * kTileRows - 1) / (2 * kTileRows);
    const int64_t per_kb =  // lines per K step and pass
        Source::kStreams && passes > 1 && g + 1 < g1 ? 2 * kTileElems * 2 / 64 / passes : 0;
    for (int64_t m = m_begin; m < m_end; m += 2 * kTileRows) {
      const int64_t rows = std::min<int64_t>(2 * kTileRows, m_end - m);
      const uint16_t* a = x + m * x_stride;
      const int64_t pass = (m - m_begin) / (2 * kTileRows);
      const char* next = reinterpret_cast<const char*>(wg + kb_count * 2 * kTileElems) + pass * per_kb * kb_count * 64;
      float* block_acc = acc[which];
      auto shadow = [&](int64_t kb) { source.shadow(g, pass * kb_count + kb, passes * kb_count); };
      // A single pass prefetches ahead into L1 (into the next group: the weight is one stream). With
      // more passes the next group is already coming into L2 (above), and the L1 prefetch only cost:
      // linear.py --cold, three alternations, 64 rows 0.90-0.94x the time without it, 256 rows 0.88-0.95x.
      if (passes == 1 && Source::kStreams) {
        if (rows > kTileRows) tile_block<true, true>(a, x_stride * 2, wg, kb_count, block_acc, next, per_kb, prev, shadow);
        else tile_block<false, true>(a, x_stride * 2, wg, kb_count, block_acc, next, per_kb, prev, shadow);
      } else {
        if (rows > kTileRows) tile_block<true, false>(a, x_stride * 2, wg, kb_count, block_acc, next, per_kb, prev, shadow);
        else tile_block<false, false>(a, x_stride * 2, wg, kb_count, block_acc, next, per_kb, prev, shadow);
      }
      uint16_t* dst = out + m * out_stride + out_column(kind, n0);
      prev = Pending{block_acc, rows, 0, bg, dst, out_stride, cols, inter, kind};
      which ^= 1;
    }
  }
  drain(prev, prev.rows);
  release_tiles();
}
#endif  // KVTOP_AMX

bool amx_supported() {
#ifdef KVTOP_AMX
  return kvtop_amx::supported();
#else
  return false;
#endif
}

// x [M, K] as the A tiles read it: 16 full rows of 64 bytes, so the rows padded to 16 and K to k_pad
// (zeros), unless already so.
at::Tensor tile_rows(const at::Tensor& x2, int64_t k_pad) {
  const int64_t m = x2.size(0), k = x2.size(1), m_pad = round_up(m, kTileRows);
  if (m_pad == m && k_pad == k && x2.stride(1) == 1 && x2.stride(0) == k) return x2;
  at::Tensor a = at::zeros({m_pad, k_pad}, x2.options());
  a.narrow(0, 0, m).narrow(1, 0, k).copy_(x2);
  return a;
}

// The bias (if any) as the tiles' epilogue adds it: fp32, [n].
std::optional<at::Tensor> fp32_bias(const std::optional<at::Tensor>& bias, int64_t n, const char* name) {
  if (!bias.has_value()) return std::nullopt;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, name, ": bias must be [n]");
  return bias->to(at::kFloat).contiguous();
}

// x [..., K] bf16 @ W^T (+ bias) -> [..., N] bf16 (kSiluMul: [..., N / 2]), W given in the tile layout
// (engine/model/packed_linear.py's _pack_tiles) and its N; the bias (if any) in fp32, in the packed order.
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
               Epilogue kind, const char* name) {
  TORCH_CHECK(amx_supported(), name, ": this CPU or kernel does not allow AMX");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.dim() == 5,
              name, ": bfloat16 x and a tile-layout weight expected");
  const int64_t k = x.size(-1), kbs = packed.size(1), groups = packed.size(0);
  TORCH_CHECK(round_up(k, kTileK) == kbs * kTileK && round_up(n, kGroupN) == groups * kGroupN,
              name, ": x's last dim or n does not match the packed weight");
  TORCH_CHECK(kind == Epilogue::kPlain || n % kGroupN == 0, name, ": a gate/up weight of 32k rows expected");
  const at::Tensor x2 = x.reshape({-1, k});
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = kind == Epilogue::kSiluMul ? n / 2 : n;
  at::Tensor out = at::empty(out_shape, x.options());
  if (m == 0) return out;
  const at::Tensor a = tile_rows(x2, kbs * kTileK);
  const std::optional<at::Tensor> b32 = fp32_bias(bias, n, name);
#ifdef KVTOP_AMX
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<c10::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  const float* bp = b32 ? b32->data_ptr<float>() : nullptr;
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int64_t blocks = (m + kBlockM - 1) / kBlockM, a_stride = a.stride(0);
  // one task = (M block, group); M-block major, so a thread's groups share that block's rows in L2
  at::parallel_for(0, blocks * groups, 1, [&](int64_t t0, int64_t t1) {
    while (t0 < t1) {
      const int64_t mb = t0 / groups, g0 = t0 % groups, g1 = std::min(groups, g0 + (t1 - t0));
      Contiguous source{wp + g0 * kbs * 2 * kTileElems, g0, kbs * 2 * kTileElems};
      run_groups(ap, a_stride, mb * kBlockM, std::min(m, (mb + 1) * kBlockM), source, kbs, bp, n, op, g0, g1, kind);
      t0 += g1 - g0;
    }
  });
#endif
  return out;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n) {
  return run(x, packed, bias, n, Epilogue::kPlain, "amx_linear");
}

// An MLP's gate/up projection, its weight packed with gate and up rows interleaved by 16
// (packed_linear.py's AMXGateUp: rows 16g..16g+15 of gate, then the same of up, for each g), so that
// each group of 32 output columns holds 16 gate columns and their 16 up columns. silu false: the
// [..., 2 * inter] output in the dense order (gate, then up), as amx_linear on the original weight;
// silu true: SiLU-and-mul's [..., inter] written straight from the tiles' epilogue, bit for bit
// silu_and_mul(amx_linear(...)) — the 2 * inter columns are never stored, nor read back.
at::Tensor amx_gate_up(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t inter, bool silu) {
  return run(x, packed, bias, 2 * inter, silu ? Epilogue::kSiluMul : Epilogue::kGateUp, "amx_gate_up");
}

#if defined(KVTOP_AMX) && defined(KVTOP_QUANT_GEMM)
// 16 registers of 16 dwords transposed: out[j] holds dword j of in[0..15] (in[c]: column c's 16 bf16
// pairs; out[j]: pair j of the 16 columns, one row of a B tile).
inline void transpose16(const __m512i in[16], __m512i out[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[4q + s], 128-bit lane L: columns 4q .. 4q + 3 of dword 4L + s
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int s = 0; s < 4; ++s) {
    const __m512i ab_lo = _mm512_shuffle_i32x4(u[s], u[4 + s], 0x44), ab_hi = _mm512_shuffle_i32x4(u[s], u[4 + s], 0xEE);
    const __m512i cd_lo = _mm512_shuffle_i32x4(u[8 + s], u[12 + s], 0x44);
    const __m512i cd_hi = _mm512_shuffle_i32x4(u[8 + s], u[12 + s], 0xEE);
    out[s] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
    out[4 + s] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
    out[8 + s] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
    out[12 + s] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
  }
}

// Tile (kb, h) of group g ([16][32] bf16: B-tile row r holds the pairs (2r, 2r + 1) of the 16 columns
// 32g + 16h + c, as _pack_tiles lays out the bf16 weight) from the file's blocks: each sub-block of 32
// values as the reference de-quantizes it (fp32), rounded to bf16 to nearest even as torch's
// .to(torch.bfloat16) rounds; columns past n zero.
template <int64_t F>
void dequant_tile(const uint8_t* w, int64_t row_bytes, int64_t g, int64_t h, int64_t kb, int64_t n, uint16_t* tile) {
  constexpr int64_t kG = kvtop_quant::group_blocks(F);
  const int64_t bytes = kvtop_quant::group_bytes(F);
  __m512i cols[16], rows[16];
  for (int c = 0; c < 16; ++c) {
    const int64_t col = g * kGroupN + 16 * h + c;
    if (col >= n) {
      cols[c] = _mm512_setzero_si512();
      continue;
    }
    __m512 v[2];
    kvtop_quant::dequant_block16<F>(w + col * row_bytes + kb / kG * bytes, kb % kG, v);
    cols[c] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v[1], v[0]));
  }
  transpose16(cols, rows);
  for (int r = 0; r < 16; ++r) _mm512_storeu_si512(tile + r * kTileK, rows[r]);
}

// Tile (kb, h) of group g, as dequant_tile makes it, from a weight packed for decode (quant_packed.h):
// a packed tile's 16 columns are half a group, its sub-block kb's pairs (bf16_pairs) the B tile.
template <int64_t F>
void dequant_packed_tile(const uint8_t* w, int64_t g, int64_t h, int64_t kb, int64_t kbs, int64_t n, uint16_t* tile) {
  const int64_t t = 2 * g + h;
  if (16 * t >= n) {
    std::memset(tile, 0, kTileElems * 2);
    return;
  }
  kvtop_packed::bf16_pairs<F>(w, t, kb, kbs, tile, kTileK);
}

// Group g + 1's tiles de-quantized while group g multiplies (quant_tiles' decode rows): two buffers of
// one group's tiles take turns, and each K step of group g's passes makes its share of the next
// group's 2 * kbs tiles, which stay in L1/L2 from their stores to their tile loads. Against runs of
// groups de-quantized and then multiplied: 64 and 128 rows of SmolLM2's gate/up 0.90-0.94x the time
// (benchmarks/HISTORY.md, #41's seventh pass). The AVX-512 work itself mostly does not hide behind
// the tiles on the Xeon: there, 64 rows took 76-84 us with the de-quantization skipped, ~90 us for
// the de-quantization alone, 137-157 us both.
template <class DequantTile>
struct Pipelined {
  static constexpr bool kStreams = false;  // the next group's tiles are being made, not to be prefetched
  DequantTile dequant_tile;                // (g, h, kb, tile)
  uint16_t* buffers[2];
  int64_t g_end, kbs;
  const uint16_t* tiles(int64_t g) const { return buffers[g & 1]; }
  void make(int64_t g, int64_t u0, int64_t u1) {  // tiles u0 .. u1 - 1 (tile u: kb = u / 2, h = u % 2)
    for (int64_t u = u0; u < u1; ++u) dequant_tile(g, u % 2, u / 2, buffers[g & 1] + u * kTileElems);
  }
  void shadow(int64_t g, int64_t step, int64_t steps) {
    if (g + 1 < g_end) make(g + 1, 2 * kbs * step / steps, 2 * kbs * (step + 1) / steps);
  }
};

// Groups [g0, g1) for up to 64 rows, each group's tiles made by `dequant_tile` (g, h, kb, tile) a K
// chunk at a time into a buffer that stays in L1 and multiplied from there, the accumulators in
// their tiles all of K: up to 32 rows, two A tiles against a K step's two B tiles; 33 to 64 (TALL),
// four A tiles against one, the group's two 16-column halves in turn. Then the group's rows are
// written out. Pipelined (above) keeps a whole group for the passes of more rows, its stores and tile
// loads through L2: against it, SmolLM2's gate/up alone took 0.80-0.87x the time at 8 and 16 rows,
// 0.81-0.90x at 48 and 64 (benchmarks/HISTORY.md, #41's seventh pass) — though in the engine's decode
// steps Pipelined is the faster at 48 and 64 rows where groups are small (quant_tiles; twelfth pass).
template <bool TALL, class DequantTile>
void run_groups_in_l1(const uint16_t* x, int64_t x_stride, int64_t m, DequantTile& dequant_tile, int64_t kbs,
                      const float* bias, int64_t n, uint16_t* out, int64_t g0, int64_t g1, Epilogue kind) {
  constexpr int64_t kChunk = 8;  // K blocks a chunk (16 and 32 measured slower; 4 and 6 no different)
  constexpr int64_t kHalves = TALL ? 2 : 1, kTilesPerKb = TALL ? 1 : 2;
  const int64_t inter = n / 2, out_stride = kind == Epilogue::kSiluMul ? inter : n;
  const int64_t a_bytes = x_stride * 2, a_tile = kTileRows * x_stride;  // an A tile's stride; its 16 rows
  alignas(64) uint16_t chunk[kChunk * kTilesPerKb * kTileElems];
  alignas(64) float acc[64 * 32];  // rows of 32 floats
  alignas(64) float bias_pad[32];
  configure_tiles();
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t half = 0; half < kHalves; ++half) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb0 = 0; kb0 < kbs; kb0 += kChunk) {
        const int64_t kb1 = std::min(kbs, kb0 + kChunk);
        KVTOP_MEMORY_BARRIER();  // the last chunk's tile loads before this chunk's stores
        for (int64_t kb = kb0; kb < kb1; ++kb)
          for (int64_t j = 0; j < kTilesPerKb; ++j)
            dequant_tile(g, TALL ? half : j, kb, chunk + ((kb - kb0) * kTilesPerKb + j) * kTileElems);
        KVTOP_MEMORY_BARRIER();  // ... and its stores before its tile loads
        for (int64_t kb = kb0; kb < kb1; ++kb) {
          const uint16_t* bt = chunk + (kb - kb0) * kTilesPerKb * kTileElems;
          const uint16_t* a = x + kb * kTileK;
          if constexpr (TALL) {  // C tile i: rows 16i .. 16i + 15, this half's 16 columns
            _tile_loadd(6, bt, 64);
            _tile_loadd(4, a, a_bytes);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, a + a_tile, a_bytes);
            _tile_dpbf16ps(1, 5, 6);
            _tile_loadd(7, a + 2 * a_tile, a_bytes);
            _tile_dpbf16ps(2, 7, 6);
            if (m > 3 * kTileRows) {
              _tile_loadd(4, a + 3 * a_tile, a_bytes);
              _tile_dpbf16ps(3, 4, 6);
            }
          } else {  // C tiles 0, 1: rows 0 .. 15, columns 0 .. 15 and 16 .. 31; 2, 3: rows 16 .. 31
            _tile_loadd(4, a, a_bytes);
            _tile_loadd(6, bt, 64);
            _tile_loadd(7, bt + kTileElems, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (m > kTileRows) {
              _tile_loadd(5, a + a_tile, a_bytes);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
        }
      }
      if constexpr (TALL) {
        _tile_stored(0, acc + 16 * half, 32 * 4);
        _tile_stored(1, acc + 16 * 32 + 16 * half, 32 * 4);
        _tile_stored(2, acc + 32 * 32 + 16 * half, 32 * 4);
        _tile_stored(3, acc + 48 * 32 + 16 * half, 32 * 4);
      } else {
        _tile_stored(0, acc, 32 * 4);
        _tile_stored(1, acc + 16, 32 * 4);
        _tile_stored(2, acc + 16 * 32, 32 * 4);
        _tile_stored(3, acc + 16 * 32 + 16, 32 * 4);
      }
    }
    KVTOP_MEMORY_BARRIER();  // the tiles are in acc before it is read
    const int64_t n0 = g * kGroupN, cols = std::min<int64_t>(kGroupN, n - n0);
    const float* bg = group_bias(bias, n0, cols, bias_pad);
    Pending block{acc, m, 0, bg, out + out_column(kind, n0), out_stride, cols, inter, kind};
    drain(block, m);
  }
  release_tiles();
}

#endif  // KVTOP_AMX && KVTOP_QUANT_GEMM

// x [..., K] bf16 @ W^T (+ bias) -> [..., N] bf16, W the GGUF blocks [N, K/32 * block bytes] of
// `format` (csrc/quant_blocks.h): for many rows on AMX. A group of 32 output columns at a time, its
// tiles de-quantized (the bf16 weight's tiles, value for value) and multiplied by every row as
// amx_linear multiplies them, so the results are amx_linear's on the de-quantized weight in bf16, bit
// for bit; the weight is never held de-quantized beyond a slab (prefill) or two groups (decode rows).
// `kind` as amx_linear's run: kGateUp and kSiluMul take a packed weight whose tiles are gate and up
// columns in turn (quant_linear.py's QuantGateUp), n = 2I.
at::Tensor quant_tiles(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t n,
                       const std::optional<at::Tensor>& bias, Epilogue kind, const char* name) {
  TORCH_CHECK(amx_supported(), name, ": this CPU or kernel does not allow AMX");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && !x.is_cuda(), name, ": bfloat16 x on the CPU expected");
  const int64_t k = x.size(-1);
  const bool packed = format >= kvtop_quant::kPackedFormat;  // quant_packed.cpp's tiles of 16 columns
  const int64_t file_format = packed ? format - kvtop_quant::kPackedFormat : format;
  kvtop_quant::check_blocks(blocks, file_format, n, k, name);
  TORCH_CHECK(!packed || (kvtop_packed::packable_format(file_format) && n % kvtop_packed::kTile == 0),
              name, ": only Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and Q8_0 weights of 16k columns are packed");
  TORCH_CHECK(kind == Epilogue::kPlain || (packed && n % kGroupN == 0), name, ": a packed gate/up weight of 32k rows expected");
  const at::Tensor x2 = x.reshape({-1, k});
  const int64_t m = x2.size(0), kbs = k / kTileK, groups = round_up(n, kGroupN) / kGroupN;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = kind == Epilogue::kSiluMul ? n / 2 : n;
  at::Tensor out = at::empty(out_shape, x.options());
  if (m == 0) return out;
  const at::Tensor a = tile_rows(x2, k);
  const std::optional<at::Tensor> b32 = fp32_bias(bias, n, name);
#if defined(KVTOP_AMX) && defined(KVTOP_QUANT_GEMM)
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<c10::BFloat16>());
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const float* bp = b32 ? b32->data_ptr<float>() : nullptr;
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int64_t row_bytes = blocks.size(1), a_stride = a.stride(0), group_elems = kbs * 2 * kTileElems;
  static thread_local kvtop::AlignedVector<uint16_t> slab_buffer;  // prefill's slabs, the calling thread's: no page faults a call
  kvtop_quant::by_format(file_format, [&](auto f) {
    constexpr int64_t F = decltype(f)::value;
    auto dequant_tile_of = [&](int64_t g, int64_t h, int64_t kb, uint16_t* tile) {
      if constexpr (kvtop_packed::packable_format(F)) {
        if (packed) return dequant_packed_tile<F>(wp, g, h, kb, kbs, n, tile);
      }
      dequant_tile<F>(wp, row_bytes, g, h, kb, n, tile);
    };
    auto dequant = [&](int64_t g, uint16_t* group_tiles) {
      for (int64_t u = 0; u < 2 * kbs; ++u) dequant_tile_of(g, u % 2, u / 2, group_tiles + u * kTileElems);
    };
    // Rows [r0, r1) against groups [g0, g1) on the calling thread, each group's tiles made in the shadow
    // of the tile multiplies of the group before, in the thread's own two buffers.
    auto pipelined = [&](int64_t r0, int64_t r1, int64_t g0, int64_t g1) {
      thread_local kvtop::AlignedVector<uint16_t> pair;
      pair.resize(2 * group_elems);
      Pipelined<decltype(dequant_tile_of)> source{dequant_tile_of, {pair.data(), pair.data() + group_elems}, g1, kbs};
      source.make(g0, 0, 2 * kbs);
      run_groups(ap, a_stride, r0, r1, source, kbs, bp, n, op, g0, g1, kind);
    };
    if (m <= kBlockM) {
      // One M block (a decode step's rows): each thread takes a run of groups. Up to 32 rows, and up
      // to 64 where a group's tiles are more than kPipelinedGroupBytes, each group a K chunk at a time
      // in L1 (run_groups_in_l1); otherwise each group's tiles made in the shadow of the tile
      // multiplies of the group before (Pipelined). Engine decode steps of 48 and 64 sequences,
      // alternated in one process: SmolLM2 (groups of 36 and 96 KiB) 4-5 % more tokens/s Pipelined,
      // a Llama-3.2-1B shape (128 and 512 KiB) level, the Llama-3-8B shape (256 KiB and 896) 8 % fewer.
      if (m <= 2 * kTileRows || (m <= 4 * kTileRows && group_elems * 2 > kPipelinedGroupBytes)) {
        at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
          if (m <= 2 * kTileRows)
            run_groups_in_l1<false>(ap, a_stride, m, dequant_tile_of, kbs, bp, n, op, g0, g1, kind);
          else
            run_groups_in_l1<true>(ap, a_stride, m, dequant_tile_of, kbs, bp, n, op, g0, g1, kind);
        });
        return;
      }
      at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) { pipelined(0, m, g0, g1); });
      return;
    }
    // Many rows (prefill). Where a thread's share of the rows fits in its L2 (kRowsInL2Bytes), each
    // thread takes its own rows against every group, Pipelined as decode rows are: every thread makes
    // every tile (twice the de-quantization of slabs, below), but no tile crosses between cores and none
    // leaves L2. The engine alternated in one process: SmolLM2 prefill 64 x 256 prompts (2,048-row
    // steps) 0.96x the time of slabs, 4 x 256 0.96x, one 600-token prompt 0.90x; a Llama-3.2-1B shape
    // 0.91x (one 600-token prompt) and 0.89x (4 x 128). One 600-token prompt now takes less time than
    // on the bf16 weights, in both models.
    // Slabs lost most where calls of other shapes came between (an engine's layers do): SmolLM2's
    // gate/up alone at 2,048 rows 1.05x amx_linear's time called layer after layer, 1.17x with the
    // layers' other projections between (benchmarks/HISTORY.md, #41's thirteenth pass).
    const int64_t threads = at::get_num_threads();
    const int64_t rows_per_thread = round_up((m + threads - 1) / threads, 2 * kTileRows);
    if (rows_per_thread * a_stride * 2 <= kRowsInL2Bytes) {
      at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)  // one t a thread, or all of them on one in a nested region
          if (t * rows_per_thread < m) pipelined(t * rows_per_thread, std::min(m, (t + 1) * rows_per_thread), 0, groups);
      });
      return;
    }
    // Otherwise the threads de-quantize a slab of groups (~4 MiB of tiles) together, then multiply it
    // as amx_linear multiplies a weight, tasks M-block major, so that each thread's rows stay in L2
    // while the slab's tiles stream past. Runs of groups per thread over all the rows (as decode's)
    // read every row once per run: SmolLM2's linears at 2,048 rows took 1.17-1.20x amx_linear's time on
    // the weights in bf16, slabs 1.04-1.08x (the de-quantization, once per call).
    const int64_t slab = std::max<int64_t>(1, (4 << 20) / (group_elems * 2)), blocks = (m + kBlockM - 1) / kBlockM;
    slab_buffer.resize(std::min(slab, groups) * group_elems);
    uint16_t* const tiles = slab_buffer.data();  // (a worker naming `slab_buffer` would get its own)
    for (int64_t s0 = 0; s0 < groups; s0 += slab) {
      const int64_t count = std::min(slab, groups - s0);
      at::parallel_for(0, count, 1, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g) dequant(s0 + g, tiles + g * group_elems);
      });
      at::parallel_for(0, blocks * count, 1, [&](int64_t t0, int64_t t1) {
        while (t0 < t1) {
          const int64_t mb = t0 / count, g0 = t0 % count, g1 = std::min(count, g0 + (t1 - t0));
          Contiguous source{tiles + g0 * group_elems, s0 + g0, group_elems};
          run_groups(ap, a_stride, mb * kBlockM, std::min(m, (mb + 1) * kBlockM), source, kbs, bp, n, op, s0 + g0,
                     s0 + g1, kind);
          t0 += g1 - g0;
        }
      });
    }
  });
#endif
  return out;
}

at::Tensor amx_quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t n,
                            const std::optional<at::Tensor>& bias) {
  return quant_tiles(x, blocks, format, n, bias, Epilogue::kPlain, "amx_quant_linear");
}

}  // namespace

namespace kvtop_amx {  // for quant_gemm.cpp's quant_linear, which sends many bf16 rows here
bool quant_tiles_supported() {
#if defined(KVTOP_AMX) && defined(KVTOP_QUANT_GEMM)
  return amx_supported();
#else
  return false;
#endif
}

at::Tensor quant_tiles_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t n,
                              const std::optional<at::Tensor>& bias) {
  return amx_quant_linear(x, blocks, format, n, bias);
}

// A packed gate/up weight whose tiles are gate and up columns in turn, 2 * inter columns: the dense
// [gate, up] order, or SiLU-and-mul's [..., inter] from the tiles' epilogue (silu), as amx_gate_up.
at::Tensor quant_tiles_gate_up(const at::Tensor& x, const at::Tensor& blocks, int64_t format, int64_t inter,
                               const std::optional<at::Tensor>& bias, bool silu) {
  return quant_tiles(x, blocks, format, 2 * inter, bias, silu ? Epilogue::kSiluMul : Epilogue::kGateUp, "quant_gate_up");
}
}  // namespace kvtop_amx

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def("amx_supported() -> bool", &amx_supported);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &amx_linear);
  m.def("amx_gate_up(Tensor x, Tensor packed, Tensor? bias, int inter, bool silu) -> Tensor", &amx_gate_up);
  m.def("amx_quant_linear(Tensor x, Tensor blocks, int format, int n, Tensor? bias) -> Tensor", &amx_quant_linear);
}
