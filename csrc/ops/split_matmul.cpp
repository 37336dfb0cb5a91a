// Native because: it runs inside a CPU kernel call on the autograd device thread, on the per-op
// hot path of backward, and hands work to other threads without the GIL.
//
// [docs:start MATMUL_SPLIT]
// Backward runs on the device's autograd thread, whose kernels run with one OpenMP thread
// (cpu_kernel.cpp, configure_kernel_thread: a second OpenMP team would slow the whole process),
// while the CPU's backward runs on the caller's whole team. So the matrix products of a device
// thread (mm, addmm, bmm: most of the backward time of MLPs and Transformers) are cut into blocks
// of the result (columns, rows or whole matrices), and the device thread computes them together
// with helper threads: as many threads in all as the host thread's intra-op count (at most the
// process's cores), each calling the CPU kernel with one OpenMP thread on its blocks. Blocks are
// taken from a shared counter, so a helper that wakes late takes fewer, and the device thread
// waits only for blocks a helper has started. The helpers are plain threads, not OpenMP threads,
// and run their kernels with one OpenMP thread: no second team exists. Between products they
// sleep (spinning would take the core from the caller's OpenMP worker, which spins there after
// each parallel region). Only products of at least kMinMacs multiply-adds are split, in float32
// and float64, with arguments the CPU kernel takes as they are (no copy of an input, a result of
// the CPU kernel's layout); anything else (and any product on a host thread) runs the CPU kernel
// unsplit.
// OPENREG_AUTOGRAD_SPLIT_MATMUL=0 turns the split off.
// [docs:end MATMUL_SPLIT]
#include "ops/split_matmul.h"

#include "adapters/autograd.h"
#include "ops/cpu_kernel.h"
#include "routes/call_counter.h"
#include "runtime/device.h"

#include <ATen/ATen.h>
#include <ATen/Operators.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define OPENREG_PAUSE() _mm_pause()
#else
#define OPENREG_PAUSE() std::this_thread::yield()
#endif

namespace openreg {
namespace {

constexpr int64_t kMinMacs = int64_t{1} << 20;  // below: the handoff costs more than it saves
constexpr int64_t kMinBlock = 16;                // rows or columns per block, at least

bool enabled_from_env() {
  const char* env = std::getenv("OPENREG_AUTOGRAD_SPLIT_MATMUL");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

std::atomic<bool> g_enabled{enabled_from_env()};
std::atomic<int> g_host_threads{1};
std::atomic<int64_t>& split_calls = call_counter("split.matmul");
std::atomic<int64_t>& helper_blocks = call_counter("split.helper_blocks");

// The cores of the process (not of the calling thread: a device thread may be following a
// caller on one core).
int process_cores() {
  static const int cores = std::max(1, CPU_COUNT(&process_affinity()));
  return cores;
}

// One product: `blocks` blocks, computed by fn(block).
struct Job {
  Job(std::function<void(int64_t)> fn, int64_t blocks, int helpers)
      : fn(std::move(fn)), blocks(blocks), slots(helpers) {}
  const std::function<void(int64_t)> fn;
  const int64_t blocks;
  const at::ThreadLocalState state;  // the device thread's: dispatch keys, grad mode, profiler
  std::atomic<int> slots;            // helpers that may still join (the host's count, less one)
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex error_mutex;
  std::exception_ptr error;

  // Takes blocks until none is left; returns how many it computed.
  int64_t work() {
    int64_t mine = 0;
    for (;;) {
      const int64_t b = next.fetch_add(1, std::memory_order_relaxed);
      if (b >= blocks) return mine;
      try {
        fn(b);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
      }
      ++mine;
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

class Helpers {
 public:
  // Held by the device thread for one product: false when another device thread has the
  // helpers (the product then runs unsplit).
  bool try_lease() {
    bool expected = false;
    return busy_.compare_exchange_strong(expected, true, std::memory_order_acquire);
  }
  void end_lease() { busy_.store(false, std::memory_order_release); }

  // Under a lease: runs `job` on the calling thread and on helper threads (job->slots of them
  // join). False when no helper thread could be started.
  bool run(const std::shared_ptr<Job>& job) {
    {
      std::lock_guard lock(mutex_);
      if (!start(job->slots.load())) return false;
      job_ = job;
      ++generation_;
    }
    cv_.notify_all();
    job->work();
    // Blocks a helper has started: short, since each is a fraction of one product.
    for (int spins = 0; job->done.load(std::memory_order_acquire) < job->blocks; ++spins) {
      if (spins < 4096) OPENREG_PAUSE();
      else std::this_thread::yield();
    }
    {
      std::lock_guard lock(mutex_);
      if (job_ == job) job_.reset();
    }
    if (job->error) std::rethrow_exception(job->error);
    return true;
  }

  // After fork: the child has none of the helper threads.
  void forget_threads() {
    new (&mutex_) std::mutex();
    new (&cv_) std::condition_variable();
    threads_ = 0;
    job_.reset();
    busy_.store(false);
  }

 private:
  bool start(int helpers) {  // under mutex_
    try {
      while (threads_ < helpers) {
        // A new helper serves jobs posted after this one's generation, this job's included.
        std::thread([this, seen = generation_] { loop(seen); }).detach();
        ++threads_;
      }
    } catch (const std::system_error&) {
      return threads_ > 0;  // the helpers there are serve, if any
    }
    return true;
  }

  void loop(uint64_t seen) {
    pthread_setname_np(pthread_self(), "openreg_matmul");
    // Started by a device thread, which may be kept on one core (adapters/autograd.cpp): the
    // helper gets the process's cores. Its kernels run with one OpenMP thread, as the device
    // thread's.
    sched_setaffinity(0, sizeof(cpu_set_t), &process_affinity());
    set_kernel_thread_count(1);
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
      }
      if (job == nullptr || job->slots.fetch_sub(1, std::memory_order_relaxed) <= 0) continue;
      at::ThreadLocalStateGuard state(job->state);
      const int64_t n = job->work();
      if (n > 0) helper_blocks.fetch_add(n, std::memory_order_relaxed);
    }
  }

  std::atomic<bool> busy_{false};
  std::mutex mutex_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;   // under mutex_
  std::shared_ptr<Job> job_;  // under mutex_
  int threads_ = 0;           // under mutex_
};

Helpers& helpers() {
  static auto* h = new Helpers();  // never destroyed: its threads outlive static destruction
  return *h;
}

[[maybe_unused]] const int g_fork_handler =
    pthread_atfork(nullptr, nullptr, [] { helpers().forget_threads(); });

// How many threads a product on this thread may use (1: not split).
int split_threads() {
  if (!g_enabled.load(std::memory_order_relaxed) || g_host_threads.load(std::memory_order_relaxed) < 2)
    return 1;
  thread_local const bool device_thread = is_autograd_worker_thread();
  if (!device_thread) return 1;
  return std::min(g_host_threads.load(std::memory_order_relaxed), process_cores());
}

// A matrix the CPU kernel hands to BLAS as it is: one unit stride, the other at least the
// extent of the first (a view it would copy first is copied by every block: not split).
bool gemm_operand(const at::Tensor& t) {
  const int64_t r = t.dim() - 2, c = t.dim() - 1;
  return (t.stride(c) == 1 && t.stride(r) >= std::max<int64_t>(1, t.size(c))) ||
         (t.stride(r) == 1 && t.stride(c) >= std::max<int64_t>(1, t.size(r)));
}

bool splittable_dtype(const at::Tensor& t) {
  const auto d = t.scalar_type();
  return (d == at::kFloat || d == at::kDouble) && t.layout() == c10::kStrided && !t.is_conj() &&
         !t.is_neg();
}

// Runs block(b) for b in [0, blocks) on `threads` threads (under a lease).
bool run_blocks(int threads, int64_t blocks, std::function<void(int64_t)> block) {
  auto job = std::make_shared<Job>(std::move(block), blocks, threads - 1);
  if (!helpers().run(job)) return false;
  split_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// The helpers for one product, if no other device thread has them.
class Lease {
 public:
  Lease() : held_(helpers().try_lease()) {}
  ~Lease() {
    if (held_) helpers().end_lease();
  }
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  explicit operator bool() const { return held_; }

 private:
  const bool held_;
};

// Blocks of [0, n): two per thread, at least kMinBlock long.
struct Blocks {
  Blocks(int64_t n, int threads) : n(n) {
    size = std::max(kMinBlock, (n + 2 * threads - 1) / (2 * threads));
    count = (n + size - 1) / size;
  }
  int64_t start(int64_t b) const { return b * size; }
  int64_t length(int64_t b) const { return std::min(size, n - b * size); }
  int64_t n, size, count;
};

// out (m x n) = f(a rows or b columns): splits the longer of m and n.
template <class Fn>
bool split_2d(int threads, const at::Tensor& a, const at::Tensor& b, const at::Tensor& out,
              Fn&& product) {
  const int64_t m = a.size(0), n = b.size(1);
  const bool by_columns = n >= m;
  const Blocks blocks(by_columns ? n : m, threads);
  if (blocks.count < 2) return false;
  return run_blocks(threads, blocks.count, [&, by_columns, blocks](int64_t i) {
    const int64_t s = blocks.start(i), len = blocks.length(i);
    if (by_columns) product(out.narrow(1, s, len), a, b.narrow(1, s, len), 1, s, len);
    else product(out.narrow(0, s, len), a.narrow(0, s, len), b, 0, s, len);
  });
}

const c10::DispatchKeySet kCpu(c10::DispatchKey::CPU);

}  // namespace

void note_host_threads(int threads) {
  if (g_host_threads.load(std::memory_order_relaxed) != threads)
    g_host_threads.store(threads, std::memory_order_relaxed);
}

bool matmul_split_enabled() { return g_enabled.load(); }
void set_matmul_split(bool enabled) { g_enabled.store(enabled); }

namespace {

bool mm_args(int threads, const at::Tensor& a, const at::Tensor& b) {
  return threads >= 2 && a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) &&
         a.size(0) * a.size(1) * b.size(1) >= kMinMacs && a.scalar_type() == b.scalar_type() &&
         splittable_dtype(a) && splittable_dtype(b) && gemm_operand(a) && gemm_operand(b);
}

bool bmm_args(int threads, const at::Tensor& a, const at::Tensor& b) {
  return threads >= 2 && a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
         a.size(0) >= 2 && a.size(2) == b.size(1) &&
         a.size(0) * a.size(1) * a.size(2) * b.size(2) >= kMinMacs &&
         a.scalar_type() == b.scalar_type() && splittable_dtype(a) && splittable_dtype(b) &&
         gemm_operand(a) && gemm_operand(b);
}

// self broadcast to the (m, n) result, as the CPU kernel takes it; anything else is its to refuse.
bool addmm_self(const at::Tensor& self, const at::Tensor& a, int64_t m, int64_t n) {
  if (self.scalar_type() != a.scalar_type() || !splittable_dtype(self)) return false;
  return (self.dim() == 1 && (self.size(0) == n || self.size(0) == 1)) ||
         (self.dim() == 2 && (self.size(0) == m || self.size(0) == 1) &&
          (self.size(1) == n || self.size(1) == 1));
}

// An out= argument the blocks can write as they are: the result's shape, contiguous, not
// overlapping an input (the CPU kernel resizes, restrides or refuses anything else).
bool plain_out(const at::Tensor& out, const at::Tensor& like, at::IntArrayRef sizes,
               std::initializer_list<const at::Tensor*> inputs) {
  if (out.scalar_type() != like.scalar_type() || !splittable_dtype(out) ||
      out.sizes() != sizes || !out.is_contiguous())
    return false;
  for (const at::Tensor* t : inputs)
    if (out.storage().is_alias_of(t->storage())) return false;
  return true;
}

bool mm_into(int threads, const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  return split_2d(threads, a, b, out,
                  [](const at::Tensor& o, const at::Tensor& x, const at::Tensor& y, int, int64_t,
                     int64_t) { at::_ops::mm_out::redispatch(kCpu, x, y, const_cast<at::Tensor&>(o)); });
}

bool addmm_into(int threads, const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                const c10::Scalar& beta, const c10::Scalar& alpha, const at::Tensor& out) {
  const at::Tensor bias = self.expand({a.size(0), b.size(1)});
  return split_2d(threads, a, b, out,
                  [&](const at::Tensor& o, const at::Tensor& x, const at::Tensor& y, int dim,
                      int64_t s, int64_t len) {
                    at::_ops::addmm_out::redispatch(kCpu, bias.narrow(dim, s, len), x, y, beta,
                                                    alpha, const_cast<at::Tensor&>(o));
                  });
}

// Blocks of whole matrices: each block's result is contiguous, as the CPU kernel writes it.
bool bmm_into(int threads, const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  const int64_t batch = a.size(0);
  const int64_t per = std::max<int64_t>(1, (batch + 2 * threads - 1) / (2 * threads));
  const int64_t count = (batch + per - 1) / per;
  return run_blocks(threads, count, [&, per](int64_t i) {
    const int64_t s = i * per, len = std::min(per, batch - s);
    at::Tensor o = out.narrow(0, s, len);
    at::_ops::bmm_out::redispatch(kCpu, a.narrow(0, s, len), b.narrow(0, s, len), o);
  });
}

}  // namespace

std::optional<at::Tensor> split_mm(const at::Tensor& a, const at::Tensor& b) {
  const int threads = split_threads();
  if (!mm_args(threads, a, b)) return std::nullopt;
  Lease lease;
  if (!lease) return std::nullopt;
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  if (!mm_into(threads, a, b, out)) return std::nullopt;
  return out;
}

std::optional<at::Tensor> split_addmm(const at::Tensor& self, const at::Tensor& a,
                                      const at::Tensor& b, const c10::Scalar& beta,
                                      const c10::Scalar& alpha) {
  const int threads = split_threads();
  if (!mm_args(threads, a, b) || !addmm_self(self, a, a.size(0), b.size(1))) return std::nullopt;
  Lease lease;
  if (!lease) return std::nullopt;
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  if (!addmm_into(threads, self, a, b, beta, alpha, out)) return std::nullopt;
  return out;
}

std::optional<at::Tensor> split_bmm(const at::Tensor& a, const at::Tensor& b) {
  const int threads = split_threads();
  if (!bmm_args(threads, a, b)) return std::nullopt;
  Lease lease;
  if (!lease) return std::nullopt;
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  if (!bmm_into(threads, a, b, out)) return std::nullopt;
  return out;
}

bool split_mm_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  const int threads = split_threads();
  if (!mm_args(threads, a, b) || !plain_out(out, a, {a.size(0), b.size(1)}, {&a, &b}))
    return false;
  Lease lease;
  return lease && mm_into(threads, a, b, out);
}

bool split_addmm_out(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                     const c10::Scalar& beta, const c10::Scalar& alpha, const at::Tensor& out) {
  const int threads = split_threads();
  if (!mm_args(threads, a, b) || !addmm_self(self, a, a.size(0), b.size(1)) ||
      !plain_out(out, a, {a.size(0), b.size(1)}, {&self, &a, &b}))
    return false;
  Lease lease;
  return lease && addmm_into(threads, self, a, b, beta, alpha, out);
}

bool split_bmm_out(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  const int threads = split_threads();
  if (!bmm_args(threads, a, b) ||
      !plain_out(out, a, {a.size(0), a.size(1), b.size(2)}, {&a, &b}))
    return false;
  Lease lease;
  return lease && bmm_into(threads, a, b, out);
}

}  // namespace openreg
