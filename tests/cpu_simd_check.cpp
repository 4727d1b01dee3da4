// cpu_gemv_simd.h's loops on one instruction set against fp64 sums and against its own portable path, on random odd
// shapes, without torch: tests/test_kernels_cpu_simd_check.py builds this for AArch64 and runs it under qemu (the NEON
// path, which an x86 machine cannot run natively), and natively for the x86 paths (a check of the check).
//
// Build: g++ -O2 -std=c++17 -I kernels -DCHECK_SIMD=<1 AVX2 | 2 AVX-512 | 3 NEON> [-mavx2 -mfma -mf16c ...]
// Prints one line per case, "<case> <largest error relative to the largest |reference|>", and exits 1 when a case
// is off by more than its bound (the kernels' own tolerance: fp32 sums, and x's int16 codes where the case uses them).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

// The one ATen type the loops name: fp16 bits with their conversion to float.
namespace at {
struct Half {
  uint16_t bits;
  operator float() const {
    const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16, exp = (bits >> 10) & 0x1fu, man = bits & 0x3ffu;
    if (exp == 0) {
      const float f = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
      return sign ? -f : f;
    }
    const uint32_t out = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    float f;
    std::memcpy(&f, &out, sizeof(f));
    return f;
  }
};
}  // namespace at

namespace portable {
#define REDLINE_SIMD 0
#include "cpu_gemv_simd.h"
#undef REDLINE_SIMD
}  // namespace portable

namespace checked {
#define REDLINE_SIMD CHECK_SIMD
#include "cpu_gemv_simd.h"
#undef REDLINE_SIMD
}  // namespace checked

namespace {

std::mt19937 rng(7);

std::vector<float> normals(size_t count) {
  std::normal_distribution<float> dist;
  std::vector<float> out(count);
  for (auto& v : out) v = dist(rng);
  return out;
}

int64_t uniform(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }

// fp16 values of magnitude 2^-6 .. 2^3 (random sign and mantissa): exact scales and weights.
std::vector<at::Half> halves(size_t count, int low_exp = 9, int high_exp = 18) {
  std::vector<at::Half> out(count);
  for (auto& h : out) {
    const uint32_t sign = uniform(0, 1), exp = uniform(low_exp, high_exp), man = uniform(0, 1023);
    h.bits = static_cast<uint16_t>((sign << 15) | (exp << 10) | man);
  }
  return out;
}

std::vector<int8_t> bytes(size_t count, int lo, int hi) {
  std::vector<int8_t> out(count);
  for (auto& b : out) b = static_cast<int8_t>(uniform(lo, hi));
  return out;
}

int failures = 0;

// Largest |got - want| over the largest |want|; reports the case and counts it when above bound.
void report(const std::string& name, const std::vector<float>& got, const std::vector<double>& want, double bound) {
  double err = 0.0, top = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(got[i]) - want[i]));
    top = std::max(top, std::fabs(want[i]));
  }
  const double rel = top > 0.0 ? err / top : err;
  const bool ok = rel <= bound && std::isfinite(rel);
  std::printf("%s %.3g%s\n", name.c_str(), rel, ok ? "" : " FAIL");
  failures += !ok;
}

std::vector<double> as_double(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

constexpr double FP32_SUMS = 5e-6;     // fp32 products and sums of up to a few thousand terms
constexpr double PATHS_AGREE = 5e-6;   // two paths: the same sums in another order per lane

// y = x (m, k) @ w (n, k)^T in fp64, with w's row r scaled by row_scale(r) and its element by weight(r, j).
template <typename Weight>
std::vector<double> reference(const std::vector<float>& x, int64_t m, int64_t k, int64_t n, const Weight& weight) {
  std::vector<double> y(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = 0; r < n; ++r) {
      double s = 0.0;
      for (int64_t j = 0; j < k; ++j) s += static_cast<double>(x[i * k + j]) * weight(r, j);
      y[i * n + r] = s;
    }
  return y;
}

void check_int8_and_float(int64_t m, int64_t n, int64_t k) {
  const std::string shape = " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k);
  const auto x = normals(m * k);
  const auto w = bytes(n * k, -128, 127);
  const auto scales = normals(n);
  std::vector<float> y(m * n), base(m * n);
  checked::int8_rows(x.data(), m, k, w.data(), scales.data(), y.data(), n, 0, n);
  portable::int8_rows(x.data(), m, k, w.data(), scales.data(), base.data(), n, 0, n);
  report("int8_rows" + shape, y,
         reference(x, m, k, n, [&](int64_t r, int64_t j) { return static_cast<double>(w[r * k + j]) * scales[r]; }),
         FP32_SUMS);
  report("int8_rows_vs_portable" + shape, y, as_double(base), PATHS_AGREE);

  const auto wf = normals(n * k);
  checked::float_rows(x.data(), m, k, wf.data(), y.data(), n, 0, n);
  report("float_rows_fp32" + shape, y, reference(x, m, k, n, [&](int64_t r, int64_t j) { return wf[r * k + j]; }),
         FP32_SUMS);
  const auto wh = halves(n * k);
  checked::float_rows(x.data(), m, k, wh.data(), y.data(), n, 0, n);
  portable::float_rows(x.data(), m, k, wh.data(), base.data(), n, 0, n);
  report("float_rows_fp16" + shape, y,
         reference(x, m, k, n, [&](int64_t r, int64_t j) { return static_cast<float>(wh[r * k + j]); }), FP32_SUMS);
  report("float_rows_fp16_vs_portable" + shape, y, as_double(base), PATHS_AGREE);
}

template <typename S>
void check_int8_groups(int64_t m, int64_t n, int64_t k, int shift, const std::vector<S>& scales,
                       const std::string& name) {
  const std::string shape = " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k);
  const auto x = normals(m * k);
  const auto w = bytes(n * k, -127, 127);
  const int64_t groups = k >> shift;
  std::vector<float> y(m * n), base(m * n);
  checked::int8_group_rows(x.data(), m, k, w.data(), scales.data(), shift, y.data(), n, 0, n);
  portable::int8_group_rows(x.data(), m, k, w.data(), scales.data(), shift, base.data(), n, 0, n);
  report(name + shape, y, reference(x, m, k, n, [&](int64_t r, int64_t j) {
           return static_cast<double>(w[r * k + j]) * static_cast<float>(scales[r * groups + (j >> shift)]);
         }), FP32_SUMS);
  report(name + "_vs_portable" + shape, y, as_double(base), PATHS_AGREE);
}

// x as the kernels' int16 codes per block of 32 inputs (code * dx[block]) and the x those codes stand for.
struct Codes {
  std::vector<int16_t> xq;   // (m, k); per block in input order, or (nibble_order) its 16 even inputs, then 16 odd
  std::vector<float> dx;     // (m, k / 32)
  std::vector<float> x;      // (m, k): code * dx in input order, exact in fp32
};

Codes random_codes(int64_t m, int64_t k, bool nibble_order) {
  Codes c{std::vector<int16_t>(m * k), std::vector<float>(m * k / 32), std::vector<float>(m * k)};
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < k / 32; ++b) {
      const float dx = std::ldexp(1.f, static_cast<int>(uniform(-16, -12)));  // a power of two: code * dx is exact
      c.dx[i * (k / 32) + b] = dx;
      for (int64_t j = 0; j < 32; ++j) {
        const int16_t code = static_cast<int16_t>(uniform(-32767, 32767));
        const int64_t slot = nibble_order ? (j % 2) * 16 + j / 2 : j;
        c.xq[i * k + b * 32 + slot] = code;
        c.x[i * k + b * 32 + j] = code * dx;
      }
    }
  return c;
}

void check_int8_codes(int64_t m, int64_t n, int64_t k, int64_t group) {
  const std::string shape = " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                            " group=" + std::to_string(group);
  const Codes c = random_codes(m, k, false);
  const auto w = bytes(n * k, -128, 127);
  const auto row_scales = normals(n);
  const auto group_scales = halves(n * (k / group));
  std::vector<float> y(m * n), base(m * n);
  checked::int8_code_rows(c.xq.data(), c.dx.data(), m, k, w.data(), row_scales.data(), nullptr, 0, y.data(), n, 0, n);
  report("int8_code_rows_row_scales" + shape, y, reference(c.x, m, k, n, [&](int64_t r, int64_t j) {
           return static_cast<double>(w[r * k + j]) * row_scales[r];
         }), FP32_SUMS);
  checked::int8_code_rows(c.xq.data(), c.dx.data(), m, k, w.data(), nullptr, group_scales.data(), group, y.data(), n,
                          0, n);
  portable::int8_code_rows(c.xq.data(), c.dx.data(), m, k, w.data(), nullptr, group_scales.data(), group,
                           base.data(), n, 0, n);
  report("int8_code_rows_group_scales" + shape, y, reference(c.x, m, k, n, [&](int64_t r, int64_t j) {
           return static_cast<double>(w[r * k + j]) * static_cast<float>(group_scales[r * (k / group) + j / group]);
         }), FP32_SUMS);
  report("int8_code_rows_vs_portable" + shape, y, as_double(base), PATHS_AGREE);
}

void check_int4(int64_t m, int64_t n, int64_t k, int64_t group) {
  const std::string shape = " m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                            " group=" + std::to_string(group);
  const int64_t groups = k / group;
  const Codes c = random_codes(m, k, true);
  std::vector<float> xsum(m * groups, 0.f);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      double s = 0.0;
      for (int64_t j = 0; j < group; ++j) s += c.x[i * k + g * group + j];
      xsum[i * groups + g] = static_cast<float>(s);
    }
  std::vector<uint8_t> w(n * k / 2);
  for (auto& b : w) b = static_cast<uint8_t>(uniform(0, 255));
  const auto scales = halves(n * groups * 2);  // (scale, offset) per (row, group)
  auto q = [&](int64_t r, int64_t j) { return (w[r * (k / 2) + j / 2] >> (4 * (j % 2))) & 15; };
  std::vector<float> y(m * n), base(m * n);
  checked::int4_rows(c.xq.data(), c.dx.data(), xsum.data(), m, k, groups, w.data(), scales.data(), y.data(), n, 0, n);
  portable::int4_rows(c.xq.data(), c.dx.data(), xsum.data(), m, k, groups, w.data(), scales.data(), base.data(), n, 0,
                      n);
  report("int4_rows" + shape, y, reference(c.x, m, k, n, [&](int64_t r, int64_t j) {
           const int64_t g = j / group;
           return static_cast<double>(static_cast<float>(scales[(r * groups + g) * 2])) * q(r, j) +
                  static_cast<float>(scales[(r * groups + g) * 2 + 1]);
         }), FP32_SUMS);
  report("int4_rows_vs_portable" + shape, y, as_double(base), PATHS_AGREE);
}

void check_attention(int64_t d, int64_t keys) {
  const std::string shape = " d=" + std::to_string(d) + " keys=" + std::to_string(keys);
  const auto q = normals(d), k = normals(keys * d), v = normals(keys * d);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::vector<float> scores(keys), out(d);
  auto row = [d](int64_t t) { return t * d; };
  const int64_t lo = keys / 3, hi = keys - 1;
  checked::attention_head(q.data(), k.data(), v.data(), row, d, lo, hi, scale, scores.data(), out.data());
  std::vector<double> logits, want(d, 0.0);
  double top = -INFINITY, total = 0.0;
  for (int64_t t = lo; t <= hi; ++t) {
    double s = 0.0;
    for (int64_t j = 0; j < d; ++j) s += static_cast<double>(q[j]) * k[t * d + j];
    logits.push_back(s * scale);
    top = std::max(top, logits.back());
  }
  for (auto& l : logits) total += (l = std::exp(l - top));
  for (int64_t t = lo; t <= hi; ++t)
    for (int64_t j = 0; j < d; ++j) want[j] += logits[t - lo] / total * v[t * d + j];
  report("attention_head" + shape, out, want, FP32_SUMS);
}

}  // namespace

int main() {
  for (int trial = 0; trial < 4; ++trial) {
    // m from 1 to 9 covers blocks of 4, 3, 2 and 1 rows of x; k odd and even, below and above a register's width.
    const int64_t m = uniform(1, 9), n = uniform(1, 70);
    check_int8_and_float(m, n, uniform(1, 700));
    check_int8_and_float(m, n, 32 * uniform(1, 20));
    const int64_t k16 = 16 * uniform(1, 40);
    check_int8_groups(m, n, k16, 4, normals(n * (k16 >> 4)), "int8_group_rows_fp32_g16");
    const int64_t k32 = 32 * uniform(1, 40);
    check_int8_groups(m, n, k32, 5, halves(n * (k32 >> 5)), "int8_group_rows_fp16_g32");
    for (const int64_t group : {32, 64, 128}) {
      const int64_t k = group * uniform(1, 8);
      check_int8_codes(m, n, k, group);
      check_int4(m, n, k, group);
    }
    check_attention(8 * uniform(1, 20) + uniform(0, 3), uniform(1, 300));
  }
  std::printf("%s\n", failures ? "FAILED" : "OK");
  return failures ? 1 : 0;
}
