// Scratch buffers that start on a cache line. A std::vector's storage is only 16-byte aligned (glibc's
// malloc; a large block is an mmap'd page plus a 16-byte header), so every 64-byte row of an AMX tile
// or AVX-512 vector read from it spans two cache lines. Found in the GGUF prefill slabs: SmolLM2's
// gate/up at 2,048 rows read from a std::vector's tiles took 1.18x the time of the same tiles read from
// a torch tensor (64-byte aligned), and the same as those once the buffer was aligned
// (benchmarks/HISTORY.md, #41's ninth pass). Every buffer that a kernel loads tiles or full vectors
// from is one of these.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace kvtop {

constexpr std::size_t kCacheLine = 64;

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}  // NOLINT: rebinding, as the standard allocators allow
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kCacheLine})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{kCacheLine}); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
  template <class U>
  bool operator!=(const CacheLineAllocator<U>&) const {
    return false;
  }
};

// A std::vector whose data() is 64-byte aligned.
template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace kvtop
