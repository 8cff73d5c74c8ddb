// One instruction set's paged-attention code. paged_attention_cpu.cpp includes this file four times, each
// inside its own namespace and `#pragma GCC target` region, with W (floats per vector), ROWS_KEY_CHUNK
// (keys per step of the row-vector path, as many as the registers hold) and DOT_ROW_BLOCK (query rows per
// step of the dot-product path, 1 to 4) defined: AVX-512 (W = 16) with and without AVX512-BF16, AVX2 + FMA
// (W = 8) and the baseline ISA (W = 4). It uses GCC vector extensions and builtins, and nothing from a header
// but the intrinsics (under PAGED_AVX512, PAGED_BF16_DOT and PAGED_AVX2), so that no code from a standard
// template gets compiled for a wider ISA than the one it is called on.
//
// Cache layout (HND): [num_blocks, num_kv_heads, block_size, head_dim]; position p of a sequence lives in
// block table[p / block_size] at offset p % block_size. T is float or uint16_t (bfloat16 bits).

typedef float V __attribute__((vector_size(W * 4), aligned(4)));
typedef int VI __attribute__((vector_size(W * 4)));
typedef unsigned VU __attribute__((vector_size(W * 4)));
typedef unsigned short VH __attribute__((vector_size(W * 2), aligned(2)));

// x - 0 is x for every x (0 + x is not, for -0), so this compiles to a bare broadcast, from memory where x is.
static inline V splat(float x) { return x - V{}; }
static inline V load(const float* p) { return *(const V*)p; }
#if defined(PAGED_AVX512)
// GCC splits the generic widening below into 256-bit pieces and inserts; one vpmovzxwd does it.
static inline V load(const unsigned short* p) {
  return (V)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
}
#else
static inline V load(const unsigned short* p) { return (V)(__builtin_convertvector(*(const VH*)p, VU) << 16); }
#endif
static inline void store(float* p, V v) { *(V*)p = v; }
// The bits of bfloat16(v), rounded to nearest even as torch rounds (a NaN becomes the quiet NaN 0x7fc0), in the
// high halves of the lanes.
static inline VU bf16_bits(V v) {
  const VU u = (VU)v;
  const VU rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? VU{} + 0x7fc00000u : rounded;
}
#if defined(PAGED_BF16_DOT)
// bfloat16(v) in one VCVTNEPS2BF16, which rounds to nearest even as torch does but flushes denormals to zero and
// keeps a NaN's sign and payload: a vector holding either (rare) takes the integer rounding instead.
static inline VH to_bf16(V v) {
  if (__builtin_expect(_mm512_fpclass_ps_mask((__m512)v, 0x01 | 0x20 | 0x80) != 0, 0))  // NaN or denormal lanes
    return __builtin_convertvector(bf16_bits(v) >> 16, VH);
  return (VH)_mm512_cvtneps_pbh((__m512)v);
}
#else
static inline VH to_bf16(V v) { return __builtin_convertvector(bf16_bits(v) >> 16, VH); }
#endif
// v rounded to bfloat16, as float32 values whose low halves are zero.
static inline V round_bf16(V v) { return (V)bf16_bits(v); }
static inline void store(unsigned short* p, V v) { *(VH*)p = to_bf16(v); }

#if defined(PAGED_BF16_DOT)
typedef unsigned VUA __attribute__((vector_size(W * 4), aligned(2)));  // bfloat16 pairs at any even address
// acc plus, in lane i, x[2i] * y[2i] + x[2i + 1] * y[2i + 1] for the bfloat16 pairs in the lanes of x and y: the
// products exact, summed in float32 (AVX512-BF16's VDPBF16PS, which counts inputs below 2^-126 as zero).
static inline V dot_pairs(V acc, VU x, VU y) { return (V)_mm512_dpbf16_ps((__m512)acc, (__m512bh)x, (__m512bh)y); }
static inline VU load_pairs(const unsigned short* p) { return (VU)(*(const VUA*)p); }
#endif
// Whether T's scores go through dot_pairs: bfloat16 where it is compiled in.
template <typename T>
constexpr bool pairs_path() {
#if defined(PAGED_BF16_DOT)
  return sizeof(T) == 2;
#else
  return false;
#endif
}
static inline float to_float(float x) { return x; }
static inline float to_float(unsigned short x) {
  unsigned u = (unsigned)x << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
static inline void from_float(float x, float* p) { *p = x; }
static inline void from_float(float x, unsigned short* p) {  // round to nearest even, as torch does
  unsigned u;
  __builtin_memcpy(&u, &x, 4);
  *p = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)0x7fc0 : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline V vmax(V a, V b) { return a > b ? a : b; }
// Horizontal sum and max by halving: log2(W) dependent steps instead of W.
template <int N, typename VV>
static inline float hsum_n(VV v) {
  if constexpr (N == 16)
    return hsum_n<8>(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  else if constexpr (N == 8)
    return hsum_n<4>(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7));
  else {
    VV s = v + __builtin_shufflevector(v, v, 2, 3, 0, 1);
    s = s + __builtin_shufflevector(s, s, 1, 0, 3, 2);
    return s[0];
  }
}
template <int N, typename VV>
static inline float hmax_n(VV v) {
  if constexpr (N == 16) {
    auto lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    auto hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    return hmax_n<8>(lo > hi ? lo : hi);
  } else if constexpr (N == 8) {
    auto lo = __builtin_shufflevector(v, v, 0, 1, 2, 3);
    auto hi = __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return hmax_n<4>(lo > hi ? lo : hi);
  } else {
    VV t = __builtin_shufflevector(v, v, 2, 3, 0, 1);
    VV s = v > t ? v : t;
    t = __builtin_shufflevector(s, s, 1, 0, 3, 2);
    s = s > t ? s : t;
    return s[0];
  }
}
static inline float hsum(V v) { return hsum_n<W>(v); }

// The scores of the dot-product path: vectors of at most 8 lanes (SW).
constexpr int SW = W > 8 ? 8 : W;
typedef float VS __attribute__((vector_size(SW * 4), aligned(4)));
template <typename VV>
static inline VS fold(VV v) {
  if constexpr (sizeof(VV) == 64)
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  else
    return v;
}

// The pair sums of x and y, each 128-bit half on its own: in each half, x's two pairs, then y's. The shuffles
// stay within the halves (one VSHUFPS each with AVX2; shuffles across them are VPERMDs, slower, their index
// vectors taking registers).
template <typename VV>
static inline VV pair_sums(VV x, VV y) {
  if constexpr (sizeof(VV) == 32)
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  else
    return __builtin_shufflevector(x, y, 0, 2, 4, 6) + __builtin_shufflevector(x, y, 1, 3, 5, 7);
}
static inline float hmax(V v) { return hmax_n<W>(v); }

// The exps' steps, one instruction each with AVX-512 (VMAXPS/VMINPS, VRNDSCALEPS, VSCALEFPS) and all but the
// last with AVX2 (VROUNDPS), bit for bit what the generic code gives: max(lo, x) and min(hi, x) keep a NaN x, and
// p * 2^n is exact for the n the exps pass.
#if defined(PAGED_AVX512)
static inline V clamp_below(V x, float lo) { return (V)_mm512_max_ps((__m512)splat(lo), (__m512)x); }
static inline V clamp_above(V x, float hi) { return (V)_mm512_min_ps((__m512)splat(hi), (__m512)x); }
static inline V floor_of(V x) { return (V)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline V nearest_of(V x) {
  return (V)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline V times_pow2(V p, V n) { return (V)_mm512_scalef_ps((__m512)p, (__m512)n); }
#else
#if defined(PAGED_AVX2)
static inline V clamp_below(V x, float lo) { return (V)_mm256_max_ps((__m256)splat(lo), (__m256)x); }
static inline V clamp_above(V x, float hi) { return (V)_mm256_min_ps((__m256)splat(hi), (__m256)x); }
static inline V floor_of(V x) { return (V)_mm256_round_ps((__m256)x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline V nearest_of(V x) { return (V)_mm256_round_ps((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#else
static inline V clamp_below(V x, float lo) { return x < splat(lo) ? splat(lo) : x; }
static inline V clamp_above(V x, float hi) { return x > splat(hi) ? splat(hi) : x; }
static inline V floor_of(V x) {
  const V n = __builtin_convertvector(__builtin_convertvector(x, VI), V);
  return n - __builtin_convertvector(-(x < n), V);  // truncation rounded negatives up
}
static inline V nearest_of(V x) { return (x + 12582912.0f) - 12582912.0f; }  // adding 1.5 x 2^23 drops the fraction
#endif
static inline V times_pow2(V p, V n) { return p * (V)((__builtin_convertvector(n, VI) + 127) << 23); }
#endif

// exp(x) to within 2 ulp for x in [-87, 88] (Cephes' polynomial); exp(-inf) comes out near 1e-38, so
// callers zero masked entries themselves.
static inline V vexp(V x) {
  x = clamp_above(clamp_below(x, -87.0f), 88.0f);
  const V n = floor_of(x * 1.44269504088896341f + 0.5f);
  V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return times_pow2(p, n);
}

// exp(x) for x <= 0 to within 4e-6 relative (7e-7 above -10), in base 2 with a degree-5 polynomial of the
// fraction: cheaper than vexp, for the softmax weights that the bfloat16 pairs round afterwards (both paths use
// it there, so that they agree). Below -87 it gives about 1e-38, as vexp does.
static inline V vexp_nonpositive(V x) {
  const V t = clamp_below(x * 1.44269504088896341f, -126.0f);
  const V n = nearest_of(t);
  const V f = t - n;
  V p = splat(1.3266975e-3f);
  p = p * f + 9.6754646e-3f;
  p = p * f + 5.5507425e-2f;
  p = p * f + 2.4022122e-1f;
  p = p * f + 6.9314694e-1f;
  p = p * f + 1.0000001f;
  return times_pow2(p, n);
}

// tanh(x) to within 2 ulp (Cephes' tanhf): an odd polynomial below |x| = 0.625, where 1 - 2 / (e^2|x| + 1) would
// cancel, that form above it (exp saturates for large |x|, giving +-1).
static inline V vtanh(V x) {
  const V ax = x < 0.f ? -x : x;
  const V z = x * x;
  V p = splat(-5.70498872745e-3f);
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const V small = p * z * x + x;
  const V big = 1.f - 2.f / (vexp(ax + ax) + 1.f);
  return ax > 0.625f ? (x < 0.f ? -big : big) : small;
}

// Scores capped as c * tanh(s / c) (Gemma 2's attention softcapping), -inf (masked) kept.
static inline V soft_cap(V s, float c) { return s == splat(-__builtin_inff()) ? s : c * vtanh(s * (1.f / c)); }

// Brings a K or V row into L2 (see dot_tile).
template <typename T>
static inline void prefetch_row(const T* row, int D) {
  for (int byte = 0; byte < D * (int)sizeof(T); byte += 64) __builtin_prefetch((const char*)row + byte, 0, 2);
}

// Points kp/vp at the K/V rows of positions [j0, j0 + count), walking the block table (one division per chunk,
// not one per key); positions from key_end on point at a row of zeros.
template <typename T>
static inline void chunk_rows(const Args& a, int seq, int kv_head, int j0, int count, int key_end, const T** kp,
                              const T** vp) {
  const T* kc = (const T*)a.key_cache;
  const T* vc = (const T*)a.value_cache;
  const int32_t* table = a.block_tables + (long)seq * a.block_table_stride;
  const long block_stride = (long)a.num_kv_heads * a.block_size * a.head_dim;
  const long head_offset = (long)kv_head * a.block_size * a.head_dim;
  int block = j0 / a.block_size, offset = j0 % a.block_size;
  long base = table[block] * block_stride + head_offset;
  for (int j = 0; j < count; j++) {
    if (j0 + j >= key_end) {
      kp[j] = vp[j] = (const T*)a.zeros;
      continue;
    }
    kp[j] = kc + base + (long)offset * a.head_dim;
    vp[j] = vc + base + (long)offset * a.head_dim;
    if (++offset == a.block_size && j0 + j + 1 < key_end) {
      offset = 0;
      base = table[++block] * block_stride + head_offset;
    }
  }
}

// The first key a query at position pos sees: its window's start (0 without a window).
static inline int first_key(const Args& a, int pos) { return pos - a.window + 1 > 0 ? pos - a.window + 1 : 0; }

// Float32 views of `count` K or V rows for the row-vector path, whose inner loops read single elements:
// bfloat16 rows are converted once, a vector at a time, into buf; float32 rows are used in place. (The
// dot-product path converts as it loads: with few rows, a store and reload would cost more.)
template <typename T>
static inline void float_rows(const T* const* src, int count, int D, float* buf, const float** dst) {
  for (int j = 0; j < count; j++) {
    if constexpr (sizeof(T) == 4) {
      dst[j] = (const float*)src[j];
    } else {
      float* row = buf + j * MAX_HEAD_DIM;
      for (int d = 0; d < D; d += W) store(row + d, load(src[j] + d));
      dst[j] = row;
    }
  }
}

// The online softmax works a tile of KEY_TILE keys at a time: the running max, the rescale of the
// accumulators and their loads and stores are paid once a tile rather than once every few keys.
static_assert(KEY_TILE % W == 0 && KEY_TILE % ROWS_KEY_CHUNK == 0, "a tile is whole vectors and chunks");
// Keys whose scores one step of the dot-product path sums at once, per row, and output vectors it
// accumulates at once, per row: with NR rows (a block of query heads sharing the KV head), NR x KB score
// and NR x PV_VECS output accumulators, plus NR operands, fill the 16 registers of AVX2 at NR = 3, and
// 8 keys at up to 3 rows fill AVX-512's 32.
template <int NR>
constexpr int dot_keys() { return NR == 1 || (W == 16 && NR <= 3) ? SW : 4; }
template <int NR>
constexpr int pv_vecs() { return NR == 1 ? 8 : 4; }

// Lane j (j < KB) of the result is the horizontal sum of p[j] (p is consumed). A 16-lane vector is folded to
// 8 lanes first: the shuffles of the tree then move half the bits. The tree sums within 128-bit halves and
// adds the halves last: key j's sum is ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) of its 8 lanes
// (4 lanes: the first half).
// (VV is VS, a parameter so that the branches not taken, whose shuffles only fit 8 lanes, are not compiled.)
template <typename VV>
static inline VV sum_four_keys(const VV* k) {  // lane j of each half: key j's sum of that half's lanes
  return pair_sums(pair_sums(k[0], k[1]), pair_sums(k[2], k[3]));
}
template <int KB, typename VV = VS>
static inline VV sum_keys(V* p) {
  static_assert(KB == 4 || KB == SW, "four keys or a score vector's lanes of them");
  VV h[KB];
  for (int j = 0; j < KB; j++) h[j] = fold(p[j]);
  const VV a = sum_four_keys(h);
  if constexpr (SW == 4) {
    return a;
  } else if constexpr (KB == 4) {
    return a + __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
  } else {
    const VV b = sum_four_keys(h + 4);
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

#if defined(PAGED_BF16_DOT)
// The dot-product path's accumulators, bfloat16 through dot_pairs, hold head_dim in the order the pairs of
// values come out of vpunpck{l,h}wd: within each 32 positions, 128-bit lane k of the low half holds positions
// 8k to 8k + 3 and of the high half 8k + 4 to 8k + 7. unpair_row scales such a row by inv and stores it in
// head_dim order.
static inline void unpair_row(const float* acc, float inv, int D, unsigned short* dst) {
  const VI first = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  const VI second = first + 8;
  for (int c = 0; c < D; c += 32) {
    const __m512 lo = (__m512)(load(acc + c) * inv), hi = (__m512)(load(acc + c + 16) * inv);
    store(dst + c, (V)_mm512_permutex2var_ps(lo, (__m512i)first, hi));
    store(dst + c + 16, (V)_mm512_permutex2var_ps(lo, (__m512i)second, hi));
  }
}

// acc (NR rows, in unpair_row's order) rescaled by alpha plus the tile's nk softmax weights (pw, rounded to
// bfloat16 already) applied to its values, two keys per dot_pairs: keys 2jp and 2jp + 1 interleaved along
// head_dim, against their weights paired the same way, as apply_value_pairs pairs them for the row-vector
// path (the same arithmetic in the same order). With next_vp, the next tile's values are fetched into L2.
template <int NR>
static inline void apply_value_pairs_dot(int D, int nk, const float (*pw)[KEY_TILE + W], const float* alpha,
                                         const unsigned short* const* vp, const unsigned short* const* next_vp,
                                         float (*acc)[MAX_HEAD_DIM]) {
  constexpr int TK = KEY_TILE, CH = NR <= 2 ? 4 : 2;  // 32-position chunks per pass: 2 x NR x CH accumulators
  const int np = (nk + 1) / 2;
  alignas(64) unsigned wpair[NR][TK / 2];
  for (int r = 0; r < NR; r++)
    for (int jj = 0; jj < TK; jj += 2 * W) {
      const VU x = (VU)load(&pw[r][jj]), y = (VU)load(&pw[r][jj + W]);
      const VU even = __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const VU odd = __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
      *(VU*)&wpair[r][jj / 2] = even >> 16 | (odd & 0xffff0000u);
    }
  for (int c0 = 0; c0 < D; c0 += 32 * CH) {
    const int nc = (D - c0) / 32 < CH ? (D - c0) / 32 : CH;
    __m512 o[NR][CH][2];
    for (int r = 0; r < NR; r++)
      for (int c = 0; c < CH; c++)
        if (c < nc)
          for (int h = 0; h < 2; h++) o[r][c][h] = (__m512)(load(&acc[r][c0 + 32 * c + 16 * h]) * alpha[r]);
    for (int jp = 0; jp < np; jp++) {
      if (next_vp != nullptr && c0 == 0) {
        prefetch_row(next_vp[2 * jp], D);
        prefetch_row(next_vp[2 * jp + 1], D);
      }
      __m512bh w[NR];
      for (int r = 0; r < NR; r++) w[r] = (__m512bh)_mm512_set1_epi32((int)wpair[r][jp]);
      for (int c = 0; c < CH; c++)
        if (c < nc) {
          const __m512i lo = _mm512_loadu_si512(vp[2 * jp] + c0 + 32 * c);
          const __m512i hi = _mm512_loadu_si512(vp[2 * jp + 1] + c0 + 32 * c);
          const __m512bh pl = (__m512bh)_mm512_unpacklo_epi16(lo, hi), ph = (__m512bh)_mm512_unpackhi_epi16(lo, hi);
          for (int r = 0; r < NR; r++) {
            o[r][c][0] = _mm512_dpbf16_ps(o[r][c][0], w[r], pl);
            o[r][c][1] = _mm512_dpbf16_ps(o[r][c][1], w[r], ph);
          }
        }
    }
    for (int r = 0; r < NR; r++)
      for (int c = 0; c < CH; c++)
        if (c < nc)
          for (int h = 0; h < 2; h++) store(&acc[r][c0 + 32 * c + 16 * h], (V)o[r][c][h]);
  }
}
#endif

// One tile of keys for NR query rows at once (qs, acc, m, l and pos point at the block's first row): each
// K and V vector is loaded once for all of them, and their NR softmax chains and accumulator chains are
// independent, so that neither the loads nor one row's latency bound the tile. With `prefetch` (the first
// block of rows over the tile), the next tile's rows (next_kp and next_vp, unless null) are fetched while this
// one's are used: its keys a line per step of the scores, its values a row per key while the values are
// applied. The blocks lie scattered over the pool, so the hardware prefetchers cannot see them coming, and
// only these keep the core's memory requests in flight during the arithmetic. They fetch into L2, not L1: a
// core has few L1 misses in flight, and L1 prefetches left decode waiting on memory (1.5x slower at 64 x 512
// keys, 2x with AVX2). Spread out, rather than a burst of a tile's keys, they gained about 10% more.
// With qb (bfloat16 through dot_pairs, D a multiple of 2W), the scores are those of qb's unscaled rows, scaled
// after the sums; otherwise of qs's, scaled already.
template <typename T, int HEAD_DIM, int NR>
static inline void dot_tile(int D, int j0, int nk, const float (*qs)[MAX_HEAD_DIM],
                            const unsigned short (*qb)[MAX_HEAD_DIM], float scale, float (*acc)[MAX_HEAD_DIM],
                            float* m, float* l, const int* pos, int window, float softcap, const T* const* kp,
                            const T* const* vp,
                            const T* const* next_kp, const T* const* next_vp, bool prefetch) {
  constexpr int TK = KEY_TILE, KB = dot_keys<NR>(), PV = pv_vecs<NR>();
  static_assert(TK % KB == 0, "a tile is whole key groups");
  alignas(64) float pw[NR][TK + W];  // a tile's scores, then its softmax weights (a group's store may spill over)
  for (int jj = 0; jj < TK; jj += KB) {
    V dots[NR][KB];
    for (int r = 0; r < NR; r++)
      for (int j = 0; j < KB; j++) dots[r][j] = V{};
#if defined(PAGED_BF16_DOT)
    if (qb != nullptr) {
      for (int d = 0; d < D; d += 2 * W) {
        if (prefetch && next_kp != nullptr)  // a line of each of the group's next keys per step
          for (int j = jj; j < jj + KB; j++) __builtin_prefetch((const char*)(next_kp[j] + d), 0, 2);
        VU qv[NR];
        for (int r = 0; r < NR; r++) qv[r] = load_pairs(&qb[r][d]);
        for (int j = 0; j < KB; j++) {
          const VU k = load_pairs((const unsigned short*)kp[jj + j] + d);
          for (int r = 0; r < NR; r++) dots[r][j] = dot_pairs(dots[r][j], qv[r], k);
        }
      }
    } else
#endif
    for (int d = 0; d < D; d += W) {
      if (prefetch && next_kp != nullptr && d * (int)sizeof(T) % 64 == 0)  // the same, where a line starts
        for (int j = jj; j < jj + KB; j++) __builtin_prefetch((const char*)(next_kp[j] + d), 0, 2);
      V qv[NR];
      for (int r = 0; r < NR; r++) qv[r] = load(&qs[r][d]);
      for (int j = 0; j < KB; j++) {
        const V k = load(kp[jj + j] + d);
        for (int r = 0; r < NR; r++) dots[r][j] += qv[r] * k;
      }
    }
    VS key_pos = (float)(j0 + jj) - VS{};
    for (int j = 0; j < SW; j++) key_pos[j] += (float)j;
    for (int r = 0; r < NR; r++) {
      VS scores = sum_keys<KB>(dots[r]);
      if (qb != nullptr) scores *= scale;
      const auto hidden = (key_pos > (float)pos[r] - VS{}) | (key_pos <= (float)(pos[r] - window) - VS{});
      *(VS*)&pw[r][jj] = hidden ? -__builtin_inff() - VS{} : scores;
    }
  }
  // The rows' softmax steps interleaved, their chains independent. Only a tile with keys past some row's
  // position, or before some row's window, holds -inf scores to zero; a running max that did not move (a row
  // that saw only hidden keys so far included) rescales nothing.
  const bool masked = j0 + TK - 1 > pos[0] || j0 <= pos[NR - 1] - window;  // (a block's rows are in position order)
  if (softcap > 0.f)
    for (int r = 0; r < NR; r++)
      for (int jj = 0; jj < TK; jj += W) store(&pw[r][jj], soft_cap(load(&pw[r][jj]), softcap));
  float m_new[NR], alpha[NR];
  for (int r = 0; r < NR; r++) {
    V mx = load(&pw[r][0]);
    for (int jj = W; jj < TK; jj += W) mx = vmax(mx, load(&pw[r][jj]));
    const float tile_max = hmax(mx);
    m_new[r] = tile_max > m[r] ? tile_max : m[r];
    alpha[r] = m_new[r] == m[r] ? 1.f : vexp(splat(m[r] - m_new[r]))[0];
  }
  V sum[NR];
  for (int r = 0; r < NR; r++) sum[r] = V{};
  for (int jj = 0; jj < TK; jj += W)
    for (int r = 0; r < NR; r++) {
      V scores = load(&pw[r][jj]);
      V p = pairs_path<T>() ? vexp_nonpositive(scores - m_new[r]) : vexp(scores - m_new[r]);
      if (masked) p = scores == splat(-__builtin_inff()) ? V{} : p;
      sum[r] += p;
      // The weights rounded to bfloat16 as the row-vector path rounds them for dot_pairs: a token's outputs
      // then do not depend on which path served it (a prompt whole, or after a cached prefix).
      store(&pw[r][jj], pairs_path<T>() ? round_bf16(p) : p);
    }
  for (int r = 0; r < NR; r++) {
    l[r] = l[r] * alpha[r] + hsum(sum[r]);
    m[r] = m_new[r];
  }
#if defined(PAGED_BF16_DOT)
  if constexpr (pairs_path<T>())
    if (qb != nullptr) {
      apply_value_pairs_dot<NR>(D, nk, pw, alpha, vp, prefetch ? next_vp : nullptr, acc);
      return;
    }
#endif
  for (int d0 = 0; d0 < D; d0 += PV * W) {
    const int nv = (D - d0) / W < PV ? (D - d0) / W : PV;
    V o[NR][PV];
    for (int r = 0; r < NR; r++)
      for (int v = 0; v < PV; v++)
        if (v < nv) o[r][v] = load(&acc[r][d0 + v * W]) * alpha[r];
    for (int j = 0; j < nk; j++) {
      if (prefetch && next_vp != nullptr && d0 == 0) prefetch_row(next_vp[j], D);
      V w[NR];
      for (int r = 0; r < NR; r++) w[r] = splat(pw[r][j]);
      const T* vr = vp[j] + d0;
      for (int v = 0; v < PV; v++)
        if (v < nv) {
          const V x = load(vr + v * W);
          for (int r = 0; r < NR; r++) o[r][v] += w[r] * x;
        }
    }
    for (int r = 0; r < NR; r++)
      for (int v = 0; v < PV; v++)
        if (v < nv) store(&acc[r][d0 + v * W], o[r][v]);
  }
}

// Few query rows (decodes: one query, the G heads of a KV head): scores are dot products along head_dim,
// summed across lanes. The rows go through each tile in blocks of up to DOT_ROW_BLOCK (dot_tile), so a
// decode's G query heads share every load of the KV head's keys and values; decode is bound by reading
// K/V. An item may serve it.kv_heads consecutive KV heads (the same rows of each): a tile then reads each
// block's heads one after the other, a run of adjacent memory rather than one head's slice of it, which the
// memory system streams faster.
template <typename T, int HEAD_DIM>
static void attend_dot(const Args& a, const WorkItem& it) {
  constexpr int TK = KEY_TILE;
  const int D = HEAD_DIM ? HEAD_DIM : a.head_dim, G = a.num_heads / a.num_kv_heads, s = it.seq;
  const int q0 = a.query_start[s], n = a.query_start[s + 1] - q0, first_pos = a.context_lens[s] - n;
  const T* q = (const T*)a.query;
  // bfloat16 pairs need whole pairs of vectors along head_dim.
  const bool pairs = pairs_path<T>() && D % (2 * W) == 0;
  // Rows of all the item's heads, head by head: row i of head hh is slot hh * rows + i.
  alignas(64) float qs[MAX_DOT_ROWS][MAX_HEAD_DIM];
  alignas(64) unsigned short qb[pairs_path<T>() ? MAX_DOT_ROWS : 1][MAX_HEAD_DIM];
  alignas(64) float acc[MAX_DOT_ROWS][MAX_HEAD_DIM];
  float m[MAX_DOT_ROWS], l[MAX_DOT_ROWS];
  int pos[MAX_DOT_ROWS];
  const int rows = it.rows, heads = it.kv_heads;
  for (int hh = 0; hh < heads; hh++)
    for (int i = 0; i < rows; i++) {
      const int r = hh * rows + i, row = it.row0 + i;
      const T* src = q + (long)(q0 + row / G) * a.query_stride + ((it.kv_head + hh) * G + row % G) * D;
      if (pairs)
        __builtin_memcpy(qb[r], src, D * sizeof(T));
      else
        for (int d = 0; d < D; d++) qs[r][d] = to_float(src[d]) * a.scale;
      for (int d = 0; d < D; d++) acc[r][d] = 0.f;
      m[r] = -__builtin_inff();
      l[r] = 0.f;
      pos[r] = first_pos + row / G;
    }
  // Blocks as even as the block size allows (7 rows: 3, 2, 2).
  const int num_blocks = (rows + DOT_ROW_BLOCK - 1) / DOT_ROW_BLOCK;
  const int key_end = first_pos + (it.row0 + rows - 1) / G + 1;
  const int key_begin = first_key(a, first_pos + it.row0 / G);
  const T* kp[TK];
  const T* vp[TK];
  const T* next_kp[MAX_DOT_ROWS][TK];
  const T* next_vp[MAX_DOT_ROWS][TK];
  for (int hh = 0; hh < heads; hh++) {
    chunk_rows(a, s, it.kv_head + hh, key_begin, TK, key_end, next_kp[hh], next_vp[hh]);
    for (int j = 0; j < TK; j++) {  // the first tile: the item's later tiles are fetched a tile ahead
      prefetch_row(next_kp[hh][j], D);
      prefetch_row(next_vp[hh][j], D);
    }
  }
  for (int j0 = key_begin; j0 < key_end; j0 += TK) {
    const int nk = key_end - j0 < TK ? key_end - j0 : TK;  // keys from nk on read the row of zeros
    const bool more = j0 + TK < key_end;
    for (int hh = 0; hh < heads; hh++) {
      for (int j = 0; j < TK; j++) {
        kp[j] = next_kp[hh][j];
        vp[j] = next_vp[hh][j];
      }
      if (more) chunk_rows(a, s, it.kv_head + hh, j0 + TK, TK, key_end, next_kp[hh], next_vp[hh]);
      for (int b = 0, i0 = 0; b < num_blocks; b++) {
        const int nr = (rows - i0) / (num_blocks - b) + ((rows - i0) % (num_blocks - b) != 0);
        const int r0 = hh * rows + i0;
        const T* const* prefetch_keys = more ? next_kp[hh] : nullptr;
        const T* const* prefetch_values = more ? next_vp[hh] : nullptr;
        const float (*rows_f)[MAX_HEAD_DIM] = pairs ? nullptr : qs + r0;
        const unsigned short (*rows_b)[MAX_HEAD_DIM] = pairs ? qb + r0 : nullptr;
        switch (nr) {
          case 1:
            dot_tile<T, HEAD_DIM, 1>(D, j0, nk, rows_f, rows_b, a.scale, acc + r0, m + r0, l + r0, pos + r0, a.window, a.softcap, kp, vp, prefetch_keys, prefetch_values, b == 0);
            break;
          case 2:
            dot_tile<T, HEAD_DIM, 2>(D, j0, nk, rows_f, rows_b, a.scale, acc + r0, m + r0, l + r0, pos + r0, a.window, a.softcap, kp, vp, prefetch_keys, prefetch_values, b == 0);
            break;
          case 3:
            dot_tile<T, HEAD_DIM, 3>(D, j0, nk, rows_f, rows_b, a.scale, acc + r0, m + r0, l + r0, pos + r0, a.window, a.softcap, kp, vp, prefetch_keys, prefetch_values, b == 0);
            break;
          default:
            if constexpr (DOT_ROW_BLOCK >= 4)
              dot_tile<T, HEAD_DIM, 4>(D, j0, nk, rows_f, rows_b, a.scale, acc + r0, m + r0, l + r0, pos + r0, a.window, a.softcap, kp, vp, prefetch_keys, prefetch_values, b == 0);
        }
        i0 += nr;
      }
    }
  }
  T* out = (T*)a.out;
  for (int hh = 0; hh < heads; hh++)
    for (int i = 0; i < rows; i++) {
      const int r = hh * rows + i, row = it.row0 + i;
      T* dst = out + (long)(q0 + row / G) * a.out_stride + ((it.kv_head + hh) * G + row % G) * D;
      const float inv = 1.f / l[r];
#if defined(PAGED_BF16_DOT)
      if constexpr (pairs_path<T>())
        if (pairs) {
          unpair_row(acc[r], inv, D, (unsigned short*)dst);
          continue;
        }
#endif
      for (int d = 0; d < D; d++) from_float(acc[r][d] * inv, dst + d);
    }
}

// out[jp][d] holds the bfloat16 values of keys 2jp (low half) and 2jp + 1 (high half) at head_dim position d,
// for jp < num_pairs: the pairs dot_pairs takes (an odd tile's last pair gets the row of zeros past its end).
template <typename T>
static inline void value_pairs(const T* const* vp, int num_pairs, int D, unsigned (*out)[MAX_HEAD_DIM]) {
  for (int jp = 0; jp < num_pairs; jp++) {
    const unsigned short* lo = (const unsigned short*)vp[2 * jp];
    const unsigned short* hi = (const unsigned short*)vp[2 * jp + 1];
    int d = 0;
    for (; d + W <= D; d += W)
      *(VU*)&out[jp][d] = __builtin_convertvector(*(const VH*)(lo + d), VU) |
                          __builtin_convertvector(*(const VH*)(hi + d), VU) << 16;
    for (; d < D; d++) out[jp][d] = (unsigned)lo[d] | (unsigned)hi[d] << 16;
  }
}

#if defined(PAGED_BF16_DOT)
// acc (head_dim-major, RV vectors of rows) rescaled by alpha plus the tile's nk softmax weights (pw) applied to
// its values (vpair), two keys per dot_pairs: the weights rounded to bfloat16 and paired (ppair) once a tile,
// then U head_dim positions at a time, U x RV independent accumulators.
template <int RV>
static inline void apply_value_pairs(int D, int nk, const float (*pw)[RV * W], const V* alpha,
                                     const unsigned (*vpair)[MAX_HEAD_DIM], unsigned (*ppair)[RV * W],
                                     float (*acc)[RV * W]) {
  const int np = (nk + 1) / 2;
  for (int jp = 0; jp < np; jp++)
    for (int v = 0; v < RV; v++) {
      const VU lo = bf16_bits(load(&pw[2 * jp][v * W])) >> 16;
      const VU hi = 2 * jp + 1 < nk ? bf16_bits(load(&pw[2 * jp + 1][v * W])) : VU{};
      *(VU*)&ppair[jp][v * W] = lo | hi;
    }
  constexpr int U = 8;
  int d = 0;
  for (; d + U <= D; d += U) {
    V o[U][RV];
    for (int u = 0; u < U; u++)
      for (int v = 0; v < RV; v++) o[u][v] = load(&acc[d + u][v * W]) * alpha[v];
    for (int jp = 0; jp < np; jp++) {
      VU p[RV];
      for (int v = 0; v < RV; v++) p[v] = *(const VU*)&ppair[jp][v * W];
      for (int u = 0; u < U; u++) {
        const VU x = VU{} + vpair[jp][d + u];
        for (int v = 0; v < RV; v++) o[u][v] = dot_pairs(o[u][v], p[v], x);
      }
    }
    for (int u = 0; u < U; u++)
      for (int v = 0; v < RV; v++) store(&acc[d + u][v * W], o[u][v]);
  }
  for (; d < D; d++) {  // head dims that are not a multiple of U
    V o[RV];
    for (int v = 0; v < RV; v++) o[v] = load(&acc[d][v * W]) * alpha[v];
    for (int jp = 0; jp < np; jp++) {
      const VU x = VU{} + vpair[jp][d];
      for (int v = 0; v < RV; v++) o[v] = dot_pairs(o[v], *(const VU*)&ppair[jp][v * W], x);
    }
    for (int v = 0; v < RV; v++) store(&acc[d][v * W], o[v]);
  }
}
#endif

// p[0..W) as a W x W matrix of 32-bit lanes, transposed in place: log2(W) stages, each pairing vectors S apart
// (S = W/2 down to 1) and swapping the lanes whose S bit differs between them.
template <int S, int... L>
struct TransposeStage {
  static inline void apply(V& a, V& b) {
    const V lo = __builtin_shufflevector(a, b, ((L & S) ? L - S + W : L)...);
    const V hi = __builtin_shufflevector(a, b, ((L & S) ? L + W : L + S)...);
    a = lo;
    b = hi;
  }
};
template <int S>
static inline void transpose_square(V* p) {
  if constexpr (S >= 1) {
    for (int i = 0; i < W; i++)
      if (!(i & S)) TransposeStage<S, __integer_pack(W)...>::apply(p[i], p[i | S]);
    transpose_square<S / 2>(p);
  }
}

// Many query rows (prefill chunks): rows are vectorised instead, ROW_VECS * W of them per item, so each key
// element is broadcast against a vector of query rows (a small GEMM with the queries transposed once) and
// the online softmax runs across rows, with no horizontal sums. A tile's scores are computed ROWS_KEY_CHUNK
// keys at a time (as many accumulators as the registers hold), then its weights applied to the values.
template <typename T, int HEAD_DIM>
static void attend_rows(const Args& a, const WorkItem& it) {
  constexpr int RV = ROW_VECS, RT = ROW_VECS * W, KC = ROWS_KEY_CHUNK, TK = KEY_TILE;
  const int D = HEAD_DIM ? HEAD_DIM : a.head_dim, G = a.num_heads / a.num_kv_heads, h = it.kv_head, s = it.seq;
  const int q0 = a.query_start[s], n = a.query_start[s + 1] - q0, first_pos = a.context_lens[s] - n;
  const T* q = (const T*)a.query;
  // bfloat16 through dot_pairs: the queries (unscaled) as pairs along head_dim against the keys as they are,
  // with no float32 copy of K.
  constexpr bool PAIRS = pairs_path<T>();
  alignas(64) float qt[PAIRS ? 1 : MAX_HEAD_DIM][RT];
  alignas(64) unsigned qp[PAIRS ? MAX_HEAD_DIM / 2 : 1][RT];
  alignas(64) float acc[MAX_HEAD_DIM][RT];
  alignas(64) float pw[TK][RT];  // a tile's scores, then its softmax weights
  alignas(64) float posf[RT];
  alignas(64) float lowf[RT];  // each row's last hidden position before its window
  alignas(64) float kbuf[sizeof(T) == 4 || PAIRS ? 1 : TK * MAX_HEAD_DIM];
  alignas(64) float vbuf[sizeof(T) == 4 || PAIRS ? 1 : TK * MAX_HEAD_DIM];
  // With pairs, the values go through dot_pairs too: a tile's V as pairs of consecutive keys along head_dim,
  // against its softmax weights rounded to bfloat16 and paired the same way (as FlashAttention applies bfloat16
  // probabilities to the values), accumulated in float32.
  alignas(64) unsigned vpair[PAIRS ? TK / 2 : 1][PAIRS ? MAX_HEAD_DIM : 1];
  alignas(64) unsigned ppair[PAIRS ? TK / 2 : 1][RT];
  const int rows = it.rows;
  // The queries transposed W rows by W positions at a time (bfloat16 pairs: W pairs, as 32-bit lanes). Padding
  // rows are zeros, see every key (no empty softmax) and are never written.
  const auto query_row = [&](int i) {
    const int row = it.row0 + i;
    return q + (long)(q0 + row / G) * a.query_stride + (h * G + row % G) * D;
  };
  constexpr int STEP = PAIRS ? 2 * W : W;  // head_dim positions a transpose takes
  for (int v = 0; v < RV; v++)
    for (int d0 = 0; d0 + STEP <= D; d0 += STEP) {
      V t[W];
      for (int j = 0; j < W; j++) {
        const int i = v * W + j;
        if (i >= rows)
          t[j] = V{};
        else if constexpr (PAIRS)
          t[j] = *(const V*)(query_row(i) + d0);  // the bits of W pairs
        else
          t[j] = load(query_row(i) + d0) * a.scale;
      }
      transpose_square<W / 2>(t);
      for (int k = 0; k < W; k++) {
        if constexpr (PAIRS)
          store((float*)&qp[d0 / 2 + k][v * W], t[k]);
        else
          store(&qt[d0 + k][v * W], t[k]);
      }
    }
  if constexpr (PAIRS)  // head dims that are not a multiple of 2W (D is a multiple of 16): the last pairs
    for (int d = D / STEP * STEP; d < D; d += 2)
      for (int i = 0; i < RT; i++) {
        unsigned pair = 0;
        if (i < rows) __builtin_memcpy(&pair, query_row(i) + d, 4);
        qp[d / 2][i] = pair;
      }
  for (int i = 0; i < RT; i++) {
    posf[i] = i < rows ? (float)(first_pos + (it.row0 + i) / G) : 3e38f;
    lowf[i] = i < rows ? (float)(first_pos + (it.row0 + i) / G - a.window) : -3e38f;
  }
  for (int d = 0; d < D; d++)
    for (int i = 0; i < RT; i++) acc[d][i] = 0.f;
  V pos[RV], low[RV], m[RV], l[RV];
  for (int v = 0; v < RV; v++) {
    pos[v] = load(&posf[v * W]);
    low[v] = load(&lowf[v * W]);
    m[v] = splat(-__builtin_inff());
    l[v] = V{};
  }
  const int min_pos = first_pos + it.row0 / G;
  const int key_end = first_pos + (it.row0 + rows - 1) / G + 1;
  for (int j0 = first_key(a, min_pos); j0 < key_end; j0 += TK) {
    const int nk = key_end - j0 < TK ? key_end - j0 : TK;  // keys from nk on read the row of zeros
    const int nc = (nk + KC - 1) / KC * KC;  // whole chunks of scores
    const T* kp[TK];
    const T* vp[TK];
    chunk_rows(a, s, h, j0, TK, key_end, kp, vp);
    const float* kf[TK];
    const float* vf[TK];
    if constexpr (PAIRS)
      value_pairs(vp, (nk + 1) / 2, D, vpair);
    else {
      float_rows(kp, nc, D, kbuf, kf);
      float_rows(vp, nk, D, vbuf, vf);
    }
    for (int jc = 0; jc < nc; jc += KC) {
      V sc[KC][RV];
      for (int j = 0; j < KC; j++)
        for (int v = 0; v < RV; v++) sc[j][v] = V{};
#if defined(PAGED_BF16_DOT)
      if constexpr (PAIRS) {
        for (int d = 0; d < D; d += 2) {
          VU qv[RV];
          for (int v = 0; v < RV; v++) qv[v] = *(const VU*)&qp[d / 2][v * W];
          for (int j = 0; j < KC; j++) {
            unsigned pair;
            __builtin_memcpy(&pair, kp[jc + j] + d, 4);
            const VU k = VU{} + pair;
            for (int v = 0; v < RV; v++) sc[j][v] = dot_pairs(sc[j][v], qv[v], k);
          }
        }
        for (int j = 0; j < KC; j++)
          for (int v = 0; v < RV; v++) sc[j][v] *= a.scale;
      } else
#endif
      for (int d = 0; d < D; d++) {
        V qv[RV];
        for (int v = 0; v < RV; v++) qv[v] = load(&qt[d][v * W]);
        for (int j = 0; j < KC; j++) {
          const float k = kf[jc + j][d];
          for (int v = 0; v < RV; v++) sc[j][v] += qv[v] * k;
        }
      }
      for (int j = 0; j < KC; j++)
        for (int v = 0; v < RV; v++) store(&pw[jc + j][v * W], sc[j][v]);
    }
    // Some key of the tile lies after some row's position, or before its window.
    const bool masked = j0 + nk - 1 > min_pos || j0 <= key_end - 1 - a.window;
    V alpha[RV];
    for (int v = 0; v < RV; v++) {
      V m_new = m[v];
      for (int j = 0; j < nk; j++) {
        V score = load(&pw[j][v * W]);
        if (a.softcap > 0.f) score = soft_cap(score, a.softcap);
        if (masked) {
          const V key = splat((float)(j0 + j));
          score = (key > pos[v]) | (key <= low[v]) ? splat(-__builtin_inff()) : score;
        }
        store(&pw[j][v * W], score);
        m_new = vmax(m_new, score);
      }
      alpha[v] = m_new == m[v] ? splat(1.f) : vexp(m[v] - m_new);  // -inf twice: a row with no key seen yet
      V sum = V{};
      for (int j = 0; j < nk; j++) {
        V score = load(&pw[j][v * W]);
        V p = PAIRS ? vexp_nonpositive(score - m_new) : vexp(score - m_new);
        if (masked) p = score == splat(-__builtin_inff()) ? V{} : p;
        store(&pw[j][v * W], p);
        sum += p;
      }
      l[v] = l[v] * alpha[v] + sum;
      m[v] = m_new;
    }
#if defined(PAGED_BF16_DOT)
    if constexpr (PAIRS) {
      apply_value_pairs<RV>(D, nk, pw, alpha, vpair, ppair, acc);
      continue;
    }
#endif
    // Four head_dim positions at a time: 4 x RV independent accumulators, each taking one FMA per key.
    for (int d = 0; d < D; d += 4) {
      V o[4][RV];
      for (int u = 0; u < 4; u++)
        for (int v = 0; v < RV; v++) o[u][v] = load(&acc[d + u][v * W]) * alpha[v];
      for (int j = 0; j < nk; j++) {
        V p[RV];
        for (int v = 0; v < RV; v++) p[v] = load(&pw[j][v * W]);
        for (int u = 0; u < 4; u++) {
          const float val = vf[j][d + u];
          for (int v = 0; v < RV; v++) o[u][v] += p[v] * val;
        }
      }
      for (int u = 0; u < 4; u++)
        for (int v = 0; v < RV; v++) store(&acc[d + u][v * W], o[u][v]);
    }
  }
  alignas(64) float inv[RT];
  for (int v = 0; v < RV; v++) store(&inv[v * W], 1.f / l[v]);
  T* out = (T*)a.out;
  for (int v = 0; v < RV && v * W < rows; v++) {
    const V scale = load(&inv[v * W]);
    for (int d0 = 0; d0 < D; d0 += W) {
      V t[W];
      for (int k = 0; k < W; k++) t[k] = load(&acc[d0 + k][v * W]) * scale;
      transpose_square<W / 2>(t);
      for (int j = 0; j < W && v * W + j < rows; j++) {
        const int row = it.row0 + v * W + j;
        store(out + (long)(q0 + row / G) * a.out_stride + (h * G + row % G) * D + d0, t[j]);
      }
    }
  }
}

// Head dims 64 and 128 get loops of known length (unrolled, the query rows kept in registers).
template <typename T, int HEAD_DIM>
static void run_item(const Args& a, const WorkItem& it) {
  if (it.rows_path)
    attend_rows<T, HEAD_DIM>(a, it);
  else
    attend_dot<T, HEAD_DIM>(a, it);
}

template <typename T>
static void run_item(const Args& a, const WorkItem& it) {
  if (a.head_dim == 64)
    run_item<T, 64>(a, it);
  else if (a.head_dim == 128)
    run_item<T, 128>(a, it);
  else
    run_item<T, 0>(a, it);
}

static void run(const Args& a, const WorkItem& it) {
  if (a.bf16)
    run_item<unsigned short>(a, it);
  else
    run_item<float>(a, it);
}

static inline float round_bf16(float x) {
  unsigned short bits;
  from_float(x, &bits);
  return to_float(bits);
}

// The MLP's SiLU-and-mul, one pass over rows [begin, end) of gu ([T, 2I]: gate, then up): out = gate / (1 +
// exp(-gate)) * up, torch's arithmetic in its order with this file's exp; in bfloat16 the SiLU is rounded before
// the product and the product after it, as torch's two operators round. out may be gu's gate half (each element
// is read before it is written). (It lives here for the vector types and exp of each instruction set.)
template <typename T>
static void silu_mul_rows(const T* gu, long gu_stride, T* out, long out_stride, long begin, long end, int I) {
  constexpr bool BF16 = sizeof(T) == 2;
  for (long t = begin; t < end; t++) {
    const T* g = gu + t * gu_stride;
    const T* u = g + I;
    T* o = out + t * out_stride;
    int i = 0;
    for (; i + W <= I; i += W) {
      const V x = load(g + i);
      V silu = x / (1.f + vexp(-x));
      if constexpr (BF16) silu = round_bf16(silu);
      store(o + i, silu * load(u + i));
    }
    for (; i < I; i++) {
      const float x = to_float(g[i]);
      float silu = x / (1.f + vexp(splat(-x))[0]);
      if constexpr (BF16) silu = round_bf16(silu);
      from_float(silu * to_float(u[i]), o + i);
    }
  }
}

// fused_cpu.cpp's RMSNorm (with its skip connection when residual is given) on bfloat16 rows [begin, end):
// h = residual + x rounded and stored into residual, out = weight * (h * r) with h * r rounded, as torch
// rounds each operator's result; r = 1 / sqrt(mean(h^2) + eps), the sum of squares in float32 lanes. With a
// float32 weight (w32, w null: Gemma's 1 + w) out = (h * r) * w32 rounded once, as Gemma's norm computes it.
static void norm_bf16_rows(unsigned short* out, long os, unsigned short* residual, long rs, const unsigned short* x,
                           long xs, const unsigned short* w, const float* w32, long begin, long end, int H,
                           float eps) {
  for (long t = begin; t < end; t++) {
    const unsigned short* h = x + t * xs;
    if (residual != nullptr) {
      unsigned short* rr = residual + t * rs;
      int i = 0;
      for (; i + W <= H; i += W) store(rr + i, load(rr + i) + load(h + i));
      for (; i < H; i++) from_float(to_float(rr[i]) + to_float(h[i]), rr + i);
      h = rr;
    }
    V squares = V{};
    int i = 0;
    for (; i + W <= H; i += W) {
      const V v = load(h + i);
      squares += v * v;
    }
    float sum = hsum(squares);
    for (; i < H; i++) sum += to_float(h[i]) * to_float(h[i]);
    const float r = 1.f / __builtin_sqrtf(sum / (float)H + eps);
    unsigned short* o = out + t * os;
    if (w32 != nullptr) {
      for (i = 0; i + W <= H; i += W) store(o + i, (load(h + i) * r) * load(w32 + i));
      for (; i < H; i++) from_float((to_float(h[i]) * r) * w32[i], o + i);
      continue;
    }
    for (i = 0; i + W <= H; i += W) store(o + i, load(w + i) * round_bf16(load(h + i) * r));
    for (; i < H; i++) from_float(to_float(w[i]) * round_bf16(to_float(h[i]) * r), o + i);
  }
}

// fused_cpu.cpp's rotary embedding on bfloat16 rows [begin, end) of q and k, in place: x * cos and
// rotate_half(x) * sin each rounded, then their sum, over the first R of each head's D values.
static void rotary_bf16_rows(unsigned short* q, long qs, unsigned short* k, long ks, const unsigned short* cos,
                             const unsigned short* sin, long begin, long end, int hq, int hk, int D, int R) {
  const int half = R / 2;
  for (long t = begin; t < end; t++) {
    const unsigned short* c = cos + t * R;
    const unsigned short* s = sin + t * R;
    for (int h = 0; h < hq + hk; h++) {
      unsigned short* x = h < hq ? q + t * qs + h * D : k + t * ks + (h - hq) * D;
      int i = 0;
      for (; i + W <= half; i += W) {
        const V a = load(x + i), b = load(x + half + i);
        store(x + i, round_bf16(a * load(c + i)) + round_bf16(-b * load(s + i)));
        store(x + half + i, round_bf16(b * load(c + half + i)) + round_bf16(a * load(s + half + i)));
      }
      for (; i < half; i++) {
        const float a = to_float(x[i]), b = to_float(x[i + half]);
        from_float(round_bf16(a * to_float(c[i])) + round_bf16(-b * to_float(s[i])), x + i);
        from_float(round_bf16(b * to_float(c[i + half])) + round_bf16(a * to_float(s[i + half])), x + i + half);
      }
    }
  }
}

// Index of the first largest element of x[0, n), or of the first NaN, as torch's argmax picks it. One pass
// keeps each lane's largest and its first index (a strict > keeps the first of equals); the lanes are then
// merged by value, ties by index. NaNs are only flagged in the pass; a row with one is scanned again.
static long argmax_row(const float* x, long n) {
  long i = 0, best_index = 0;
  float best = -__builtin_inff();
  bool nan = false;
  if (n >= W) {
    V mx = load(x), idx, lane_index;
    for (int j = 0; j < W; j++) lane_index[j] = (float)j;
    idx = lane_index;
    VI seen_nan = mx != mx;
    for (i = W; i + W <= n; i += W) {
      const V v = load(x + i);
      const VI greater = v > mx;
      mx = greater ? v : mx;
      idx = greater ? lane_index + (float)i : idx;  // float holds every index below 2^24 exactly
      seen_nan |= v != v;
    }
    for (int j = 0; j < W; j++) {
      nan |= seen_nan[j] != 0;
      if (mx[j] > best || (mx[j] == best && (long)idx[j] < best_index)) {
        best = mx[j];
        best_index = (long)idx[j];
      }
    }
  }
  for (; i < n; i++) {
    nan |= x[i] != x[i];
    if (x[i] > best) {
      best = x[i];
      best_index = i;
    }
  }
  if (nan)
    for (long j = 0; j < n; j++)
      if (x[j] != x[j]) return j;
  return best_index;
}
