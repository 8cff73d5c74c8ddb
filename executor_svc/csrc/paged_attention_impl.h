// One instruction set's paged-attention code. paged_attention_cpu.cpp includes this file three times, each
// inside its own namespace and `#pragma GCC target` region, with W (floats per vector) defined: AVX-512
// (W = 16), AVX2 + FMA (W = 8) and the baseline ISA (W = 4). It uses GCC vector extensions and builtins only, and nothing from a header, so that no code from a
// standard template gets compiled for a wider ISA than the one it is called on.
//
// Cache layout (HND): [num_blocks, num_kv_heads, block_size, head_dim]; position p of a sequence lives in
// block table[p / block_size] at offset p % block_size. T is float or uint16_t (bfloat16 bits).

typedef float V __attribute__((vector_size(W * 4), aligned(4)));
typedef int VI __attribute__((vector_size(W * 4)));
typedef unsigned VU __attribute__((vector_size(W * 4)));
typedef unsigned short VH __attribute__((vector_size(W * 2), aligned(2)));

static inline V splat(float x) { return V{} + x; }
static inline V load(const float* p) { return *(const V*)p; }
static inline V load(const unsigned short* p) { return (V)(__builtin_convertvector(*(const VH*)p, VU) << 16); }
static inline void store(float* p, V v) { *(V*)p = v; }
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
static inline float hsum(V v) {
  float s = 0.f;
  for (int i = 0; i < W; i++) s += v[i];
  return s;
}
static inline float hmax(V v) {
  float m = v[0];
  for (int i = 1; i < W; i++) m = v[i] > m ? v[i] : m;
  return m;
}

// exp(x) to within 2 ulp for x in [-87, 88] (Cephes' polynomial); exp(-inf) comes out near 1e-38, so
// callers zero masked entries themselves.
static inline V vexp(V x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  V fx = x * 1.44269504088896341f + 0.5f;
  V n = __builtin_convertvector(__builtin_convertvector(fx, VI), V);
  n = n - __builtin_convertvector(-(fx < n), V);  // truncation rounded negatives up: floor
  V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  VI e = (__builtin_convertvector(n, VI) + 127) << 23;
  return p * (V)e;
}

template <typename T>
static inline const T* key_row(const T* cache, const Args& a, int seq, int kv_head, int pos) {
  const int block = a.block_tables[(long)seq * a.block_table_stride + pos / a.block_size];
  return cache + (((long)block * a.num_kv_heads + kv_head) * a.block_size + pos % a.block_size) * a.head_dim;
}

// Few query rows (decodes: one query, the G heads of a KV head): scores are dot products along head_dim,
// keys W at a time so that the softmax of a chunk is one vector.
template <typename T>
static void attend_dot(const Args& a, const WorkItem& it) {
  const int D = a.head_dim, G = a.num_heads / a.num_kv_heads, h = it.kv_head, s = it.seq;
  const int q0 = a.query_start[s], n = a.query_start[s + 1] - q0, first_pos = a.context_lens[s] - n;
  const T* q = (const T*)a.query;
  const T* kc = (const T*)a.key_cache;
  const T* vc = (const T*)a.value_cache;
  const T* zeros = (const T*)a.zeros;
  alignas(64) float qs[MAX_DOT_ROWS][MAX_HEAD_DIM];
  alignas(64) float acc[MAX_DOT_ROWS][MAX_HEAD_DIM];
  alignas(64) float sc[MAX_DOT_ROWS][W];
  float m[MAX_DOT_ROWS], l[MAX_DOT_ROWS];
  int pos[MAX_DOT_ROWS];
  const int rows = it.rows;
  for (int r = 0; r < rows; r++) {
    const int row = it.row0 + r;
    const T* src = q + (long)(q0 + row / G) * a.query_stride + (h * G + row % G) * D;
    for (int d = 0; d < D; d++) qs[r][d] = to_float(src[d]) * a.scale;
    for (int d = 0; d < D; d++) acc[r][d] = 0.f;
    m[r] = -__builtin_inff();
    l[r] = 0.f;
    pos[r] = first_pos + row / G;
  }
  const int key_end = first_pos + (it.row0 + rows - 1) / G + 1;
  for (int j0 = 0; j0 < key_end; j0 += W) {
    const T* kp[W];
    const T* vp[W];
    for (int j = 0; j < W; j++) {
      const bool in = j0 + j < key_end;
      kp[j] = in ? key_row(kc, a, s, h, j0 + j) : zeros;
      vp[j] = in ? key_row(vc, a, s, h, j0 + j) : zeros;
    }
    for (int j = 0; j < W; j++) {
      for (int r = 0; r < rows; r++) {
        V dot = V{};
        for (int d = 0; d < D; d += W) dot += load(&qs[r][d]) * load(kp[j] + d);
        sc[r][j] = j0 + j > pos[r] ? -__builtin_inff() : hsum(dot);
      }
    }
    for (int r = 0; r < rows; r++) {
      const V scores = load(sc[r]);
      const float m_new = hmax(scores) > m[r] ? hmax(scores) : m[r];
      const float alpha = vexp(splat(m[r] - m_new))[0];
      V p = vexp(scores - m_new);
      p = scores == splat(-__builtin_inff()) ? V{} : p;
      l[r] = l[r] * alpha + hsum(p);
      m[r] = m_new;
      store(sc[r], p);
      for (int d = 0; d < D; d += W) {
        V o = load(&acc[r][d]) * alpha;
        for (int j = 0; j < W; j++) o += sc[r][j] * load(vp[j] + d);
        store(&acc[r][d], o);
      }
    }
  }
  T* out = (T*)a.out;
  for (int r = 0; r < rows; r++) {
    const int row = it.row0 + r;
    T* dst = out + (long)(q0 + row / G) * a.out_stride + (h * G + row % G) * D;
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; d++) from_float(acc[r][d] * inv, dst + d);
  }
}

// Many query rows (prefill chunks): rows are vectorised instead, ROW_VECS * W of them per item, so each key
// element is broadcast against a vector of query rows (a small GEMM with the queries transposed once) and
// the online softmax runs across rows, with no horizontal sums.
template <typename T>
static void attend_rows(const Args& a, const WorkItem& it) {
  constexpr int RV = ROW_VECS, RT = ROW_VECS * W, KC = ROWS_KEY_CHUNK;
  const int D = a.head_dim, G = a.num_heads / a.num_kv_heads, h = it.kv_head, s = it.seq;
  const int q0 = a.query_start[s], n = a.query_start[s + 1] - q0, first_pos = a.context_lens[s] - n;
  const T* q = (const T*)a.query;
  const T* kc = (const T*)a.key_cache;
  const T* vc = (const T*)a.value_cache;
  const T* zeros = (const T*)a.zeros;
  alignas(64) float qt[MAX_HEAD_DIM][RT];
  alignas(64) float acc[MAX_HEAD_DIM][RT];
  alignas(64) float posf[RT];
  const int rows = it.rows;
  for (int i = 0; i < RT; i++) {
    const int row = it.row0 + i;
    if (i < rows) {
      const T* src = q + (long)(q0 + row / G) * a.query_stride + (h * G + row % G) * D;
      for (int d = 0; d < D; d++) qt[d][i] = to_float(src[d]) * a.scale;
      posf[i] = (float)(first_pos + row / G);
    } else {  // padding rows see every key (no empty softmax) and are never written
      for (int d = 0; d < D; d++) qt[d][i] = 0.f;
      posf[i] = 3e38f;
    }
  }
  for (int d = 0; d < D; d++)
    for (int i = 0; i < RT; i++) acc[d][i] = 0.f;
  V pos[RV], m[RV], l[RV];
  for (int v = 0; v < RV; v++) {
    pos[v] = load(&posf[v * W]);
    m[v] = splat(-__builtin_inff());
    l[v] = V{};
  }
  const int min_pos = first_pos + it.row0 / G;
  const int key_end = first_pos + (it.row0 + rows - 1) / G + 1;
  for (int j0 = 0; j0 < key_end; j0 += KC) {
    const T* kp[KC];
    const T* vp[KC];
    for (int j = 0; j < KC; j++) {
      const bool in = j0 + j < key_end;
      kp[j] = in ? key_row(kc, a, s, h, j0 + j) : zeros;
      vp[j] = in ? key_row(vc, a, s, h, j0 + j) : zeros;
    }
    V sc[KC][RV];
    for (int j = 0; j < KC; j++)
      for (int v = 0; v < RV; v++) sc[j][v] = V{};
    for (int d = 0; d < D; d++) {
      V qv[RV];
      for (int v = 0; v < RV; v++) qv[v] = load(&qt[d][v * W]);
      for (int j = 0; j < KC; j++) {
        const float k = to_float(kp[j][d]);
        for (int v = 0; v < RV; v++) sc[j][v] += qv[v] * k;
      }
    }
    const bool masked = j0 + KC - 1 > min_pos;  // some key of the chunk lies after some row's position
    if (masked)
      for (int j = 0; j < KC; j++)
        for (int v = 0; v < RV; v++) sc[j][v] = splat((float)(j0 + j)) > pos[v] ? splat(-__builtin_inff()) : sc[j][v];
    V alpha[RV];
    for (int v = 0; v < RV; v++) {
      V m_new = m[v];
      for (int j = 0; j < KC; j++) m_new = vmax(m_new, sc[j][v]);
      alpha[v] = vexp(m[v] - m_new);
      V sum = V{};
      for (int j = 0; j < KC; j++) {
        V p = vexp(sc[j][v] - m_new);
        if (masked) p = sc[j][v] == splat(-__builtin_inff()) ? V{} : p;
        sc[j][v] = p;
        sum += p;
      }
      l[v] = l[v] * alpha[v] + sum;
      m[v] = m_new;
    }
    for (int d = 0; d < D; d++) {
      V o[RV];
      for (int v = 0; v < RV; v++) o[v] = load(&acc[d][v * W]) * alpha[v];
      for (int j = 0; j < KC; j++) {
        const float val = to_float(vp[j][d]);
        for (int v = 0; v < RV; v++) o[v] += sc[j][v] * val;
      }
      for (int v = 0; v < RV; v++) store(&acc[d][v * W], o[v]);
    }
  }
  alignas(64) float inv[RT];
  for (int v = 0; v < RV; v++) store(&inv[v * W], 1.f / l[v]);
  T* out = (T*)a.out;
  for (int i = 0; i < rows; i++) {
    const int row = it.row0 + i;
    T* dst = out + (long)(q0 + row / G) * a.out_stride + (h * G + row % G) * D;
    for (int d = 0; d < D; d++) from_float(acc[d][i] * inv[i], dst + d);
  }
}

template <typename T>
static void run_items(const Args& a, const WorkItem* items, long begin, long end) {
  for (long i = begin; i < end; i++) {
    if (items[i].rows_path)
      attend_rows<T>(a, items[i]);
    else
      attend_dot<T>(a, items[i]);
  }
}

static void run(const Args& a, const WorkItem* items, long begin, long end) {
  if (a.bf16)
    run_items<unsigned short>(a, items, begin, end);
  else
    run_items<float>(a, items, begin, end);
}
