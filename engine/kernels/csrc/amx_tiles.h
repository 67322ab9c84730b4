// The AMX setup shared by amx_linear.cpp and amx_attention.cpp: whether this CPU and Linux allow the
// tiles (asked once per process), and the one tile shape both kernels use (16 rows of 64 bytes: an
// A or B tile of bf16 pairs, or a C tile of 16 x 16 fp32).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#define KVTOP_AMX 1

namespace kvtop_amx {

inline bool permitted() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
  const bool avx512bf16 = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
  if (!(tile && bf16 && avx512bf16)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

inline bool supported() {
  static const bool ok = permitted();  // one answer per process, whichever kernel asks first
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles 16 x 64 bytes, on the calling thread (the configuration is per thread). The
// configuration is built once, out of line: filled in a local next to the load, gcc dropped the
// stores of rows and colsb in one inlining context (the load read a zeroed config, and the first
// tile instruction faulted).
inline const TileConfig& tile_config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  return cfg;
}

inline void configure_tiles() { _tile_loadconfig(&tile_config()); }

inline void release_tiles() { _tile_release(); }

}  // namespace kvtop_amx
#endif
