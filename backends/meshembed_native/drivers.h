// The C++ drivers the torch backend (ctypes, OpenMP threads) and the JAX backend (XLA's FFI,
// XLA's intra-op pool) both bind: the dense optimizer's chunked update, the all-finite check,
// the row gather and the huge-page hint. Written once here; each backend's .cc only adapts its
// calling convention and passes its own threads as `run(n_tasks, body)`, which calls body(t)
// once for every t in [0, n_tasks), in any order and on any threads. No optimizer formula: the
// dense update calls a row kernel generated from the core's math (meshembed_native/codegen.py).
// Header-only; built in by meshembed_native/build.py, which puts this directory on the include
// path.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "row_kernels.h"

namespace meshembed {

// Most arrays (a table or variable, then its slots) one generated kernel takes:
// codegen.MAX_ARRAYS.
constexpr int kMaxArrays = 8;

// A generated row kernel's C ABI (codegen.py): rows[k] = this row of array k, updated in place;
// g = its gradient row; dim = the row's length; hp = the dynamic values.
template <class T>
using RowKernel = void (*)(T* const* rows, const T* g, int64_t dim, const double* hp);

// `count` flat tensors cut into tasks of at most `chunk` elements, numbered tensor by tensor.
struct DenseChunks {
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (tensor, first element)
  int64_t elements = 0;

  DenseChunks(int64_t count, const int64_t* numels, int64_t chunk) {
    for (int64_t n = 0; n < count; ++n) {
      for (int64_t lo = 0; lo < numels[n]; lo += chunk) tasks.emplace_back(n, lo);
      elements += numels[n];
    }
  }
  int64_t size() const { return int64_t(tasks.size()); }
};

// The dense optimizer's step: the generated row `kernel` over every tensor n (each taken as one
// row, cut into the chunks of `chunks`: the kernel is element-wise), in place, reading every
// input once and writing every output once. grads[n]: tensor n's gradient; target(k, n): array
// k of tensor n (the variable, then its slots; n_arrays in [1, kMaxArrays]); hp + n * n_params:
// tensor n's parameter block.
template <class T, class Target, class Run>
void DenseUpdate(RowKernel<T> kernel, const DenseChunks& chunks, const int64_t* numels, int64_t n_arrays,
                 const T* const* grads, const Target& target, const double* hp, int64_t n_params, int64_t chunk,
                 Run&& run) {
  run(chunks.size(), [&](int64_t c) {
    const auto [n, lo] = chunks.tasks[c];
    T* rows[kMaxArrays];
    for (int64_t k = 0; k < n_arrays; ++k) rows[k] = target(k, n) + lo;
    kernel(rows, grads[n] + lo, std::min(chunk, numels[n] - lo), hp + n * n_params);
  });
}

// Whether x[lo, hi) is all finite: a float is NaN or +-Inf exactly when its exponent bits are all
// ones, an integer test over the bits that vectorises (an OR is associative, unlike a sum).
template <class T>
bool AllFiniteRange(const T* x, int64_t lo, int64_t hi) {
  using U = std::conditional_t<sizeof(T) == 8, uint64_t, uint32_t>;
  constexpr U kExponent = sizeof(T) == 8 ? U(0x7ff0000000000000ull) : U(0x7f800000u);
  U bad = 0;
  for (int64_t i = lo; i < hi; ++i) {
    U bits;
    std::memcpy(&bits, x + i, sizeof(T));
    bad |= U((bits & kExponent) == kExponent);
  }
  return bad == 0;
}

// Whether every element of the `chunks`' tensors is finite: ptrs[n] the data of tensor n,
// f64(n) whether it is float64 (else float32). Every chunk is read, whatever the others find.
// Last chunk first: the dense step's update (DenseUpdate) then starts on the gradient's first
// chunks, read last here and still in the last-level cache, so part of the gradient is read
// from memory once instead of twice.
template <class F64, class Run>
bool AllFinite(const DenseChunks& chunks, const int64_t* numels, const void* const* ptrs, const F64& f64,
               int64_t chunk, Run&& run) {
  std::atomic<bool> finite{true};
  run(chunks.size(), [&](int64_t c) {
    const auto [n, lo] = chunks.tasks[chunks.size() - 1 - c];
    const int64_t hi = std::min(lo + chunk, numels[n]);
    const bool ok = f64(n) ? AllFiniteRange(static_cast<const double*>(ptrs[n]), lo, hi)
                           : AllFiniteRange(static_cast<const float*>(ptrs[n]), lo, hi);
    if (!ok) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

// Whether a gather of `bytes` writes with streaming stores (StreamRow): an output this large
// does not fit the caches (docs/benchmarks.md, "Measurements behind design choices in the
// code": faster from here on, slower below).
constexpr int64_t kStreamMinBytes = int64_t(16) << 20;

// out row j = table row ids[j] for j in [lo, hi) of `row_bytes` bytes (any dtype: a copy of
// bits), the rows ahead prefetched (PrefetchAhead); a row whose id is outside [0, m) is zeros.
// `stream`: streaming stores (Streamable(out, row_bytes) must hold; StreamFence() follows, here).
// Returns how many ids were outside [0, m).
template <class I>
int64_t GatherRowRange(const char* table, int64_t m, const I* ids, int64_t lo, int64_t hi, int64_t row_bytes,
                       char* out, bool stream) {
  int64_t bad = 0;
  for (int64_t j = lo; j < hi; ++j) {
    PrefetchAhead(j, hi, row_bytes, false, [&](int64_t q) -> const void* {
      const int64_t r = int64_t(ids[q]);
      return r >= 0 && r < m ? table + r * row_bytes : nullptr;
    });
    const int64_t r = int64_t(ids[j]);
    if (r < 0 || r >= m) {
      std::memset(out + j * row_bytes, 0, row_bytes);
      ++bad;
    } else if (stream) {
      StreamRow(out + j * row_bytes, table + r * row_bytes, row_bytes);
    } else {
      std::memcpy(out + j * row_bytes, table + r * row_bytes, row_bytes);
    }
  }
  if (stream) StreamFence();
  return bad;
}

// IEEE subnormals on this thread while it lives, the previous mode restored after: a caller
// that flushes them (XLA's CPU runtime sets FTZ and DAZ on its threads) would otherwise make a
// kernel read a subnormal input as 0 and write 0 for a subnormal result, where the NumPy
// reference keeps them. (x86's MXCSR; elsewhere nothing.)
class KeepSubnormals {
 public:
#if defined(__SSE__)
  KeepSubnormals() : saved_(_mm_getcsr()) {
    constexpr unsigned kFlushToZero = 1u << 15, kDenormalsAreZero = 1u << 6;
    if (saved_ & (kFlushToZero | kDenormalsAreZero)) _mm_setcsr(saved_ & ~(kFlushToZero | kDenormalsAreZero));
  }
  ~KeepSubnormals() {
    if (_mm_getcsr() != saved_) _mm_setcsr(saved_);
  }

 private:
  unsigned saved_;
#endif
};

// Asks Linux for 2 MiB pages over the whole huge pages inside [p, p + bytes) where bytes >=
// min_bytes, before the first write (MADV_HUGEPAGE): a fresh large buffer is otherwise one
// first-touch fault per 4 KiB. A hint only; the Python side's twin is meshembed_native.pages.
inline void AdviseHugePages(void* p, int64_t bytes, int64_t min_bytes = int64_t(32) << 20) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  if (bytes < min_bytes) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = (a + kHuge - 1) & ~(kHuge - 1), hi = (a + uintptr_t(bytes)) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
  (void)min_bytes;
#endif
}

}  // namespace meshembed
