// The bodies of Redline's CPU int8 / int4 kernels, written once for every instruction set: cpu_gemv.cpp includes this
// file once per instruction set the target has, each inside its own namespace (and on x86 its own `#pragma GCC
// target` region), with REDLINE_SIMD set to
//   0  portable C++ (one float at a time; any CPU),
//   1  AVX2 + FMA + F16C (8 floats a register),
//   2  AVX-512 F/BW/VL (16 floats a register),
//   3  ARM NEON (AArch64's Advanced SIMD, 4 floats a register).
// Only the few helpers below differ between them; the loops are shared, so every path computes the same sums in the
// same order per lane. The fp32 kernel keeps x in fp32: its products are the reference's to fp32 rounding. The int8
// and int4 kernels read x as int16 codes per block of 32 inputs (integer multiply-adds on the widened codes, about
// 1.6-2x the fp32 loops' speed on AVX2): half an int16 step of rounding per input, a relative 1.5e-5 of the block's
// largest |x|, about what fp32 sums of a few hundred terms add already; greedy tokens stay the dequantized float
// model's. (The fp32-x loops int8_row and int8_group_row remain for K that is not a multiple of 32, and groups of 16.)
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
static inline float half_to_float(const at::Half* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}
// W fp16 values as floats (exact).
static inline F halves_to_floats(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
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
static inline float half_to_float(const at::Half* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}
static inline F halves_to_floats(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

#elif REDLINE_SIMD == 3
constexpr int64_t W = 4;
typedef float32x4_t F;
static inline F fzero() { return vdupq_n_f32(0.f); }
static inline F fload(const float* p) { return vld1q_f32(p); }
static inline F fset(float v) { return vdupq_n_f32(v); }
static inline F ffma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
static inline F fmul(F a, F b) { return vmulq_f32(a, b); }
static inline F fadd(F a, F b) { return vaddq_f32(a, b); }
static inline float fsum(F a) { return vaddvq_f32(a); }
static inline F bytes_to_floats(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof(four));
  const int16x8_t wide = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)));
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide)));
}
static inline float half_to_float(const at::Half* p) { return static_cast<float>(*p); }
static inline F halves_to_floats(const at::Half* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
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
static inline float half_to_float(const at::Half* p) { return static_cast<float>(*p); }
static inline F halves_to_floats(const at::Half* p) { return static_cast<float>(*p); }
#endif

// Independent accumulators per row of x: enough to hide the FMA latency for one row, few enough for four.
template <int MB>
constexpr int ACCS = MB == 1 ? 8 : MB <= 2 ? 4 : 2;

// ---------------------------------------------------------------------------------------------------------------------
// int8 weight, one fp32 scale per output row: y[m, r] = scale[r] * sum_k x[m, k] w[r, k]. Any K (a scalar tail).

static inline F weights_to_floats(const int8_t* p) { return bytes_to_floats(p); }
static inline F weights_to_floats(const float* p) { return fload(p); }
static inline F weights_to_floats(const at::Half* p) { return halves_to_floats(p); }
// One weight as a float, for the scalar tail; its multiply-adds are fused explicitly (std::fma), so that fp16 and fp32
// weights round alike whatever the compiler contracts.
static inline float weight_value(const int8_t* p) { return static_cast<float>(*p); }
static inline float weight_value(const float* p) { return *p; }
static inline float weight_value(const at::Half* p) { return half_to_float(p); }

// Also the fp32 weights of a float model (T = float, scale 1): the same loop without the conversion; and fp16
// weights that hold a float model's values exactly (T = at::Half, scale 1): the same products and sums in the same
// order, from half the bytes.
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
    for (int64_t t = j; t < k; ++t) sum = std::fma(x[i * k + t], weight_value(w + t), sum);
    y[i * ldy] = sum * scale;
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// int8 weight in groups of G = 2^shift inputs, one scale each: fp16 (GGUF's Q8_0) or fp32 (the exact form of a Q6_K
// table, groups of 16 under d * scale): y[m, r] = sum_g s[r, g] sum_{k in g} x w. A group spans whole registers (G a
// multiple of W); each register's codes are scaled by its group's scale, then accumulated, registers in turn over the
// A accumulators whatever the group size. K is a multiple of G.

static inline float scale_value(const at::Half* p) { return half_to_float(p); }
static inline float scale_value(const float* p) { return *p; }

template <int MB, typename S>
static inline void int8_group_row(const float* x, int64_t k, const int8_t* w, const S* scales, int shift, float* y,
                                  int64_t ldy) {
  constexpr int A = ACCS<MB>;
  F acc[MB][A];
  for (int i = 0; i < MB; ++i)
    for (int a = 0; a < A; ++a) acc[i][a] = fzero();
  int64_t j = 0;
  for (; j + A * W <= k; j += A * W) {
    for (int a = 0; a < A; ++a) {
      const int64_t at = j + a * W;
      const F wv = fmul(bytes_to_floats(w + at), fset(scale_value(scales + (at >> shift))));
      for (int i = 0; i < MB; ++i) acc[i][a] = ffma(fload(x + i * k + at), wv, acc[i][a]);
    }
  }
  for (; j < k; j += W) {
    const F wv = fmul(bytes_to_floats(w + j), fset(scale_value(scales + (j >> shift))));
    for (int i = 0; i < MB; ++i) acc[i][0] = ffma(fload(x + i * k + j), wv, acc[i][0]);
  }
  for (int i = 0; i < MB; ++i) {
    F total = acc[i][0];
    for (int b = 1; b < A; ++b) total = fadd(total, acc[i][b]);
    y[i * ldy] = fsum(total);
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// int4, quantize.py's layout: input k of row r in byte k / 2 (even k in the low nibble), w = s * q + o per group of G
// inputs; y[m, r] = sum_g s[r, g] (sum_{k in g} x[m, k] q[r, k]) + o[r, g] xsum[m, g].
// x comes as int16 codes per block of 32 inputs (xq: (M, K) laid out per block as its 16 even inputs, then its 16
// odd ones, code = round(x / dx[block])) with one fp32 step dx per block (dx: (M, K/32)) and the exact fp32 group
// sums xsum (M, K/G), made once per call. Each block's sum of (q - 8) * code is an exact int32 (|q - 8| <= 8,
// |code| <= 32767, 32 terms); it is scaled by s * dx in fp32, and (o + 8 s) * xsum adds the rest. The codes' rounding
// is the only error beyond fp32 sums: at most half a step (|x| max of the block / 65534) per input.

constexpr int64_t X_BLOCK_INPUTS = 32;

#if REDLINE_SIMD == 1 || REDLINE_SIMD == 2
// AVX2 for both x86 levels (a block is 16 bytes of weights: 32 int16 lanes fill two 256-bit registers).
typedef __m256i Q;
// 16 packed bytes as centred int16 (q - 8): the low nibbles (even inputs) in lo, the high ones (odd inputs) in hi.
static inline void nibbles_to_int16(const uint8_t* p, Q* lo, Q* hi) {
  // One widening of the 16 bytes (byte j in lane j), then each lane's two nibbles apart.
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i eight = _mm256_set1_epi16(8);
  *lo = _mm256_sub_epi16(_mm256_and_si256(b, _mm256_set1_epi16(15)), eight);
  *hi = _mm256_sub_epi16(_mm256_srli_epi16(b, 4), eight);
}
// 32 signed bytes as int16: inputs 0..15 in lo, 16..31 in hi (an int8 weight's block, in input order).
static inline void bytes_to_int16(const int8_t* p, Q* lo, Q* hi) {
  const __m128i* v = reinterpret_cast<const __m128i*>(p);
  *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(v));
  *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(v + 1));
}
// The block's products as 8 int32 partial sums, as fp32 (exact: each below 2^24).
static inline __m256 block_dot(Q lo, Q hi, const int16_t* xq) {
  const __m256i e = _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
  const __m256i o = _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16)));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(e, o));
}
typedef __m256 QF;
static inline QF qf_zero() { return _mm256_setzero_ps(); }
static inline QF qf_fma(QF a, float b, QF c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(b), c); }
static inline float qf_sum(QF a) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}
#elif REDLINE_SIMD == 3
// 16 int16 lanes in two registers.
struct Q {
  int16x8_t v[2];
};
static inline void widen(int8x16_t b, Q* q) {
  q->v[0] = vmovl_s8(vget_low_s8(b));
  q->v[1] = vmovl_s8(vget_high_s8(b));
}
static inline void nibbles_to_int16(const uint8_t* p, Q* lo, Q* hi) {
  const uint8x16_t b = vld1q_u8(p);
  const int8x16_t eight = vdupq_n_s8(8);
  widen(vsubq_s8(vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(15))), eight), lo);
  widen(vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(b, 4)), eight), hi);
}
static inline void bytes_to_int16(const int8_t* p, Q* lo, Q* hi) {
  widen(vld1q_s8(p), lo);
  widen(vld1q_s8(p + 16), hi);
}
// The block's products as 8 int32 partial sums of 4 products each (as on AVX2: exact in fp32, each below 2^24), as
// two registers of floats.
struct QF {
  float32x4_t lo, hi;
};
static inline QF block_dot(const Q& lo, const Q& hi, const int16_t* xq) {
  int32x4_t a = vdupq_n_s32(0), b = vdupq_n_s32(0);
  const int16x8_t* halves[4] = {&lo.v[0], &lo.v[1], &hi.v[0], &hi.v[1]};
  for (int h = 0; h < 4; ++h) {
    const int16x8_t x = vld1q_s16(xq + 8 * h);
    a = vmlal_s16(a, vget_low_s16(*halves[h]), vget_low_s16(x));
    b = vmlal_high_s16(b, *halves[h], x);
  }
  return {vcvtq_f32_s32(a), vcvtq_f32_s32(b)};
}
static inline QF qf_zero() { return {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
static inline QF qf_fma(QF a, float b, QF c) {
  const float32x4_t s = vdupq_n_f32(b);
  return {vfmaq_f32(c.lo, a.lo, s), vfmaq_f32(c.hi, a.hi, s)};
}
static inline float qf_sum(QF a) { return vaddvq_f32(vaddq_f32(a.lo, a.hi)); }
#else
struct Q {
  int16_t v[16];
};
static inline void nibbles_to_int16(const uint8_t* p, Q* lo, Q* hi) {
  for (int j = 0; j < 16; ++j) {
    lo->v[j] = static_cast<int16_t>((p[j] & 15) - 8);
    hi->v[j] = static_cast<int16_t>((p[j] >> 4) - 8);
  }
}
static inline void bytes_to_int16(const int8_t* p, Q* lo, Q* hi) {
  for (int j = 0; j < 16; ++j) {
    lo->v[j] = p[j];
    hi->v[j] = p[16 + j];
  }
}
typedef float QF;
static inline QF block_dot(const Q& lo, const Q& hi, const int16_t* xq) {
  int32_t total = 0;
  for (int j = 0; j < 16; ++j) total += lo.v[j] * xq[j] + hi.v[j] * xq[16 + j];
  return static_cast<float>(total);
}
static inline QF qf_zero() { return 0.f; }
static inline QF qf_fma(QF a, float b, QF c) { return a * b + c; }
static inline float qf_sum(QF a) { return a; }
#endif

// One block b of 32 inputs against every row of x: its int32 sums, scaled by s * dx, into acc (one register a row).
template <int MB>
static inline void int4_block(const int16_t* xq, const float* dx, int64_t k, int64_t blocks, const uint8_t* w,
                              int64_t b, float s, QF* acc) {
  Q lo, hi;
  nibbles_to_int16(w + b * 16, &lo, &hi);
  for (int i = 0; i < MB; ++i)
    acc[i] = qf_fma(block_dot(lo, hi, xq + i * k + b * X_BLOCK_INPUTS), s * dx[i * blocks + b], acc[i]);
}

// Blocks 0..blocks-1 in groups of per_group, consecutive blocks into alternating accumulators (two named register
// sets a row: an index computed at run time would keep them on the stack, each block then waiting for the store of
// the one before). on_group(g) returns group g's scale as its first block comes; on_block(b, s, acc) adds block b.
template <typename OnGroup, typename OnBlock>
static inline void alternate_blocks(int64_t blocks, int64_t per_group, QF* even, QF* odd, const OnGroup& on_group,
                                    const OnBlock& on_block) {
  int64_t g = 0, left = 0;
  float s = 0.f;
  auto next = [&](int64_t b, QF* acc) {
    if (left == 0) {
      s = on_group(g++);
      left = per_group;
    }
    --left;
    on_block(b, s, acc);
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    next(b, even);
    next(b + 1, odd);
  }
  if (b < blocks) next(b, even);
}

template <int MB>
static inline void int4_row(const int16_t* xq, const float* dx, const float* xsum, int64_t k, int64_t groups,
                            const uint8_t* w, const at::Half* scales, float* y, int64_t ldy) {
  const int64_t blocks = k / X_BLOCK_INPUTS;
  QF even[MB], odd[MB];
  float offsets[MB];
  for (int i = 0; i < MB; ++i) {
    offsets[i] = 0.f;
    even[i] = odd[i] = qf_zero();
  }
  alternate_blocks(
      blocks, blocks / groups, even, odd,
      [&](int64_t g) {
        // The codes are centred (q - 8, so the integer sums hold less of the offset's mass): o + 8 s per unit of x.
        const float s = half_to_float(scales + 2 * g), o = half_to_float(scales + 2 * g + 1) + 8.f * s;
        for (int i = 0; i < MB; ++i) offsets[i] += o * xsum[i * groups + g];
        return s;
      },
      [&](int64_t b, float s, QF* acc) { int4_block<MB>(xq, dx, k, blocks, w, b, s, acc); });
  for (int i = 0; i < MB; ++i) y[i * ldy] = qf_sum(even[i]) + qf_sum(odd[i]) + offsets[i];
}

// int8 weight on x's int16 codes (in input order per block of 32, code = round(x / dx[block])): each block's sum of
// w * code is an exact int32 (|w| <= 128, |code| <= 32767, 32 terms), scaled by the block's weight scale times dx
// in fp32. Weight scales: one fp16 per group of G inputs (G a multiple of 32; GGUF's Q8_0 table), or none, the row's
// fp32 scale then multiplying the sum (quantize.py's int8). Error beyond fp32 sums: half a code step per input, as
// int4_row's.
template <int MB>
static inline void int8_code_block(const int16_t* xq, const float* dx, int64_t k, int64_t blocks, const int8_t* w,
                                   int64_t b, float s, QF* acc) {
  Q lo, hi;
  bytes_to_int16(w + b * X_BLOCK_INPUTS, &lo, &hi);
  for (int i = 0; i < MB; ++i)
    acc[i] = qf_fma(block_dot(lo, hi, xq + i * k + b * X_BLOCK_INPUTS), s * dx[i * blocks + b], acc[i]);
}

template <int MB>
static inline void int8_code_row(const int16_t* xq, const float* dx, int64_t k, const int8_t* w,
                                 const at::Half* scales, int64_t blocks_per_group, float row_scale, float* y,
                                 int64_t ldy) {
  const int64_t blocks = k / X_BLOCK_INPUTS;
  QF even[MB], odd[MB];
  for (int i = 0; i < MB; ++i) even[i] = odd[i] = qf_zero();
  alternate_blocks(
      blocks, scales != nullptr ? blocks_per_group : blocks, even, odd,
      [&](int64_t g) { return scales != nullptr ? half_to_float(scales + g) : 1.f; },
      [&](int64_t b, float s, QF* acc) { int8_code_block<MB>(xq, dx, k, blocks, w, b, s, acc); });
  for (int i = 0; i < MB; ++i) y[i * ldy] = (qf_sum(even[i]) + qf_sum(odd[i])) * row_scale;
}

// ---------------------------------------------------------------------------------------------------------------------
// One query head's decode attention over keys [lo, hi] of its KV head: key t's row of D floats starts at
// k + row(t) (and its value at v + row(t)): t * D in a sequence's own cache, the slot of its page in a paged one.
// out = softmax(scale * q k^T) v, fp32 throughout, the keys outside [lo, hi] never read. scores: hi - lo + 1 floats.

static inline float dot_row(const float* a, const float* b, int64_t d) {
  F acc = fzero();
  int64_t j = 0;
  for (; j + W <= d; j += W) acc = ffma(fload(a + j), fload(b + j), acc);
  float sum = fsum(acc);
  for (; j < d; ++j) sum += a[j] * b[j];
  return sum;
}

template <typename Row>
static inline void attention_head(const float* q, const float* k, const float* v, const Row& row, int64_t d,
                                  int64_t lo, int64_t hi, float scale, float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t t = lo; t <= hi; ++t) {
    const float s = scale * dot_row(q, k + row(t), d);
    scores[t - lo] = s;
    top = s > top ? s : top;
  }
  float total = 0.f;
  for (int64_t t = lo; t <= hi; ++t) {
    const float e = std::exp(scores[t - lo] - top);
    scores[t - lo] = e;
    total += e;
  }
  const float inv = 1.f / total;
  int64_t j = 0;
  for (; j + W <= d; j += W) {  // out[j : j + W] = sum_t p_t v[t, j : j + W]
    F acc = fzero();
    for (int64_t t = lo; t <= hi; ++t) acc = ffma(fset(scores[t - lo]), fload(v + row(t) + j), acc);
    float lanes[W];
    std::memcpy(lanes, &acc, sizeof(lanes));
    for (int64_t l = 0; l < W; ++l) out[j + l] = lanes[l] * inv;
  }
  for (; j < d; ++j) {
    float acc = 0.f;
    for (int64_t t = lo; t <= hi; ++t) acc += scores[t - lo] * v[row(t) + j];
    out[j] = acc * inv;
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

// T = float or at::Half (an fp16 weight that holds a float model's values exactly).
template <typename T>
void float_rows(const float* x, int64_t m, int64_t k, const T* w, float* y, int64_t n, int64_t r0, int64_t r1) {
  row_blocks(m, r0, r1, [&](auto mb, int64_t i, int64_t r) {
    int8_row<decltype(mb)::value>(x + i * k, k, w + r * k, 1.f, y + i * n + r, n);
  });
}

// S = at::Half or float: the groups' scales (N, K / 2^shift).
template <typename S>
void int8_group_rows(const float* x, int64_t m, int64_t k, const int8_t* w, const S* scales, int shift, float* y,
                     int64_t n, int64_t r0, int64_t r1) {
  const int64_t groups = k >> shift;
  row_blocks(m, r0, r1, [&](auto mb, int64_t i, int64_t r) {
    int8_group_row<decltype(mb)::value>(x + i * k, k, w + r * k, scales + r * groups, shift, y + i * n + r, n);
  });
}

void int8_code_rows(const int16_t* xq, const float* dx, int64_t m, int64_t k, const int8_t* w,
                    const float* row_scales, const at::Half* group_scales, int64_t group, float* y, int64_t n,
                    int64_t r0, int64_t r1) {
  const int64_t groups = group_scales != nullptr ? k / group : 0;
  row_blocks(m, r0, r1, [&](auto mb, int64_t i, int64_t r) {
    int8_code_row<decltype(mb)::value>(
        xq + i * k, dx + i * (k / X_BLOCK_INPUTS), k, w + r * k,
        group_scales != nullptr ? group_scales + r * groups : nullptr, group / X_BLOCK_INPUTS,
        row_scales != nullptr ? row_scales[r] : 1.f, y + i * n + r, n);
  });
}

void int4_rows(const int16_t* xq, const float* dx, const float* xsum, int64_t m, int64_t k, int64_t groups,
               const uint8_t* w, const at::Half* scales, float* y, int64_t n, int64_t r0, int64_t r1) {
  row_blocks(m, r0, r1, [&](auto mb, int64_t i, int64_t r) {
    int4_row<decltype(mb)::value>(xq + i * k, dx + i * (k / X_BLOCK_INPUTS), xsum + i * groups, k, groups,
                                  w + r * (k / 2), scales + r * groups * 2, y + i * n + r, n);
  });
}
