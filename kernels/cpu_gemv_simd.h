// The bodies of Redline's CPU int8 / int4 kernels, written once for every instruction set: cpu_gemv.cpp includes this
// file three times, each inside its own namespace and `#pragma GCC target` region, with REDLINE_SIMD set to
//   0  portable C++ (one float at a time; any CPU),
//   1  AVX2 + FMA + F16C (8 floats a register),
//   2  AVX-512 F/BW/VL (16 floats a register).
// Only the few helpers below differ between them; the loops are shared, so every path computes the same sums in the
// same order per lane. Activations stay fp32 (no 8-bit rounding of x): the products are the references' to fp32
// rounding, which keeps greedy tokens equal to the dequantized float model's.
//
// Each kernel fills rows [r0, r1) of the output for all M rows of x. A weight row is converted to floats once per
// block of up to 4 rows of x (MB), so a prefill of M rows is a blocked matrix product on the packed weight and a
// decode step (M = 1) a matrix-vector product; x is walked in blocks of X_BLOCK rows to stay in the L2 cache.

// ---------------------------------------------------------------------------------------------------------------------
// The per-instruction-set helpers: a register F of W floats, loads, fused multiply-add, a lane sum, and the byte and
// nibble conversions.

#if REDLINE_SIMD == 2
constexpr int64_t W = 16;
typedef __m512 F;
static inline F fzero() { return _mm512_setzero_ps(); }
static inline F fload(const float* p) { return _mm512_loadu_ps(p); }
static inline F fset(float v) { return _mm512_set1_ps(v); }
static inline F ffma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
static inline F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
static inline F fadd(F a, F b) { return _mm512_add_ps(a, b); }
static inline float fsum(F a) { return _mm512_reduce_add_ps(a); }
// W signed bytes as floats.
static inline F bytes_to_floats(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 packed bytes: the low nibbles (inputs 0, 2, .., 30 of the 32) in lo[0], the high ones (1, 3, .., 31) in hi[0].
static inline void nibbles_to_floats(const uint8_t* p, F* lo, F* hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  lo[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
  hi[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
}
static inline float half_to_float(const at::Half* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

#elif REDLINE_SIMD == 1
constexpr int64_t W = 8;
typedef __m256 F;
static inline F fzero() { return _mm256_setzero_ps(); }
static inline F fload(const float* p) { return _mm256_loadu_ps(p); }
static inline F fset(float v) { return _mm256_set1_ps(v); }
static inline F ffma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
static inline F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
static inline F fadd(F a, F b) { return _mm256_add_ps(a, b); }
static inline float fsum(F a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline F bytes_to_floats(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 16 packed bytes: low nibbles (inputs 0, 2, .., 30) in lo[0..1], high nibbles (1, 3, .., 31) in hi[0..1].
static inline void nibbles_to_floats(const uint8_t* p, F* lo, F* hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i l = _mm_and_si128(b, mask), h = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  lo[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(l));
  lo[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(l, 8)));
  hi[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h));
  hi[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(h, 8)));
}
static inline float half_to_float(const at::Half* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

#else
constexpr int64_t W = 1;
typedef float F;
static inline F fzero() { return 0.f; }
static inline F fload(const float* p) { return *p; }
static inline F fset(float v) { return v; }
static inline F ffma(F a, F b, F c) { return a * b + c; }
static inline F fmul(F a, F b) { return a * b; }
static inline F fadd(F a, F b) { return a + b; }
static inline float fsum(F a) { return a; }
static inline F bytes_to_floats(const int8_t* p) { return static_cast<float>(*p); }
static inline void nibbles_to_floats(const uint8_t* p, F* lo, F* hi) {
  for (int j = 0; j < 16; ++j) {
    lo[j] = static_cast<float>(p[j] & 15);
    hi[j] = static_cast<float>(p[j] >> 4);
  }
}
static inline float half_to_float(const at::Half* p) { return static_cast<float>(*p); }
#endif

// Registers of W floats in 16 nibbles (one packed 16-byte chunk's low or high half).
constexpr int64_t NIBBLE_REGS = 16 / W;
// Independent accumulators per row of x: enough to hide the FMA latency for one row, few enough for four.
template <int MB>
constexpr int ACCS = MB <= 2 ? 4 : 2;

// ---------------------------------------------------------------------------------------------------------------------
// int8 weight, one fp32 scale per output row: y[m, r] = scale[r] * sum_k x[m, k] w[r, k]. Any K (a scalar tail).

static inline F weights_to_floats(const int8_t* p) { return bytes_to_floats(p); }
static inline F weights_to_floats(const float* p) { return fload(p); }

// Also the fp32 weights of a float model (T = float, scale 1): the same loop without the conversion.
template <int MB, typename T>
static inline void int8_row(const float* x, int64_t k, const T* w, float scale, float* y, int64_t ldy) {
  constexpr int A = ACCS<MB>;
  F acc[MB][A];
  for (int i = 0; i < MB; ++i)
    for (int a = 0; a < A; ++a) acc[i][a] = fzero();
  int64_t j = 0;
  for (; j + A * W <= k; j += A * W) {
    for (int a = 0; a < A; ++a) {
      const F wv = weights_to_floats(w + j + a * W);
      for (int i = 0; i < MB; ++i) acc[i][a] = ffma(fload(x + i * k + j + a * W), wv, acc[i][a]);
    }
  }
  for (; j + W <= k; j += W) {
    const F wv = weights_to_floats(w + j);
    for (int i = 0; i < MB; ++i) acc[i][0] = ffma(fload(x + i * k + j), wv, acc[i][0]);
  }
  for (int i = 0; i < MB; ++i) {
    F total = acc[i][0];
    for (int a = 1; a < A; ++a) total = fadd(total, acc[i][a]);
    float sum = fsum(total);
    for (int64_t t = j; t < k; ++t) sum += x[i * k + t] * static_cast<float>(w[t]);
    y[i * ldy] = sum * scale;
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// int8 weight in groups of G inputs, one fp16 scale each (GGUF's Q8_0): y[m, r] = sum_g s[r, g] sum_{k in g} x w.
// Each group's codes are scaled in registers (one multiply a register), then accumulated.

template <int MB>
static inline void int8_group_row(const float* x, int64_t k, const int8_t* w, const at::Half* scales, int64_t group,
                                  float* y, int64_t ldy) {
  constexpr int A = ACCS<MB>;
  F acc[MB][A];
  for (int i = 0; i < MB; ++i)
    for (int a = 0; a < A; ++a) acc[i][a] = fzero();
  for (int64_t g0 = 0; g0 < k; g0 += group) {
    const F s = fset(half_to_float(scales + g0 / group));
    for (int64_t j = g0; j < g0 + group; j += A * W) {
      for (int a = 0; a < A; ++a) {  // a group of fewer than A registers fills the first ones
        if (j + a * W >= g0 + group) break;
        const F wv = fmul(bytes_to_floats(w + j + a * W), s);
        for (int i = 0; i < MB; ++i) acc[i][a] = ffma(fload(x + i * k + j + a * W), wv, acc[i][a]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    F total = acc[i][0];
    for (int b = 1; b < A; ++b) total = fadd(total, acc[i][b]);
    y[i * ldy] = fsum(total);
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// int4, quantize.py's layout: input k of row r in byte k / 2 (even k in the low nibble), w = s * q + o per group of G
// inputs; y[m, r] = sum_g (sum_{k in g} x[m, k] (s q[k])) + o * xsum[m, g]. x comes split into its even and odd
// inputs (even, odd: (M, K/2) each) with its group sums (xsum: (M, K/G)), made once per call.

template <int MB>
static inline void int4_row(const float* even, const float* odd, const float* xsum, int64_t half, int64_t groups,
                            const uint8_t* w, const at::Half* scales, float* y, int64_t ldy) {
  constexpr int A = ACCS<MB>;
  const int64_t half_group = half / groups;
  F acc[MB][A];
  float offsets[MB];
  for (int i = 0; i < MB; ++i) {
    offsets[i] = 0.f;
    for (int a = 0; a < A; ++a) acc[i][a] = fzero();
  }
  F lo[NIBBLE_REGS], hi[NIBBLE_REGS];
  for (int64_t g = 0; g < groups; ++g) {
    const F s = fset(half_to_float(scales + 2 * g));
    const float o = half_to_float(scales + 2 * g + 1);
    for (int i = 0; i < MB; ++i) offsets[i] += o * xsum[i * groups + g];
    for (int64_t j = g * half_group; j < (g + 1) * half_group; j += 16) {
      nibbles_to_floats(w + j, lo, hi);
      for (int64_t v = 0; v < NIBBLE_REGS; ++v) {
        const F wl = fmul(lo[v], s), wh = fmul(hi[v], s);
        // Lanes alternate between accumulators: low nibbles into even ones, high into odd ones (A is even).
        const int al = static_cast<int>((2 * v) % A), ah = static_cast<int>((2 * v + 1) % A);
        for (int i = 0; i < MB; ++i) {
          acc[i][al] = ffma(fload(even + i * half + j + v * W), wl, acc[i][al]);
          acc[i][ah] = ffma(fload(odd + i * half + j + v * W), wh, acc[i][ah]);
        }
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    F total = acc[i][0];
    for (int b = 1; b < A; ++b) total = fadd(total, acc[i][b]);
    y[i * ldy] = fsum(total) + offsets[i];
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// Output rows [r0, r1) for all M rows of x: blocks of X_BLOCK rows of x, then each weight row against up to 4 rows.

constexpr int64_t X_BLOCK = 32;

template <typename RowFn>
static inline void row_blocks(int64_t m, int64_t r0, int64_t r1, const RowFn& row) {
  for (int64_t b0 = 0; b0 < m; b0 += X_BLOCK) {
    const int64_t b1 = b0 + X_BLOCK < m ? b0 + X_BLOCK : m;
    for (int64_t r = r0; r < r1; ++r) {
      int64_t i = b0;
      for (; i + 4 <= b1; i += 4) row(std::integral_constant<int, 4>(), i, r);
      switch (b1 - i) {
        case 3: row(std::integral_constant<int, 3>(), i, r); break;
        case 2: row(std::integral_constant<int, 2>(), i, r); break;
        case 1: row(std::integral_constant<int, 1>(), i, r); break;
        default: break;
      }
    }
  }
}

void int8_rows(const float* x, int64_t m, int64_t k, const int8_t* w, const float* scales, float* y, int64_t n,
               int64_t r0, int64_t r1) {
  row_blocks(m, r0, r1, [&](auto mb, int64_t i, int64_t r) {
    int8_row<decltype(mb)::value>(x + i * k, k, w + r * k, scales[r], y + i * n + r, n);
  });
}

void float_rows(const float* x, int64_t m, int64_t k, const float* w, float* y, int64_t n, int64_t r0, int64_t r1) {
  row_blocks(m, r0, r1, [&](auto mb, int64_t i, int64_t r) {
    int8_row<decltype(mb)::value>(x + i * k, k, w + r * k, 1.f, y + i * n + r, n);
  });
}

void int8_group_rows(const float* x, int64_t m, int64_t k, const int8_t* w, const at::Half* scales, int64_t group,
                     float* y, int64_t n, int64_t r0, int64_t r1) {
  const int64_t groups = k / group;
  row_blocks(m, r0, r1, [&](auto mb, int64_t i, int64_t r) {
    int8_group_row<decltype(mb)::value>(x + i * k, k, w + r * k, scales + r * groups, group, y + i * n + r, n);
  });
}

void int4_rows(const float* even, const float* odd, const float* xsum, int64_t m, int64_t half, int64_t groups,
               const uint8_t* w, const at::Half* scales, float* y, int64_t n, int64_t r0, int64_t r1) {
  row_blocks(m, r0, r1, [&](auto mb, int64_t i, int64_t r) {
    int4_row<decltype(mb)::value>(even + i * half, odd + i * half, xsum + i * groups, half, groups, w + r * half,
                                  scales + r * groups * 2, y + i * n + r, n);
  });
}
