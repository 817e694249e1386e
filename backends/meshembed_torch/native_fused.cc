// Fused sparse update of one embedding table on the CPU: dedup of the looked-up rows,
// per-row gradient sums (in batch order, as the core's reference) and the optimizer, with
// no intermediate tensor. The optimizer is not written here: it is a row kernel generated
// from the core's math (meshembed_native/codegen.py), passed in as a function pointer with
// its parameter block. A registered optimisation of the torch backend
// (meshembed_torch/native.py); tests compare it with the core function and NumPy.
//
// Plain C ABI (called through ctypes with tensors' data pointers), float or double rows, no
// torch headers. Threads (the count torch's intra-op setting gives): the pooled lookup and the
// one-pass update share their chunks between the calling thread and helpers of their own
// (`Helpers` below: the caller never waits for a thread that has not started, where an OpenMP
// barrier waits a scheduler slice on shared cores; they sleep between calls, so they do not
// compete with torch's workers while idle); the checked per-id update and the gather of large
// outputs use OpenMP, which resolves to the libgomp torch has loaded (torch's own threads).
// Each chunk owns a contiguous range of unique rows (or segments), so no two threads write the
// same row.

#include <omp.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "drivers.h"  // includes row_kernels.h

namespace {

using meshembed::kMaxArrays;

// -- work sharing that never waits for a thread that has not started ----------------------------
//
// An OpenMP region ends at a barrier every thread of the team must reach; on cores shared with
// other processes a worker the kernel has not scheduled yet holds the caller there for a whole
// scheduler slice (W1 on the loaded 2-core machine: pieces of 0.3-3 ms took 8-24 ms). Here the
// caller and up to threads - 1 helpers take numbered chunks from one counter; the caller works
// too and waits only for chunks a helper has taken and not finished, so a helper that starts
// late finds nothing left and the caller never waits for it. Chunks may run on any thread in any
// order: each writes its own rows, so the results are the same bits. Helpers sleep on a condition
// variable between jobs (after a short spin), so they take no core while idle; one job at a time
// (a second caller meanwhile runs its chunks itself), and after fork() the child runs everything
// on its calling thread.
class Helpers {
 public:
  using Body = void (*)(void*, int64_t);

  static Helpers& Get() {
    static Helpers* pool = [] {
      pthread_atfork(nullptr, nullptr, [] { forked().store(true); });
      return new Helpers();  // never destroyed: detached helpers may still wait on it at exit
    }();
    return *pool;
  }

  // body(ctx, c) for every c in [0, chunks), on the calling thread and up to threads - 1 helpers.
  void Run(int threads, int64_t chunks, Body body, void* ctx) {
    if (threads <= 1 || chunks <= 1 || chunks >= (int64_t(1) << 31) || forked().load() || !submit_.try_lock()) {
      for (int64_t c = 0; c < chunks; ++c) body(ctx, c);
      return;
    }
    const int want = std::min(threads - 1, kMaxHelpers);
    while (started_ < want) {
      std::thread([this] { Serve(); }).detach();
      ++started_;
    }
    uint32_t gen;
    {
      std::lock_guard<std::mutex> lock(m_);
      gen = ++generation_;
      body_ = body;
      ctx_ = ctx;
      chunks_ = chunks;
      seats_ = want;
      done_.store(0, std::memory_order_relaxed);
      claim_.store(uint64_t(gen) << 32, std::memory_order_release);
      posted_.store(gen, std::memory_order_release);
    }
    cv_.notify_all();
    const int64_t mine = Work(gen, body, ctx, chunks);
    done_.fetch_add(mine, std::memory_order_acq_rel);
    for (int spin = 0; done_.load(std::memory_order_acquire) < chunks; ++spin) {
      if (spin < 4096) Pause();
      else std::this_thread::yield();  // a helper is inside a chunk: let it run
    }
    submit_.unlock();
  }

 private:
  static constexpr int kMaxHelpers = 63;

  static std::atomic<bool>& forked() {
    static std::atomic<bool> flag{false};
    return flag;
  }
  static void Pause() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }

  // Chunks of job `gen` taken and run on this thread until none is left; returns how many.
  int64_t Work(uint32_t gen, Body body, void* ctx, int64_t chunks) {
    int64_t count = 0;
    for (;;) {
      uint64_t v = claim_.load(std::memory_order_acquire);
      do {
        if (uint32_t(v >> 32) != gen || int64_t(v & 0xffffffffu) >= chunks) return count;
      } while (!claim_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel));
      body(ctx, int64_t(v & 0xffffffffu));
      ++count;
    }
  }

  void Serve() {
    uint32_t seen = 0;
    for (;;) {
      for (int spin = 0; spin < 2048 && posted_.load(std::memory_order_acquire) == seen; ++spin) Pause();
      Body body;
      void* ctx;
      int64_t chunks;
      uint32_t gen;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = gen = generation_;
        if (seats_ <= 0) continue;  // enough helpers on this job
        --seats_;
        body = body_;
        ctx = ctx_;
        chunks = chunks_;
      }
      // body and ctx stay valid while a chunk of job gen is unfinished: the caller waits for it
      const int64_t mine = Work(gen, body, ctx, chunks);
      if (mine) done_.fetch_add(mine, std::memory_order_acq_rel);
    }
  }

  std::mutex submit_;  // one job at a time
  int started_ = 0;    // helper threads started (guarded by submit_)
  std::mutex m_;       // guards the job's description below and wakes the helpers
  std::condition_variable cv_;
  uint32_t generation_ = 0;
  Body body_ = nullptr;
  void* ctx_ = nullptr;
  int64_t chunks_ = 0;
  int seats_ = 0;
  std::atomic<uint32_t> posted_{0};  // generation_, read while spinning without the lock
  std::atomic<uint64_t> claim_{0};   // (generation << 32) | the next chunk
  std::atomic<int64_t> done_{0};     // chunks finished
};

// f(c) for c in [0, chunks) on up to `threads` threads (Helpers); f is any callable.
template <class F>
void RunChunks(int threads, int64_t chunks, F& f) {
  Helpers::Get().Run(threads, chunks, [](void* ctx, int64_t c) { (*static_cast<F*>(ctx))(c); }, &f);
}


using meshembed::RowKernel;

template <class T>
struct Problem {
  RowKernel<T> kernel;
  const double* hp;
  int n_arrays;
  T* const* arrays;           // the table, then its slots, each [num_rows, dim] ...
  int64_t dim;
  int row_mask;               // ... but [num_rows, 1] where bit k is set (a row-wise slot)
  const T* grads;
  int64_t n;                  // contributions, in batch order:
  const int32_t* rank;        // ... the unique row each one adds to,
  const int64_t* grad_index;  // ... its row of `grads` (nullptr: i),
  const T* weights;           // ... and its weight (nullptr: 1)
  const int64_t* uniq;        // unique rows, ascending
  T* sums;                    // [unique, dim] gradient sums
  bool check;                 // check every element of grads (see fused_update)
};

// Sums of unique rows [lo, hi), in batch order (row_kernels.h). Returns false if p.check
// and a gradient row read here holds a NaN or Inf. Without grad_index every row of grads is
// read exactly once (by the owner of its row), so checking the rows read checks them all.
template <class T>
bool sum_range(const Problem<T>& p, int64_t lo, int64_t hi) {
  thread_local std::vector<int32_t> own;  // this thread's contributions
  own.resize(p.n);
  const int64_t count = meshembed::OwnedContributions(p.rank, p.n, lo, hi, own.data());
  auto src = [&](int64_t i) { return p.grads + (p.grad_index ? p.grad_index[i] : i) * p.dim; };
  auto sum = [&](auto scaled, auto check, const auto& scale) {
    return meshembed::SumOwnedInBatchOrder<decltype(scaled)::value, decltype(check)::value>(
        p.rank, own.data(), count, lo, hi, p.dim, p.sums, src, scale);
  };
  using Yes = std::true_type;
  using No = std::false_type;
  const bool check = p.check && !p.grad_index;
  if (p.weights) {
    auto w = [&](int64_t i) { return p.weights[i]; };
    return check ? sum(Yes{}, Yes{}, w) : sum(Yes{}, No{}, w);
  }
  auto one = [](int64_t) { return T(1); };
  return check ? sum(No{}, Yes{}, one) : sum(No{}, No{}, one);
}

// The optimizer on unique rows [lo, hi), their rows prefetched ahead (PrefetchUpdateRows).
template <class T>
void update_range(const Problem<T>& p, int64_t lo, int64_t hi) {
  T* rows[kMaxArrays];
  int64_t width[kMaxArrays];
  for (int k = 0; k < p.n_arrays; ++k) width[k] = (p.row_mask >> k) & 1 ? 1 : p.dim;
  for (int64_t u = lo; u < hi; ++u) {
    if (p.row_mask == 0) {
      meshembed::PrefetchUpdateRows(p.arrays, p.n_arrays, p.uniq, u, hi, p.dim);
    } else {
      for (int k = 0; k < p.n_arrays; ++k) meshembed::PrefetchUpdateRows(p.arrays + k, 1, p.uniq, u, hi, width[k]);
    }
    for (int k = 0; k < p.n_arrays; ++k) rows[k] = p.arrays[k] + p.uniq[u] * width[k];
    p.kernel(rows, p.sums + u * p.dim, p.dim, p.hp);
  }
}

// Sums and updates of unique rows [lo, hi) in one pass (the pooled W1 step's path): row u's
// contributions order[start[u], start[u + 1]) (batch order) summed in registers (LocalRow),
// then the row kernel on that sum, the rows of the next rows and contributions prefetched.
// No [unique, dim] buffer of sums is written and read back, and each thread walks only its
// own contributions (no scan of all n). Same additions in the same order as sum_range.
// The row width D is a compile-time constant where WithWidth knows it (0: p.dim at run time),
// in the addresses and prefetches too: with the width at run time in those, the W1 SGD pass took
// 2.04-2.12 ms against 1.73-1.86 (the harness of docs/benchmarks.md's session 16 section, one
// thread, 15 alternating rounds of 40 passes).
template <int D, class T>
void sum_update_rows(const Problem<T>& p, const int32_t* order, const int64_t* start, int64_t lo, int64_t hi) {
  const int64_t dim = D > 0 ? D : p.dim, row_bytes = dim * int64_t(sizeof(T)), end = start[hi];
  T* rows[kMaxArrays];
  int64_t width[kMaxArrays];
  for (int k = 0; k < p.n_arrays; ++k) width[k] = (p.row_mask >> k) & 1 ? 1 : dim;
  const int64_t* gi = p.grad_index;
  auto src = [&](int64_t i) { return p.grads + (gi ? gi[i] : i) * dim; };
  meshembed::LocalRow<D, T> acc(dim);
  T fixed[D > 0 ? D : 1];
  thread_local std::vector<T> buffer;
  if (D == 0) buffer.resize(dim);
  T* g = D > 0 ? fixed : buffer.data();
  for (int64_t u = lo; u < hi; ++u) {
    if (p.row_mask == 0) {
      meshembed::PrefetchUpdateRows(p.arrays, p.n_arrays, p.uniq, u, hi, dim);
    } else {
      for (int k = 0; k < p.n_arrays; ++k) meshembed::PrefetchUpdateRows(p.arrays + k, 1, p.uniq, u, hi, width[k]);
    }
    acc.Zero();
    for (int64_t c = start[u]; c < start[u + 1]; ++c) {
      meshembed::PrefetchAhead(c, end, row_bytes, false, [&](int64_t q) -> const void* { return src(order[q]); });
      const int64_t i = order[c];
      if (p.weights) acc.template Add<true>(src(i), p.weights[i]);
      else acc.template Add<false>(src(i), T(1));
    }
    acc.Store(g);
    for (int k = 0; k < p.n_arrays; ++k) rows[k] = p.arrays[k] + p.uniq[u] * width[k];
    p.kernel(rows, g, dim, p.hp);
  }
}

template <class T>
void sum_update_range(const Problem<T>& p, const int32_t* order, const int64_t* start, int64_t lo, int64_t hi) {
  meshembed::WithWidth(p.dim, [&](auto w) { sum_update_rows<decltype(w)::value>(p, order, start, lo, hi); });
}

// The rows of a batch grouped: `uniq` (the unique rows, ascending: the updates then walk the table
// in address order), `rank` (each contribution's row among them), `start` (row u's contributions
// are positions [start[u], start[u + 1]) of `order`) and, if asked, `order` (the contributions
// grouped by row, batch order kept within a row: a stable counting sort). Scratch of the calling
// thread, kept between calls (fresh megabytes every call would cost a page fault per 4 KiB).
struct Grouping {
  std::vector<uint64_t> bits;
  std::vector<int32_t> base, rank, order, count;
  std::vector<int64_t> uniq, start;
};

// Fills g for `rows` (n contributions, rows of [0, m)) on up to `threads` threads (one per 4 Ki
// contributions): the bitmap of the rows and its popcount prefix on one thread, then on all of
// them each thread's contributions' ranks (checking its gradient indices) and row counts, the
// unique rows of its words, the row starts (a two-level prefix over the rows) and each thread's
// contributions placed after the earlier threads' in every row (what keeps the sort stable).
// Returns the number of unique rows, or -1 if a row is outside [0, m), -2 if a gradient index is
// outside [0, grad_rows) (before anything else is computed).
inline int64_t GroupRows(Grouping& g, const int64_t* rows, int64_t n, int64_t m, const int64_t* grad_index,
                         int64_t grad_rows, int threads, bool want_order) {
  const int64_t words = (m + 63) / 64;
  g.bits.assign(words, 0);
  g.base.resize(words);
  uint64_t* bits = g.bits.data();
  int32_t* base = g.base.data();
  for (int64_t k = 0; k < n; ++k) {
    const int64_t r = rows[k];
    if (uint64_t(r) >= uint64_t(m)) return -1;  // a negative row is larger than any row count
    bits[r >> 6] |= uint64_t(1) << (r & 63);
  }
  int64_t unique = 0;
  for (int64_t w = 0; w < words; ++w) {
    base[w] = int32_t(unique);
    unique += __builtin_popcountll(bits[w]);
  }
  const int parts = int(std::max<int64_t>(1, std::min<int64_t>(threads, n >> 12)));
  g.uniq.resize(unique);
  g.rank.resize(n);
  g.start.resize(unique + 1);
  g.count.assign(int64_t(parts) * unique, 0);
  if (want_order) g.order.resize(n);
  int64_t* uniq = g.uniq.data();
  int32_t* rank = g.rank.data();
  int64_t* start = g.start.data();
  int32_t* count = g.count.data();  // count[t * unique + u]: thread t's contributions to row u
  int32_t* order = g.order.data();
  std::vector<int64_t> part(parts + 1, 0);
  std::vector<char> bad(parts, 0);
#pragma omp parallel num_threads(parts)
  {
    const int t = omp_get_thread_num();
    const int64_t ilo = n * t / parts, ihi = n * (t + 1) / parts;
    int32_t* own = count + int64_t(t) * unique;
    for (int64_t k = ilo; k < ihi; ++k) {
      const int64_t r = rows[k];
      const int32_t u = base[r >> 6] + __builtin_popcountll(bits[r >> 6] & ((uint64_t(1) << (r & 63)) - 1));
      rank[k] = u;
      ++own[u];
      if (grad_index && uint64_t(grad_index[k]) >= uint64_t(grad_rows)) bad[t] = 1;
    }
    for (int64_t w = words * t / parts, s = -1; w < words * (t + 1) / parts; ++w) {
      if (s < 0) s = base[w];
      for (uint64_t b = bits[w]; b; b &= b - 1) uniq[s++] = w * 64 + __builtin_ctzll(b);
    }
#pragma omp barrier
    const int64_t ulo = unique * t / parts, uhi = unique * (t + 1) / parts;
    int64_t sum = 0;
    for (int64_t u = ulo; u < uhi; ++u)
      for (int q = 0; q < parts; ++q) sum += count[int64_t(q) * unique + u];
    part[t + 1] = sum;
#pragma omp barrier
#pragma omp single
    for (int q = 0; q < parts; ++q) part[q + 1] += part[q];
    // (the single's closing barrier publishes part)
    int64_t run = part[t];
    for (int64_t u = ulo; u < uhi; ++u) {
      start[u] = run;
      for (int q = 0; q < parts; ++q) {  // thread q's first position in row u
        const int32_t c = count[int64_t(q) * unique + u];
        count[int64_t(q) * unique + u] = int32_t(run);
        run += c;
      }
    }
    if (want_order) {
#pragma omp barrier
      for (int64_t k = ilo; k < ihi; ++k) order[own[rank[k]]++] = int32_t(k);
    }
  }
  start[unique] = n;
  return std::any_of(bad.begin(), bad.end(), [](char b) { return b != 0; }) ? -2 : unique;
}

// Returns the number of unique rows updated, or (before writing anything) -1 if a row is
// outside [0, num_rows), -2 if a gradient index is outside [0, grad_rows), -3 if n_arrays is
// outside [1, kMaxArrays], -4 if `check` and an element of grads is NaN or Inf — any of its
// grad_rows rows, whether a contribution reads it or not (the engine's NaN/Inf policy, checked
// before the first write: with grad_index in a pass over grads of its own, split between the
// threads; without, in the sum phase, which then ends before the updates).
// Without grad_index, grad_rows must equal n. row_mask: bit k set = array k holds one value per
// row (a row-wise rule's slot, RowKernel.widths); never the table (bit 0).
template <class T>
int64_t fused_update(void* kernel, const double* hp, int n_arrays, T* const* arrays, int64_t num_rows,
                     const int64_t* rows, int64_t n, const int64_t* grad_index, const T* weights, const T* grads,
                     int64_t grad_rows, int64_t dim, int threads, int check, int row_mask) {
  if (n_arrays < 1 || n_arrays > kMaxArrays || (!grad_index && grad_rows != n) || (row_mask & 1) ||
      row_mask < 0 || row_mask >= (1 << n_arrays))
    return -3;
  // The contributions grouped by row (GroupRows); the order only for the one-pass path below.
  // On one thread: split between two threads its three barriers cost whole scheduler slices
  // whenever other processes share the cores (W1 on the shared 2-core machine: median 43 ms
  // against 21 ms for the update on one thread's grouping, docs/benchmarks.md), for ~0.3 ms
  // saved on idle cores.
  thread_local Grouping g;
  thread_local std::vector<T> sums;
  const bool one_pass = !check || grad_index;
  const int64_t unique = GroupRows(g, rows, n, num_rows, grad_index, grad_rows, 1, one_pass);
  if (unique < 0) return unique;
  const int32_t* rank = g.rank.data();
  const int64_t* start = g.start.data();
  Problem<T> p{reinterpret_cast<RowKernel<T>>(kernel), hp, n_arrays, arrays, dim, row_mask, grads, n, rank,
               grad_index, weights, g.uniq.data(), nullptr, check != 0};
  const int t_count = int(std::max<int64_t>(1, std::min<int64_t>(threads, unique / 256)));
  if (one_pass) {
    // Each thread sums and updates a range of rows, the ranges of about equal cost (a
    // contribution, or a row's update: the update costs about two contributions' sums).
    // chunks of rows (4 a thread), taken by whichever thread is free (Helpers)
    const int64_t parts = t_count == 1 ? 1 : 4 * int64_t(t_count);
    std::vector<int64_t> cut(parts + 1, unique);
    cut[0] = 0;
    for (int64_t t = 1; t < parts; ++t) {
      const int64_t goal = (n + 2 * unique) * t / parts;
      int64_t a = 0, b = unique;  // the first row u with start[u] + 2u >= goal
      while (a < b) {
        const int64_t m = (a + b) / 2;
        if (start[m] + 2 * m < goal) a = m + 1;
        else b = m;
      }
      cut[t] = a;
    }
    std::vector<char> finite(parts, 1);
    // the scratch is thread_local: its addresses taken here, on the calling thread
    const int32_t* order_of = g.order.data();
    if (check) {  // every gradient row finite before the first write
      auto rows_finite = [&](int64_t c) {
        finite[c] = meshembed::RowsFinite(grads, grad_rows * c / parts, grad_rows * (c + 1) / parts, dim);
      };
      RunChunks(t_count, parts, rows_finite);
      if (!std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; })) return -4;
    }
    auto sum_update = [&](int64_t c) { sum_update_range(p, order_of, start, cut[c], cut[c + 1]); };
    RunChunks(t_count, parts, sum_update);
    return unique;
  }

  // Checked without grad_index (a per-id gradient, every row read once): the sums first, each
  // gradient element checked as it is added (no pass of its own), then the updates.
  sums.resize(unique * dim);
  p.sums = sums.data();
  // Sums: the unique rows split into ranges of about equal contribution counts;
  // updates: ranges of equal row counts.
  std::vector<int64_t> cut(t_count + 1, unique);
  cut[0] = 0;
  for (int t = 1; t < t_count; ++t)
    cut[t] = std::lower_bound(start, start + unique, n * t / t_count) - start;
  std::vector<char> finite(t_count, 1);
#pragma omp parallel num_threads(t_count)
  {
#pragma omp for schedule(static, 1)
    for (int t = 0; t < t_count; ++t) finite[t] = sum_range(p, cut[t], cut[t + 1]);
    // the barrier closing the loop above publishes every finite[t]: all threads agree
    const bool ok = std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; });
#pragma omp for schedule(static, 1)
    for (int t = 0; t < t_count; ++t)
      if (ok) update_range(p, unique * t / t_count, unique * (t + 1) / t_count);
  }
  return std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; }) ? unique : -4;
}

}  // namespace

// One entry point per row dtype; `kernel` is a generated row kernel of the same dtype.
#define MESHEMBED_FUSED_UPDATE(T, NAME)                                                                        \
  extern "C" int64_t NAME(void* kernel, const double* hp, int n_arrays, T* const* arrays, int64_t num_rows,     \
                          const int64_t* rows, int64_t n, const int64_t* grad_index, const T* weights,         \
                          const T* grads, int64_t grad_rows, int64_t dim, int threads, int check,              \
                          int row_mask) {                                                                      \
    return fused_update<T>(kernel, hp, n_arrays, arrays, num_rows, rows, n, grad_index, weights, grads,        \
                           grad_rows, dim, threads, check, row_mask);                                         \
  }
MESHEMBED_FUSED_UPDATE(float, meshembed_fused_update_float32)
MESHEMBED_FUSED_UPDATE(double, meshembed_fused_update_float64)

// out[i] = table[ids[i]] for rows of `row_bytes` bytes (any dtype: a copy of bits), or -1 if
// an id is outside [0, num_rows) (out is then partly written). The driver of drivers.h
// (GatherRowRange), each thread a contiguous range of ids; with 64-byte aligned rows the stores
// stream past the caches, for outputs larger than the caches (the caller decides:
// native.gather_rows).
extern "C" int64_t meshembed_gather_rows(const char* table, int64_t num_rows, const int64_t* ids, int64_t n,
                                         int64_t row_bytes, char* out, int threads) {
  const bool stream = meshembed::Streamable(out, row_bytes);
  const int parts = std::max(1, threads);
  int64_t bad = 0;
#pragma omp parallel for schedule(static, 1) num_threads(parts) reduction(+ : bad)
  for (int t = 0; t < parts; ++t)
    bad += meshembed::GatherRowRange(table, num_rows, ids, n * t / parts, n * (t + 1) / parts, row_bytes, out, stream);
  return bad ? -1 : n;
}

namespace {

// out[s] = sum of table[ids[i]] over the positions i in [offsets[s], offsets[s + 1]), for the
// segments [lo, hi), each summed in registers (LocalRow<D, Acc>) in position order from 0 and
// stored once, the rows ahead prefetched (row_kernels.h, PrefetchPooled); add(acc, row) adds one
// table row of `w` elements. Returns whether every id read is in [0, num_rows) (an id outside
// adds nothing).
template <int D, class Acc, class T, class AddRow>
bool PooledSegments(const T* table, int64_t num_rows, int64_t d, const int64_t* ids, const int64_t* offsets,
                    int64_t lo, int64_t hi, Acc* out, const AddRow& add) {
  meshembed::LocalRow<D, Acc> acc(d);
  const int64_t w = D > 0 ? D : d, end = offsets[hi];
  const uint64_t rows = uint64_t(num_rows);
  uint64_t bad = 0;
  for (int64_t s = lo; s < hi; ++s) {
    acc.Zero();
    for (int64_t p = offsets[s]; p < offsets[s + 1]; ++p) {
      meshembed::PrefetchPooled(table, rows, w, ids, p, end);
      const int64_t id = ids[p];
      if (uint64_t(id) < rows) add(acc, table + id * w);
      else bad = 1;
    }
    acc.Store(out + s * w);
  }
  return !bad;
}

// PooledSegments over a float table: each row added as it is.
template <int D, class T>
bool PooledRange(const T* table, int64_t num_rows, int64_t d, const int64_t* ids, const int64_t* offsets,
                 int64_t lo, int64_t hi, T* out) {
  return PooledSegments<D>(table, num_rows, d, ids, offsets, lo, hi, out,
                           [](meshembed::LocalRow<D, T>& acc, const T* row) { acc.template Add<false>(row, T(1)); });
}

// PooledSegments over a table of 16-bit patterns (a low-precision table, embedding.precision),
// each element widened to float32 as it is added: Kind 0 = bfloat16, whose pattern is the high
// half of the float32 (a shift: exact, vectorised); Kind 1 = any 16-bit format through `lut`,
// the 65,536 float32 values of the patterns (made by the core's widening, meshembed.math.rounding:
// no conversion is written here). The same additions in the same order as PooledRange over the
// widened rows, so the same bits as the widen-then-sum path, without its [n, D] rows.
template <int D, int Kind>
bool PooledRange16(const uint16_t* table, int64_t num_rows, int64_t d, const int64_t* ids, const int64_t* offsets,
                   int64_t lo, int64_t hi, const float* lut, float* out) {
  const int64_t w = D > 0 ? D : d;
  return PooledSegments<D>(table, num_rows, d, ids, offsets, lo, hi, out,
                           [w, lut](meshembed::LocalRow<D, float>& acc, const uint16_t* __restrict row) {
                             float* __restrict a = acc.Data();
                             for (int64_t j = 0; j < w; ++j) {
                               float x;
                               if (Kind == 0) {
                                 const uint32_t bits = uint32_t(row[j]) << 16;
                                 __builtin_memcpy(&x, &bits, sizeof x);
                               } else {
                                 x = lut[row[j]];
                               }
                               a[j] += x;
                             }
                           });
}

// The segments' offsets from the slots, in the pass that checks their order and range; false if
// they are not non-decreasing in [0, num_segments).
inline bool OffsetsOf(const int64_t* slots, int64_t n, int64_t num_segments, int64_t* offsets) {
  int64_t s = -1;  // offsets[0, s] are written
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slots[i];
    if (slot != s) {
      if (slot < s || slot >= num_segments) return false;
      for (int64_t k = s + 1; k <= slot; ++k) offsets[k] = i;
      s = slot;
    }
  }
  for (int64_t k = s + 1; k <= num_segments; ++k) offsets[k] = n;
  return true;
}

// Whether `given` are offsets of n positions: from 0 to n, non-decreasing.
inline bool ValidOffsets(const int64_t* given, int64_t n, int64_t num_segments) {
  if (given[0] != 0 || given[num_segments] != n) return false;
  for (int64_t s = 0; s < num_segments; ++s)
    if (given[s + 1] < given[s]) return false;
  return true;
}

// The pooled sum's driver: the segments' offsets (given, checked, or found from the slots), then
// range(lo, hi) -> bool (every id read in range) over chunks of segments on up to `threads`.
template <class Range>
int64_t pooled_driver(int64_t n, const int64_t* slots, int64_t num_segments, const int64_t* given, int threads,
                      const Range& range) {
  thread_local std::vector<int64_t> offsets_of;
  const int64_t* offsets = given;
  if (given != nullptr) {
    if (!ValidOffsets(given, n, num_segments)) return -2;
  } else {
    offsets_of.resize(num_segments + 1);  // (thread_local: its address taken on this thread)
    if (!OffsetsOf(slots, n, num_segments, offsets_of.data())) return -2;
    offsets = offsets_of.data();
  }
  // threads for at least 16 Ki ids each: a parallel region of less work costs more than it saves
  const int workers = int(std::max<int64_t>(1, std::min<int64_t>(threads, n >> 14)));
  // chunks of segments of about equal id counts (4 a thread), taken by whichever thread is free
  const int64_t parts = workers == 1 ? 1 : 4 * int64_t(workers);
  std::atomic<int64_t> bad{0};
  auto chunk = [&](int64_t t) {
    const int64_t lo = t == 0 ? 0 : std::lower_bound(offsets, offsets + num_segments, n * t / parts) - offsets;
    const int64_t hi = t + 1 == parts ? num_segments
                                      : std::lower_bound(offsets, offsets + num_segments, n * (t + 1) / parts) - offsets;
    if (!range(offsets, lo, hi)) bad.store(1);
  };
  RunChunks(workers, parts, chunk);
  return bad.load() ? -1 : 0;
}

template <class T>
int64_t pooled_sum(const T* table, int64_t num_rows, int64_t d, const int64_t* ids, const int64_t* slots, int64_t n,
                   int64_t num_segments, const int64_t* given, T* out, int threads) {
  return pooled_driver(n, slots, num_segments, given, threads, [&](const int64_t* offsets, int64_t lo, int64_t hi) {
    bool ok = true;
    meshembed::WithWidth(d, [&](auto width) {
      ok = PooledRange<decltype(width)::value>(table, num_rows, d, ids, offsets, lo, hi, out);
    });
    return ok;
  });
}

// pooled_sum over 16-bit patterns (PooledRange16): kind 0 bfloat16, kind 1 through `lut`.
int64_t pooled_sum16(const uint16_t* table, int64_t num_rows, int64_t d, const int64_t* ids, const int64_t* slots,
                     int64_t n, int64_t num_segments, const int64_t* given, int kind, const float* lut, float* out,
                     int threads) {
  if (kind != 0 && (kind != 1 || lut == nullptr)) return -3;
  return pooled_driver(n, slots, num_segments, given, threads, [&](const int64_t* offsets, int64_t lo, int64_t hi) {
    bool ok = true;
    meshembed::WithWidth(d, [&](auto width) {
      constexpr int D = decltype(width)::value;
      ok = kind == 0 ? PooledRange16<D, 0>(table, num_rows, d, ids, offsets, lo, hi, lut, out)
                     : PooledRange16<D, 1>(table, num_rows, d, ids, offsets, lo, hi, lut, out);
    });
    return ok;
  });
}

}  // namespace

// out[s] = sum over i with slots[i] == s of table[ids[i]] (sum-mode pooling of sorted segments,
// the pooled lookup's forward), in position order from 0. `offsets` (nullable, num_segments + 1):
// the same segments' first positions (ragged row splits), read instead of scanning `slots`.
// Returns 0, or -1 if an id is outside [0, num_rows), -2 if the slots are not non-decreasing in
// [0, num_segments) or the offsets do not run from 0 to n without decreasing (nothing written).
#define MESHEMBED_POOLED(T, NAME)                                                                               \
  extern "C" int64_t NAME(const T* table, int64_t num_rows, int64_t d, const int64_t* ids, const int64_t* slots, \
                          int64_t n, int64_t num_segments, const int64_t* offsets, T* out, int threads) {       \
    return pooled_sum<T>(table, num_rows, d, ids, slots, n, num_segments, offsets, out, threads);               \
  }
MESHEMBED_POOLED(float, meshembed_pooled_sum_float32)
MESHEMBED_POOLED(double, meshembed_pooled_sum_float64)

// out[i] = table[ids[i]] widened to float32, for a table of 16-bit patterns (kind 0: bfloat16,
// a shift; kind 1: through `lut`, as meshembed_pooled_sum_16): the gather and the exact widening
// in one pass, without the 16-bit rows. Returns n, -1 if an id is outside [0, num_rows) (out is
// then partly written), -3 for a bad kind / no lut.
extern "C" int64_t meshembed_gather_rows_16(const uint16_t* table, int64_t num_rows, int64_t d, const int64_t* ids,
                                            int64_t n, int kind, const float* lut, float* out, int threads) {
  if (kind != 0 && (kind != 1 || lut == nullptr)) return -3;
  const uint64_t rows = uint64_t(num_rows);
  // threads for at least 16 Ki rows each; chunks of 4 Ki rows, taken by whichever thread is free
  const int workers = int(std::max<int64_t>(1, std::min<int64_t>(threads, n >> 14)));
  const int64_t chunk_rows = 4096, chunks = (n + chunk_rows - 1) / chunk_rows;
  std::atomic<int64_t> bad{0};
  auto chunk = [&](int64_t c) {
    const int64_t lo = c * chunk_rows, hi = std::min(n, lo + chunk_rows);
    for (int64_t i = lo; i < hi; ++i) {
      const uint64_t id = uint64_t(ids[i]);
      if (id >= rows) {
        bad.store(1);
        continue;
      }
      const uint16_t* __restrict row = table + int64_t(id) * d;
      float* __restrict o = out + i * d;
      if (kind == 0) {
        for (int64_t j = 0; j < d; ++j) {
          const uint32_t bits = uint32_t(row[j]) << 16;
          __builtin_memcpy(o + j, &bits, sizeof bits);
        }
      } else {
        for (int64_t j = 0; j < d; ++j) o[j] = lut[row[j]];
      }
    }
  };
  RunChunks(workers, chunks, chunk);
  return bad.load() ? -1 : n;
}

// The pooled sum of a table of 16-bit patterns, each widened to float32 as it is added (kind 0:
// bfloat16; kind 1: through `lut`, the float32 value of each of the 65,536 patterns): the float32
// bits of pooled_sum over the widened rows. Returns as pooled_sum, or -3 for a bad kind / no lut.
extern "C" int64_t meshembed_pooled_sum_16(const uint16_t* table, int64_t num_rows, int64_t d, const int64_t* ids,
                                           const int64_t* slots, int64_t n, int64_t num_segments,
                                           const int64_t* offsets, int kind, const float* lut, float* out,
                                           int threads) {
  return pooled_sum16(table, num_rows, d, ids, slots, n, num_segments, offsets, kind, lut, out, threads);
}
