// Redline's CPU matrix-vector kernels for int8 and int4 weights: each weight byte is read once and turned into
// fp32 in registers (no float copy of the weight), products accumulate in fp32 like the references in linear.py.
//
//   redline_cpu::int8_gemv(x fp32 (M, K), weight int8 (N, K), scales fp32 (N,)) -> fp32 (M, N)
//       y[m, n] = (sum_k x[m, k] * weight[n, k]) * scales[n]
//   redline_cpu::int4_gemv(x fp32 (M, K), weight uint8 (N, K/2), scales fp16 (N, K/G, 2)) -> fp32 (M, N)
//       quantize.py's layout: input k of row n in byte k / 2 (even k in the low nibble), w = scale * q + offset
//       per (row, group of G inputs); y[m, n] = sum_g scale * (sum_{k in g} x[m, k] q[n, k]) + offset * sum_{k in g} x[m, k]
//   redline_cpu::int8_group_gemv(x fp32 (M, K), weight int8 (N, K), scales fp16 (N, K/G)) -> fp32 (M, N)
//       y[m, n] = sum_g scales[n, g] * sum_{k in g} x[m, k] * weight[n, k]   (the exact form of a Q8_0 table)
//
// Rows of the weight are split over torch's intra-op threads (at::parallel_for, so torch.set_num_threads sets
// them). The inner loops are written in GCC/Clang vector types, LANES independent fp32 accumulators each.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t LANES = 16;
// Rows of the weight per parallel task: small enough to spread a 576-row matrix over the threads.
constexpr int64_t ROW_GRAIN = 16;

// GCC/Clang vector types: LANES floats, and LANES bytes converted to them lane by lane (one zmm on AVX-512,
// two ymm on AVX2). Bytes go to floats through int32 (to_floats): a direct conversion is scalarized by GCC 12.
typedef float floats __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ints __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint8_t ubytes __attribute__((vector_size(LANES)));

template <typename V, typename T>
V load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// fp16 -> fp32 with the hardware's conversion (vcvtph2ps with F16C) where the compiler has _Float16; at::Half's own
// conversion is a sequence of integer operations, which cost more than a group's products.
float half_to_float(const at::Half* p) {
#if defined(__FLT16_MAX__)
  _Float16 h;
  std::memcpy(&h, p, sizeof(h));
  return static_cast<float>(h);
#else
  return static_cast<float>(*p);
#endif
}

ints to_ints(ubytes bytes) {
  return __builtin_convertvector(bytes, ints);
}

floats to_floats(ubytes bytes) {
  return __builtin_convertvector(to_ints(bytes), floats);
}

float lane_sum(floats acc) {
  float total = 0.f;
  for (int64_t l = 0; l < LANES; ++l) total += acc[l];
  return total;
}

float int8_row_dot(const float* x, const int8_t* w, int64_t k) {
  // The bytes are read unsigned with the sign bit flipped (b ^ 128 = b + 128 in 0..255) and 128 taken off in fp32
  // (exact): GCC 12 scalarizes a signed byte vector's conversion.
  const uint8_t* u = reinterpret_cast<const uint8_t*>(w);
  floats acc = {};
  int64_t i = 0;
  for (; i + LANES <= k; i += LANES) {
    acc += load<floats>(x + i) * (to_floats(load<ubytes>(u + i) ^ 128) - 128.f);
  }
  float total = lane_sum(acc);
  for (; i < k; ++i) total += x[i] * static_cast<float>(w[i]);
  return total;
}

// One group's products, lane by lane: even[j] * low_nibble(w[j]) + odd[j] * high_nibble(w[j]) over half_group bytes
// (a multiple of LANES), summed into LANES lanes (the caller scales them and sums the lanes once per row).
floats int4_group_lanes(const float* even, const float* odd, const uint8_t* w, int64_t half_group) {
  floats acc = {};
  for (int64_t j = 0; j < half_group; j += LANES) {
    const ubytes b = load<ubytes>(w + j);
    acc += load<floats>(even + j) * to_floats(b & 15) + load<floats>(odd + j) * to_floats(b >> 4);
  }
  return acc;
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 (M, K)");
  TORCH_CHECK(x.is_cpu() && weight.is_cpu() && scales.is_cpu(), "redline_cpu ops take CPU tensors");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
              weight.size(1) == x.size(1), "weight must be contiguous int8 (N, K)");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
              scales.size(0) == weight.size(0), "scales must be contiguous fp32 (N,)");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, n, ROW_GRAIN, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      for (int64_t i = 0; i < m; ++i) yp[i * n + r] = int8_row_dot(xp + i * k, wp + r * k, k) * sp[r];
    }
  });
  return out;
}

// int8 codes in groups of `group` inputs, each with its own fp16 scale (GGUF's Q8_0 blocks, for an output head).
at::Tensor int8_group_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 (M, K)");
  TORCH_CHECK(x.is_cpu() && weight.is_cpu() && scales.is_cpu(), "redline_cpu ops take CPU tensors");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() && weight.size(1) == k,
              "weight must be contiguous int8 (N, K)");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
              scales.size(0) == n && scales.size(1) > 0 && k % scales.size(1) == 0 &&
              (k / scales.size(1)) % LANES == 0, "scales must be contiguous fp16 (N, K/G), G a multiple of 16");
  const int64_t groups = scales.size(1), group = k / groups;
  at::Tensor out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(weight.data_ptr<int8_t>());
  const at::Half* sp = scales.data_ptr<at::Half>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, n, ROW_GRAIN, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      for (int64_t i = 0; i < m; ++i) {
        floats lanes = {};
        for (int64_t g = 0; g < groups; ++g) {
          const float* xg = xp + i * k + g * group;
          const uint8_t* wg = wp + r * k + g * group;
          floats acc = {};
          for (int64_t j = 0; j < group; j += LANES) {
            acc += load<floats>(xg + j) * (to_floats(load<ubytes>(wg + j) ^ 128) - 128.f);
          }
          lanes += half_to_float(sp + r * groups + g) * acc;
        }
        yp[i * n + r] = lane_sum(lanes);
      }
    }
  });
  return out;
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 (M, K)");
  TORCH_CHECK(x.is_cpu() && weight.is_cpu() && scales.is_cpu(), "redline_cpu ops take CPU tensors");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
              weight.size(1) * 2 == k, "weight must be contiguous packed uint8 (N, K/2)");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
              scales.size(0) == n && scales.size(2) == 2 && scales.size(1) > 0 && k % scales.size(1) == 0,
              "scales must be contiguous fp16 (N, K/G, 2)");
  const int64_t groups = scales.size(1), group = k / groups, half_group = group / 2, half = k / 2;
  TORCH_CHECK(half_group % LANES == 0, "the group size must be a multiple of ", 2 * LANES);
  // x split into its even and odd inputs (one per nibble), and each group's sum of x (for the offsets).
  std::vector<float> even(m * half), odd(m * half), group_sums(m * groups, 0.f);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < half; ++j) {
      even[i * half + j] = xp[i * k + 2 * j];
      odd[i * half + j] = xp[i * k + 2 * j + 1];
    }
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.f;
      for (int64_t j = g * group; j < (g + 1) * group; ++j) total += xp[i * k + j];
      group_sums[i * groups + g] = total;
    }
  }
  at::Tensor out = at::empty({m, n}, x.options());
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, n, ROW_GRAIN, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      const uint8_t* row = wp + r * half;
      const at::Half* row_scales = sp + r * groups * 2;
      for (int64_t i = 0; i < m; ++i) {
        floats lanes = {};
        float offsets = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t base = i * half + g * half_group;
          lanes += half_to_float(row_scales + 2 * g) *
                   int4_group_lanes(even.data() + base, odd.data() + base, row + g * half_group, half_group);
          offsets += half_to_float(row_scales + 2 * g + 1) * group_sums[i * groups + g];
        }
        yp[i * n + r] = lane_sum(lanes) + offsets;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(redline_cpu, m) {
  m.def("int8_gemv(Tensor x, Tensor weight, Tensor scales) -> Tensor", int8_gemv);
  m.def("int4_gemv(Tensor x, Tensor weight, Tensor scales) -> Tensor", int4_gemv);
  m.def("int8_group_gemv(Tensor x, Tensor weight, Tensor scales) -> Tensor", int8_group_gemv);
}
