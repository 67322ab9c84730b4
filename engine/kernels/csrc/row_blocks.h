// What the prefill attention kernels' products share (fp32_attention.cpp in fp32, bf16_attention.cpp
// in bf16 pairs): blocks of up to kRows rows of A against up to kCols columns of B a pass, each block's
// shape (rows, vectors of 16 columns) a template fixed at compile time and picked here at run time.
// Plain C++: the products themselves hold the intrinsics.
#pragma once

#include <algorithm>
#include <cstdint>

namespace kvtop_rows {

constexpr int64_t kRows = 6;   // rows per block: 6 x 4 accumulators
constexpr int64_t kCols = 64;  // columns per pass: 4 vectors of 16

// Product::run<MR, NV>(a, lda, b, ldb, kc, out, ldo) for nv (1..4) vectors of columns.
template <typename Product, int MR, typename A, typename B>
void pass(int64_t nv, const A* a, int64_t lda, const B* b, int64_t ldb, int64_t kc, float* out, int64_t ldo) {
  switch (nv) {
    case 4: return Product::template run<MR, 4>(a, lda, b, ldb, kc, out, ldo);
    case 3: return Product::template run<MR, 3>(a, lda, b, ldb, kc, out, ldo);
    case 2: return Product::template run<MR, 2>(a, lda, b, ldb, kc, out, ldo);
    default: return Product::template run<MR, 1>(a, lda, b, ldb, kc, out, ldo);
  }
}

// out[0..mr) x [0..cols) = a[0..mr) . b over kc (cols a multiple of 16, mr <= kRows), in passes of
// kCols columns. Product is a struct with a static `template <int MR, int NV> run` of pass's arguments.
template <typename Product, typename A, typename B>
void rows_product(int64_t mr, const A* a, int64_t lda, const B* b, int64_t ldb, int64_t kc, int64_t cols, float* out,
                  int64_t ldo) {
  for (int64_t c = 0; c < cols; c += kCols) {
    const int64_t nv = std::min(kCols, cols - c) / 16;
    switch (mr) {
      case 6: pass<Product, 6>(nv, a, lda, b + c, ldb, kc, out + c, ldo); break;
      case 5: pass<Product, 5>(nv, a, lda, b + c, ldb, kc, out + c, ldo); break;
      case 4: pass<Product, 4>(nv, a, lda, b + c, ldb, kc, out + c, ldo); break;
      case 3: pass<Product, 3>(nv, a, lda, b + c, ldb, kc, out + c, ldo); break;
      case 2: pass<Product, 2>(nv, a, lda, b + c, ldb, kc, out + c, ldo); break;
      default: pass<Product, 1>(nv, a, lda, b + c, ldb, kc, out + c, ldo); break;
    }
  }
}

}  // namespace kvtop_rows
