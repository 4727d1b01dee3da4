// Redline's CPU kernels for int8 and int4 weights: each weight byte is read once per block of up to 4 rows of x and
// widened in registers (no float copy of the weight); its codes multiply x's int16 codes per block of 32 inputs in
// exact integer sums scaled in fp32 (x_codes says how x is rounded). One row of x (decode) is a matrix-vector
// product, many rows (prefill) a blocked matrix product.
//
//   redline_cpu::int8_linear(x (..., K), weight int8 (N, K), scales fp32 (N,)) -> (..., N) in x's dtype
//       y[m, n] = (sum_k x[m, k] * weight[n, k]) * scales[n]   (x in fp32 when K is not a multiple of 32)
//   redline_cpu::int4_linear(x (..., K), weight uint8 (N, K/2), scales fp16 (N, K/G, 2)) -> (..., N)
//       quantize.py's layout: input k of row n in byte k / 2 (even k in the low nibble), w = scale * q + offset
//       per (row, group of G inputs); y[m, n] = sum_g scale sum_{k in g} x[m, k] q[n, k] + offset * sum_{k in g} x,
//       the inner sums on x's int16 codes per block of 32 inputs (exact integer products; cpu_gemv_simd.h)
//   redline_cpu::int8_group_linear(x (..., K), weight int8 (N, K), scales fp16 or fp32 (N, K/G)) -> (..., N)
//       y[m, n] = sum_g scales[n, g] * sum_{k in g} x[m, k] * weight[n, k], G a power of two >= 16 (the exact form
//       of a Q8_0 table, fp16 scales of 32 inputs, on x's int16 codes; of a Q6_K one, fp32 scales of 16, x in fp32)
//   redline_cpu::simd() -> int            the instruction set the kernels run now: 0 portable, 1 AVX2, 2 AVX-512,
//                                         3 NEON
//   redline_cpu::detected_simd() -> int   the best one this CPU has
//   redline_cpu::simd_available(int level) -> bool   whether this CPU runs `level` (the portable one always)
//   redline_cpu::force_simd(int level) -> int   run `level` (-1: the detected one again); returns the previous setting
//
// The loops are in cpu_gemv_simd.h, compiled here once per instruction set and chosen at run time: on x86-64 from the
// CPU's own report (GCC/Clang target pragmas, so one build runs on any x86-64 CPU), on AArch64 NEON (part of the
// architecture); elsewhere only the portable path exists.
//
//   redline_cpu::float_linear(x (..., K), weight fp32 or fp16 (N, K)) -> (..., N)   F.linear on the same loops and
//       threads; an fp16 weight is converted exactly, so it gives the bits its fp32 copy would
//   redline_cpu::decode_attention(q (B, H, 1, D), k, v (B, Hkv, S, D) fp32, input_pos (1,), int window) -> (B, H, 1, D)
//       one token's softmax attention over keys 0..pos of its own cache (the last `window` with window > 0)
//   redline_cpu::paged_decode_attention(q (B, H, D), k, v (pages, page_size, Hkv, D) fp32, block_tables (B, P) int32,
//       seq_lens (B,) int32, float scale, int window) -> (B, H, D)   the same over the batching engine's pages
//   redline_cpu::set_threads(int count) -> int   the kernels' threads (0: torch's intra-op count); returns the previous
//
// Threads: the kernels' own pool (class Pool): the calling thread and its helpers claim blocks of output rows from a
// shared counter until none are left, so a thread that the OS parks (other work on its core) holds up at most the
// block it has claimed, not a fixed share of the matrix. Small products run on the calling thread alone.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define REDLINE_X86 1
#else
#define REDLINE_X86 0
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#define REDLINE_ARM 1
#else
#define REDLINE_ARM 0
#endif

namespace portable {
#define REDLINE_SIMD 0
#include "cpu_gemv_simd.h"
#undef REDLINE_SIMD
}  // namespace portable

#if REDLINE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define REDLINE_SIMD 1
#include "cpu_gemv_simd.h"
#undef REDLINE_SIMD
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace avx512 {
#define REDLINE_SIMD 2
#include "cpu_gemv_simd.h"
#undef REDLINE_SIMD
}  // namespace avx512
#pragma GCC pop_options
#endif

#if REDLINE_ARM
namespace neon {
#define REDLINE_SIMD 3
#include "cpu_gemv_simd.h"
#undef REDLINE_SIMD
}  // namespace neon
#endif

namespace {

enum Simd : int64_t { PORTABLE = 0, AVX2 = 1, AVX512 = 2, NEON = 3 };

int64_t detected_simd() {
#if REDLINE_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  // F16C has no __builtin_cpu_supports name in every GCC: every CPU with AVX2 and FMA that shipped has it.
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return AVX512;
  }
  if (avx2) return AVX2;
#elif REDLINE_ARM
  return NEON;
#endif
  return PORTABLE;
}

// The portable path, and the detected one with every lower x86 level under it.
bool simd_available(int64_t level) {
  const int64_t best = detected_simd();
  return level == PORTABLE || level == best || (best != NEON && level >= PORTABLE && level < best);
}

// -1: the detected instruction set; else the forced one (never above the detected one).
std::atomic<int64_t> forced_simd{-1};

int64_t simd() {
  const int64_t forced = forced_simd.load(std::memory_order_relaxed);
  return forced >= 0 ? forced : detected_simd();
}

int64_t force_simd(int64_t level) {
  TORCH_CHECK(level >= -1 && level <= NEON,
              "force_simd takes -1 (detected), 0 (portable), 1 (AVX2), 2 (AVX-512) or 3 (NEON)");
  TORCH_CHECK(level == -1 || simd_available(level), "this CPU lacks instruction set level ", level, " (its best is ",
              detected_simd(), ")");
  return forced_simd.exchange(level);
}

// Multiply-adds below which a product runs on the calling thread alone (waking helpers costs more).
constexpr int64_t SERIAL_MACS = 1 << 16;
// Weight bytes per claimed block of output rows (and at least two blocks a thread, for balance). With blocks of
// 16 KB, claimed alternately by two threads (each thread's hardware prefetcher likely running on into the other's
// rows), two threads ran the demo's int8 layers slower than one on a 2-core Zen 4 guest (7.3 against 4.4 ms a
// token); 256 KB runs them in 3.4 ms and the int4 ones in 3.7 against 5.3-5.7 (docs/experiments.md).
constexpr int64_t BLOCK_BYTES = 256 << 10;
// Pause instructions a helper spins for a new product before it sleeps (tens of microseconds: the gap between two
// products of one decode step), and the caller before it yields its core while a helper finishes a block.
constexpr int SPIN_PAUSES = 2000;

void cpu_pause() {
#if REDLINE_X86
  _mm_pause();
#elif REDLINE_ARM
  asm volatile("yield" ::: "memory");
#else
  std::this_thread::yield();
#endif
}

// The kernels' own threads: the caller and threads - 1 helpers claim blocks of a product from one counter, and the
// caller waits only for blocks a helper has claimed, never for a helper to wake. A helper the OS keeps off its core
// (another process on it) so costs nothing; with OpenMP's fork-join every parallel region waits for every thread
// to be scheduled, which on shared cores made each small product cost a time slice. Helpers sleep on a condition
// variable after a short spin. One product runs at a time (callers from several threads take turns).
class Pool {
 public:
  // fn(b) for every b in [0, blocks), on `threads` threads (the caller one of them).
  void run(int64_t threads, int64_t blocks, const std::function<void(int64_t)>& fn) {
    if (threads <= 1 || blocks <= 1) {
      for (int64_t b = 0; b < blocks; ++b) fn(b);
      return;
    }
    std::lock_guard<std::mutex> one_at_a_time(run_mutex_);
    ensure_helpers(threads - 1);
    const uint64_t gen = (generation_ + 1) & 0xffffffffu;
    generation_ = gen;
    fn_.store(&fn, std::memory_order_relaxed);
    blocks_.store(blocks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    claim_.store(gen << 32, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      published_.store(gen, std::memory_order_release);
    }
    wake_.notify_all();
    work(gen);
    for (int spins = 0; done_.load(std::memory_order_acquire) < blocks; ++spins) {
      if (spins < SPIN_PAUSES) cpu_pause(); else std::this_thread::yield();
    }
  }

 private:
  // Claims and runs blocks of product `gen` until none is left (or a newer product replaced it).
  void work(uint64_t gen) {
    for (;;) {
      uint64_t v = claim_.load(std::memory_order_acquire);
      if ((v >> 32) != gen || static_cast<int64_t>(v & 0xffffffffu) >= blocks_.load(std::memory_order_relaxed)) return;
      if (!claim_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
      (*fn_.load(std::memory_order_relaxed))(static_cast<int64_t>(v & 0xffffffffu));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void helper() {
    uint64_t seen = published_.load(std::memory_order_acquire);
    for (;;) {
      uint64_t now = seen;
      for (int i = 0; i < SPIN_PAUSES && now == seen; ++i) {
        cpu_pause();
        now = published_.load(std::memory_order_acquire);
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || published_.load(std::memory_order_acquire) != seen; });
        if (stop_) return;
        now = published_.load(std::memory_order_acquire);
      }
      seen = now;
      work(seen);
    }
  }

  void ensure_helpers(int64_t count) {
    if (pid_ != getpid()) {  // a forked child: its parent's helpers do not exist here (left unjoined, never used)
      new std::vector<std::thread>(std::move(helpers_));
      helpers_.clear();
      pid_ = getpid();
    }
    if (static_cast<int64_t>(helpers_.size()) == count) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : helpers_) t.join();
    helpers_.clear();
    stop_ = false;
    for (int64_t i = 0; i < count; ++i) helpers_.emplace_back([this] { helper(); });
  }

  std::mutex run_mutex_, mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> helpers_;
  pid_t pid_ = getpid();
  bool stop_ = false;  // guarded by mutex_
  uint64_t generation_ = 0;  // guarded by run_mutex_
  std::atomic<uint64_t> published_{0}, claim_{0};
  std::atomic<int64_t> blocks_{0}, done_{0};
  std::atomic<const std::function<void(int64_t)>*> fn_{nullptr};
};

// The kernels' thread count: set by set_threads (Redline sets it from --threads), else torch's intra-op threads.
std::atomic<int64_t> kernel_threads{0};

int64_t threads() {
  const int64_t set = kernel_threads.load(std::memory_order_relaxed);
  return set > 0 ? set : at::get_num_threads();
}

int64_t set_threads(int64_t count) {
  TORCH_CHECK(count >= 0, "set_threads takes a positive thread count (0: torch's intra-op threads)");
  return kernel_threads.exchange(count);
}

Pool& pool() {
  static Pool* shared = new Pool();  // never destroyed: its helpers may outlive static destruction at exit
  return *shared;
}

// fn(r0, r1) over [0, n) in blocks of rows claimed by the kernels' threads.
template <typename Fn>
void claimed_rows(int64_t n, int64_t m, int64_t k, int64_t row_bytes, const Fn& fn) {
  const int64_t count = threads();
  if (count <= 1 || n * m * k < SERIAL_MACS) {
    fn(0, n);
    return;
  }
  int64_t block = BLOCK_BYTES / (row_bytes > 0 ? row_bytes : 1);
  block = std::max<int64_t>(4, std::min<int64_t>(block, (n + 2 * count - 1) / (2 * count)));
  const int64_t blocks = (n + block - 1) / block;
  pool().run(count, blocks, [&](int64_t b) { fn(b * block, std::min((b + 1) * block, n)); });
}

void check_x(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, op, ": x must be (..., ", k, "), got ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op, ": x must be a floating tensor");
  TORCH_CHECK(x.is_cpu(), op, " takes CPU tensors");
}

// x as contiguous fp32 (M, K), and the output's shape (..., N).
std::pair<at::Tensor, std::vector<int64_t>> rows_of(const at::Tensor& x, int64_t k, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return {x.reshape({-1, k}).to(at::kFloat).contiguous(), shape};
}

at::Tensor finish(const at::Tensor& out, const at::Tensor& x, const std::vector<int64_t>& shape) {
  return out.view(shape).to(x.scalar_type());
}

// x (M, K) as int16 codes per block of 32 inputs, one step a block (dx: (M, K/32)), code = round(x / step) with
// step = the block's largest |x| / 32767. In input order for int8 weights; for int4 (nibble_order) each block's 16
// even inputs, then its 16 odd ones (one per nibble of a byte).
struct XCodes {
  std::vector<int16_t> xq;
  std::vector<float> dx;
};

XCodes x_codes(const float* xp, int64_t m, int64_t k, bool nibble_order) {
  const int64_t blocks = k / 32;
  XCodes codes{std::vector<int16_t>(m * k), std::vector<float>(m * blocks)};
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = xp + i * k + b * 32;
      float top = 0.f;
      for (int64_t j = 0; j < 32; ++j) top = std::max(top, std::fabs(xb[j]));
      const float inverse = top > 0.f ? 32767.f / top : 0.f;
      codes.dx[i * blocks + b] = top / 32767.f;
      int16_t* qb = codes.xq.data() + i * k + b * 32;
      for (int64_t j = 0; j < 32; ++j) {
        const int64_t slot = nibble_order ? (j % 2) * 16 + j / 2 : j;
        qb[slot] = static_cast<int16_t>(std::nearbyint(xb[j] * inverse));
      }
    }
  }
  return codes;
}

// y (M, N) = x (M, K) times the int8 weight (N, K) on x's int16 codes (int8_code_rows): per-row fp32 scales
// (row_scales) or fp16 scales per group of `group` inputs (group_scales, group a multiple of 32); K a multiple of 32.
void int8_on_codes(const float* xp, int64_t m, int64_t k, const int8_t* wp, const float* row_scales,
                   const at::Half* group_scales, int64_t group, float* yp, int64_t n) {
  const XCodes codes = x_codes(xp, m, k, false);
  const int16_t* qp = codes.xq.data();
  const float* dp = codes.dx.data();
  const int64_t level = simd();
  claimed_rows(n, m, k, k, [&](int64_t r0, int64_t r1) {
#if REDLINE_X86
    if (level == AVX512)
      return avx512::int8_code_rows(qp, dp, m, k, wp, row_scales, group_scales, group, yp, n, r0, r1);
    if (level == AVX2) return avx2::int8_code_rows(qp, dp, m, k, wp, row_scales, group_scales, group, yp, n, r0, r1);
#elif REDLINE_ARM
    if (level == NEON) return neon::int8_code_rows(qp, dp, m, k, wp, row_scales, group_scales, group, yp, n, r0, r1);
#endif
    portable::int8_code_rows(qp, dp, m, k, wp, row_scales, group_scales, group, yp, n, r0, r1);
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() && weight.is_cpu(),
              "int8_linear: weight must be contiguous int8 (N, K) on the CPU");
  const int64_t n = weight.size(0), k = weight.size(1);
  check_x(x, k, "int8_linear");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
              scales.size(0) == n && scales.is_cpu(), "int8_linear: scales must be contiguous fp32 (N,)");
  auto [x2, shape] = rows_of(x, k, n);
  const int64_t m = x2.size(0);
  at::Tensor out = at::empty({m, n}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t level = simd();
  if (m > 0 && k > 0 && k % 32 == 0) {
    int8_on_codes(xp, m, k, wp, sp, nullptr, 0, yp, n);
  } else if (m > 0 && k > 0) {  // any other K: x in fp32
    claimed_rows(n, m, k, k, [&](int64_t r0, int64_t r1) {
#if REDLINE_X86
      if (level == AVX512) return avx512::int8_rows(xp, m, k, wp, sp, yp, n, r0, r1);
      if (level == AVX2) return avx2::int8_rows(xp, m, k, wp, sp, yp, n, r0, r1);
#elif REDLINE_ARM
      if (level == NEON) return neon::int8_rows(xp, m, k, wp, sp, yp, n, r0, r1);
#endif
      portable::int8_rows(xp, m, k, wp, sp, yp, n, r0, r1);
    });
  } else {
    out.zero_();
  }
  return finish(out, x, shape);
}

at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight) {
  const bool half = weight.scalar_type() == at::kHalf;
  TORCH_CHECK(weight.dim() == 2 && (half || weight.scalar_type() == at::kFloat) && weight.is_contiguous() &&
                  weight.is_cpu(),
              "float_linear: weight must be contiguous fp32 or fp16 (N, K) on the CPU");
  const int64_t n = weight.size(0), k = weight.size(1);
  check_x(x, k, "float_linear");
  auto [x2, shape] = rows_of(x, k, n);
  const int64_t m = x2.size(0);
  at::Tensor out = at::empty({m, n}, x2.options());
  const float* xp = x2.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t level = simd();
  // fp16 or fp32 weights: the same loops (cpu_gemv_simd.h's float_rows<T>) over 2 or 4 bytes a weight.
  const auto rows = [&](const auto* wp, int64_t row_bytes) {
    claimed_rows(n, m, k, row_bytes, [&](int64_t r0, int64_t r1) {
#if REDLINE_X86
      if (level == AVX512) return avx512::float_rows(xp, m, k, wp, yp, n, r0, r1);
      if (level == AVX2) return avx2::float_rows(xp, m, k, wp, yp, n, r0, r1);
#elif REDLINE_ARM
      if (level == NEON) return neon::float_rows(xp, m, k, wp, yp, n, r0, r1);
#endif
      portable::float_rows(xp, m, k, wp, yp, n, r0, r1);
    });
  };
  if (m > 0 && k > 0 && half) {
    rows(weight.data_ptr<at::Half>(), 2 * k);
  } else if (m > 0 && k > 0) {
    rows(weight.data_ptr<float>(), 4 * k);
  } else {
    out.zero_();
  }
  return finish(out, x, shape);
}

at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() && weight.is_cpu(),
              "int8_group_linear: weight must be contiguous int8 (N, K) on the CPU");
  const int64_t n = weight.size(0), k = weight.size(1);
  check_x(x, k, "int8_group_linear");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(scales.dim() == 2 && (half || scales.scalar_type() == at::kFloat) && scales.is_contiguous() &&
              scales.is_cpu() && scales.size(0) == n && scales.size(1) > 0 && k % scales.size(1) == 0,
              "int8_group_linear: scales must be contiguous fp16 or fp32 (N, K/G)");
  const int64_t group = k / scales.size(1);
  TORCH_CHECK(group >= 16 && (group & (group - 1)) == 0, "int8_group_linear: the group G = K / scales.size(1) must be "
              "a power of two, at least 16; got ", group);
  int shift = 0;
  while ((int64_t{1} << shift) < group) ++shift;  // group == 2^shift
  auto [x2, shape] = rows_of(x, k, n);
  const int64_t m = x2.size(0);
  at::Tensor out = at::empty({m, n}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  float* yp = out.data_ptr<float>();
  const int64_t level = simd();
  if (m > 0 && half && group % 32 == 0) {
    int8_on_codes(xp, m, k, wp, nullptr, scales.data_ptr<at::Half>(), group, yp, n);
  } else if (m > 0) {  // groups of 16, or fp32 scales: x in fp32
    auto run = [&](auto* sp) {
      claimed_rows(n, m, k, k, [&](int64_t r0, int64_t r1) {
#if REDLINE_X86
        if (level == AVX512) return avx512::int8_group_rows(xp, m, k, wp, sp, shift, yp, n, r0, r1);
        if (level == AVX2) return avx2::int8_group_rows(xp, m, k, wp, sp, shift, yp, n, r0, r1);
#elif REDLINE_ARM
        if (level == NEON) return neon::int8_group_rows(xp, m, k, wp, sp, shift, yp, n, r0, r1);
#endif
        portable::int8_group_rows(xp, m, k, wp, sp, shift, yp, n, r0, r1);
      });
    };
    if (half) {
      run(scales.data_ptr<at::Half>());
    } else {
      run(scales.data_ptr<float>());
    }
  }
  return finish(out, x, shape);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.is_cpu(),
              "int4_linear: weight must be contiguous packed uint8 (N, K/2) on the CPU");
  const int64_t n = weight.size(0), half = weight.size(1), k = 2 * half;
  check_x(x, k, "int4_linear");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.is_cpu() &&
              scales.size(0) == n && scales.size(2) == 2 && scales.size(1) > 0 && k % scales.size(1) == 0 &&
              (k / scales.size(1)) % 32 == 0, "int4_linear: scales must be contiguous fp16 (N, K/G, 2), G a "
              "multiple of 32");
  const int64_t groups = scales.size(1), group = k / groups;
  auto [x2, shape] = rows_of(x, k, n);
  const int64_t m = x2.size(0);
  // x as int16 codes (x_codes, nibble order) and each group's exact sum of x (for the offsets).
  const float* xp = x2.data_ptr<float>();
  const XCodes codes = x_codes(xp, m, k, true);
  std::vector<float> xsum(m * groups);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.f;
      for (int64_t j = g * group; j < (g + 1) * group; ++j) total += xp[i * k + j];
      xsum[i * groups + g] = total;
    }
  }
  at::Tensor out = at::empty({m, n}, x2.options());
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  float* yp = out.data_ptr<float>();
  const int16_t* qp = codes.xq.data();
  const float *dp = codes.dx.data(), *gp = xsum.data();
  const int64_t level = simd();
  if (m > 0) {
    claimed_rows(n, m, k, half, [&](int64_t r0, int64_t r1) {
#if REDLINE_X86
      if (level == AVX512) return avx512::int4_rows(qp, dp, gp, m, k, groups, wp, sp, yp, n, r0, r1);
      if (level == AVX2) return avx2::int4_rows(qp, dp, gp, m, k, groups, wp, sp, yp, n, r0, r1);
#elif REDLINE_ARM
      if (level == NEON) return neon::int4_rows(qp, dp, gp, m, k, groups, wp, sp, yp, n, r0, r1);
#endif
      portable::int4_rows(qp, dp, gp, m, k, groups, wp, sp, yp, n, r0, r1);
    });
  }
  return finish(out, x, shape);
}

// attention_head (cpu_gemv_simd.h) on the instruction set `level`.
template <typename Row>
void attention_head_on(int64_t level, const float* q, const float* k, const float* v, const Row& row, int64_t d,
                       int64_t lo, int64_t hi, float scale, float* scores, float* out) {
#if REDLINE_X86
  if (level == AVX512) return avx512::attention_head(q, k, v, row, d, lo, hi, scale, scores, out);
  if (level == AVX2) return avx2::attention_head(q, k, v, row, d, lo, hi, scale, scores, out);
#elif REDLINE_ARM
  if (level == NEON) return neon::attention_head(q, k, v, row, d, lo, hi, scale, scores, out);
#endif
  portable::attention_head(q, k, v, row, d, lo, hi, scale, scores, out);
}

// Decode attention of one new token per sequence over its own cache: q (B, H, 1, D), k and v (B, Hkv, S, D) fp32 and
// contiguous, head h reading KV head h / (H / Hkv); keys 0..pos (window > 0: the last `window` of them). The heads
// are claimed by the kernels' threads like rows of a product.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& input_pos,
                            int64_t window) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
              q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "decode_attention: q must be (B, H, 1, D) and k, v (B, Hkv, S, D) with H a multiple of Hkv, got ",
              q.sizes(), " and ", k.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              q.is_cpu() && k.is_cpu() && v.is_cpu(), "decode_attention: q, k and v must be fp32 CPU tensors");
  TORCH_CHECK(input_pos.numel() == 1 && !at::isFloatingType(input_pos.scalar_type()),
              "decode_attention: input_pos must hold one integer position");
  TORCH_CHECK(window >= 0, "decode_attention: window must be 0 (none) or a positive number of keys");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(3), kv_heads = k.size(1), seq = k.size(2);
  const int64_t pos = input_pos.item<int64_t>();
  TORCH_CHECK(pos >= 0 && pos < seq, "decode_attention: position ", pos, " is outside the cache's ", seq, " positions");
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor out = at::empty_like(qc);
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const int64_t group = heads / kv_heads, keys = pos - lo + 1, level = simd();
  claimed_rows(batch * heads, 1, 2 * keys * d, 0, [&](int64_t r0, int64_t r1) {
    std::vector<float> scores(keys);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / heads, h = r % heads;
      const int64_t kv = (b * kv_heads + h / group) * seq * d;
      const float *qr = qp + r * d, *kr = kp + kv, *vr = vp + kv;
      attention_head_on(level, qr, kr, vr, [d](int64_t t) { return t * d; }, d, lo, pos, scale, scores.data(),
                        op + r * d);
    }
  });
  return out;
}

// The same over the batching engine's pages: q (B, H, D); k and v (pages, page_size, Hkv, D) fp32 and contiguous;
// row b's keys 0..seq_lens[b]-1 (window > 0: the last `window`) in pages block_tables[b, 0], [b, 1], ... (int32).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(2) == k.size(3) && k.size(2) > 0 &&
              q.size(1) % k.size(2) == 0, "paged_decode_attention: q must be (B, H, D) and k, v (pages, page_size, "
              "Hkv, D) with H a multiple of Hkv, got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              q.is_cpu() && k.is_cpu() && v.is_cpu() && k.is_contiguous() && v.is_contiguous(),
              "paged_decode_attention: q, k and v must be fp32 CPU tensors, the pages contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.dim() == 1 &&
              seq_lens.size(0) == q.size(0) && block_tables.scalar_type() == at::kInt &&
              seq_lens.scalar_type() == at::kInt, "paged_decode_attention: block_tables must be int32 (B, pages) ",
              "and seq_lens int32 (B,)");
  TORCH_CHECK(window >= 0, "paged_decode_attention: window must be 0 (none) or a positive number of keys");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2), page = k.size(1), kv_heads = k.size(2);
  const int64_t pages = k.size(0), width = block_tables.size(1), group = heads / kv_heads, level = simd();
  const at::Tensor qc = q.contiguous(), tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int32_t *tp = tables.data_ptr<int32_t>(), *lp = lens.data_ptr<int32_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * page, "paged_decode_attention: row ", b, " has ", lp[b],
                " keys; its table holds ", width * page);
    for (int64_t p = 0; p < (lp[b] + page - 1) / page; ++p)
      TORCH_CHECK(tp[b * width + p] >= 0 && tp[b * width + p] < pages, "paged_decode_attention: row ", b,
                  " names page ", tp[b * width + p], " of ", pages);
    longest = std::max<int64_t>(longest, lp[b]);
  }
  at::Tensor out = at::empty_like(qc);
  const float *qp = qc.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = kv_heads * d;  // floats from one slot of a page to the next
  claimed_rows(batch * heads, 1, 2 * longest * d, 0, [&](int64_t r0, int64_t r1) {
    std::vector<float> scores(longest);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / heads, h = r % heads, n = lp[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      const int32_t* table = tp + b * width;
      const int64_t head = (h / group) * d;
      auto row = [&](int64_t t) { return (static_cast<int64_t>(table[t / page]) * page + t % page) * stride; };
      attention_head_on(level, qp + r * d, kp + head, vp + head, row, d, lo, n - 1, static_cast<float>(scale),
                        scores.data(), op + r * d);
    }
  });
  return out;
}

at::Tensor paged_decode_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, double, int64_t) {
  return at::empty_symint(q.sym_sizes(), q.options());
}

at::Tensor decode_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  return at::empty_symint(q.sym_sizes(), q.options());
}

// Shapes only, for torch.compile's tracing: symbolic sizes, so a dynamic dimension of x stays dynamic (concrete
// sizes would specialize the compiled graph on every token count).
at::Tensor float_linear_meta(const at::Tensor& x, const at::Tensor& weight) {
  std::vector<c10::SymInt> shape = x.sym_sizes().vec();
  shape.back() = weight.sym_size(0);
  return at::empty_symint(shape, x.options());
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor&) {
  std::vector<c10::SymInt> shape = x.sym_sizes().vec();
  shape.back() = weight.sym_size(0);
  return at::empty_symint(shape, x.options());
}

}  // namespace

TORCH_LIBRARY(redline_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("int8_group_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("float_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor input_pos, int window) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor block_tables, Tensor seq_lens, float scale, "
        "int window) -> Tensor");
  m.def("set_threads(int count) -> int", set_threads);
  m.def("threads() -> int", threads);
  m.def("simd() -> int", simd);
  m.def("detected_simd() -> int", detected_simd);
  m.def("simd_available(int level) -> bool", simd_available);
  m.def("force_simd(int level) -> int", force_simd);
}

TORCH_LIBRARY_IMPL(redline_cpu, CPU, m) {
  m.impl("int8_linear", int8_linear);
  m.impl("int4_linear", int4_linear);
  m.impl("int8_group_linear", int8_group_linear);
  m.impl("float_linear", float_linear);
  m.impl("decode_attention", decode_attention);
  m.impl("paged_decode_attention", paged_decode_attention);
}

TORCH_LIBRARY_IMPL(redline_cpu, Meta, m) {
  m.impl("int8_linear", linear_meta);
  m.impl("int4_linear", linear_meta);
  m.impl("int8_group_linear", linear_meta);
  m.impl("float_linear", float_linear_meta);
  m.impl("decode_attention", decode_attention_meta);
  m.impl("paged_decode_attention", paged_decode_attention_meta);
}
