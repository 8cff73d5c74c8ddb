// Paged decode attention: one query token per sequence over its whole context, through the block table.
//
// Layouts (elements; T is bf16 or fp16):
//   query        rows of [num_heads * D], row stride q_stride; decode row r is query row q_row_start + r
//   key_cache    [num_blocks, num_kv_heads, block_size, D] (HND), value_cache the same
//   block_tables [num_rows, table_stride] int32, this launch's rows only; context_lens [num_rows] int32
//   out          [num_tokens, num_heads * D], contiguous
// Position p of a sequence lives in block table[p >> block_size_log2] at offset p & (block_size - 1):
//   element (p, kv_head, d) = cache[((block * num_kv_heads + kv_head) * block_size + offset) * D + d].
//
// Grid: x = decode row, y = kv_head * head_groups + head_group, z = partition of the context.
// One CTA (4 warps) serves up to 16 query heads of one KV head (GQA: the G = num_heads / num_kv_heads
// heads sharing the KV head, padded to the 16 rows of an mma tile; G > 16 takes ceil(G / 16) head groups)
// over the context slice [b + z * partition_size, min(context_len, b + (z + 1) * partition_size)), where b is the
// first key the query sees (0, or with a sliding window context_len - window), so each K/V
// byte of the slice is read once per head group. Tiles of 64 keys are copied into shared memory with
// cp.async, two stages deep; warp w scores keys 16w..16w+15 of each tile against all 16 rows with
// mma.sync and keeps its own online softmax; the 4 warps' states are merged at the end.
// Keys at or past the context length are never read: their tile rows are zero-filled and their scores
// masked to -inf, so the tail of the last block (whatever it holds, NaN included) cannot leak in.
//
// A row whose context fits in one partition is written, normalised, by its one CTA. Otherwise each CTA
// writes its partition's normalised output O_z (float32) and (m_z, l_z) = (running max in log2 units,
// denominator) to the workspace, fences, and counts itself on the (row, head group)'s counter; the CTA that
// counts last (whichever partition it is) merges the partitions and resets the counter to zero for the
// next launch or graph replay:
//   out = sum_z w_z O_z / sum_z w_z,  w_z = l_z * exp2(m_z - max_z m_z)
// (the exp(m_j - m) rescaling of split-K softmax, in base 2). The merge costs no launch of its own.
#include "common.cuh"

constexpr int DECODE_WARPS = 4;
constexpr int DECODE_THREADS = 32 * DECODE_WARPS;
constexpr int DECODE_TILE = 16 * DECODE_WARPS;  // keys per shared-memory tile: 16 per warp
constexpr int DECODE_ROWS = 16;                 // query heads per CTA: the M of one mma tile

// Dynamic shared memory (the host computes the same in cupy_backend.decode_smem_bytes):
//   sQ [16][D + PAD], then 2 stages x (sK [64][D + PAD], sV [64][D + PAD]), all of T.
// The final merge reuses the K/V stages as float sO [4][16][D] followed by sM [4][16] and sL [4][16], then
// one int (the split-K "this CTA merges" flag).

template <typename T, int D>
PS_DEVICE void paged_decode(T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml,
                            u32* __restrict__ part_counters, const T* __restrict__ query, const T* __restrict__ key_cache,
                            const T* __restrict__ value_cache, const int* __restrict__ block_tables,
                            const int* __restrict__ context_lens, int num_heads, int num_kv_heads,
                            int block_size_log2, int table_stride, i64 q_stride, int q_row_start,
                            int partition_size, int num_partitions, float scale_log2, int window,
                            float softcap_log2) {
  constexpr int LD = D + PS_SMEM_PAD;     // shared-memory row stride, elements
  constexpr int VECS = D / 8;             // 16-byte vectors per head row
  static_assert(sizeof(T) == 2, "tensor-core path: 16-bit elements");
  static_assert(2 * 2 * DECODE_TILE * LD * 2 >= DECODE_WARPS * DECODE_ROWS * (D + 2) * 4 + 4,
                "the merge buffers and the flag fit in the K/V stages");
  constexpr int SMEM_BYTES = (DECODE_ROWS + 2 * 2 * DECODE_TILE) * LD * 2;
  require_smem(SMEM_BYTES);

  const int row = blockIdx.x;
  const int group = num_heads / num_kv_heads;
  const int head_groups = (group + DECODE_ROWS - 1) / DECODE_ROWS;
  const int kv_head = blockIdx.y / head_groups;
  const int head0 = (blockIdx.y % head_groups) * DECODE_ROWS;  // first query head of the group served
  const int rows_here = min(DECODE_ROWS, group - head0);        // real rows of the 16
  const int partition = blockIdx.z;

  const int context_len = context_lens[row];
  const int key_begin = max(0, context_len - window);  // the query (at context_len - 1) sees the last `window` keys
  const int part_start = key_begin + partition * partition_size;
  if (part_start >= context_len) return;  // past this row's context (only with split-K): not counted
  // Partitions this row's keys reach; every CTA of the row computes the same number.
  const int used = min(num_partitions, (context_len - key_begin + partition_size - 1) / partition_size);
  const int part_end = min(context_len, part_start + partition_size);
  const int* table = block_tables + static_cast<i64>(row) * table_stride;

  T* sq = reinterpret_cast<T*>(dynamic_smem());
  T* sk = sq + DECODE_ROWS * LD;                  // stage s: sk + s * DECODE_TILE * LD
  T* sv = sk + 2 * DECODE_TILE * LD;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;

  // Copies of keys [tile_start, tile_start + DECODE_TILE) into `stage` (zeros at and past part_end).
  auto load_tile = [&](int stage, int tile_start) {
    load_kv_tile<T, D, LD, DECODE_TILE, DECODE_THREADS>(sk + stage * DECODE_TILE * LD, sv + stage * DECODE_TILE * LD,
                                               key_cache, value_cache, table, tile_start, part_end,
                                               num_kv_heads, kv_head, block_size_log2, tid);
  };

  const int num_tiles = (part_end - part_start + DECODE_TILE - 1) / DECODE_TILE;
  load_tile(0, part_start);
  cp_async_commit();

  // The served query heads as 16 rows of sQ (rows past the group are zeros: their scores are finite and
  // never written out).
  const T* q_row = query + static_cast<i64>(q_row_start + row) * q_stride + static_cast<i64>(kv_head * group + head0) * D;
  for (int c = tid; c < DECODE_ROWS * VECS; c += DECODE_THREADS) {
    const int r = c / VECS, col = (c % VECS) * 8;
    if (r < rows_here) {
      PS_CHECK_GLOBAL(q_row + r * D + col, 16);
      *reinterpret_cast<uint4*>(sq + r * LD + col) = *reinterpret_cast<const uint4*>(q_row + r * D + col);
    } else {
      store_zero_16(sq + r * LD + col);
    }
  }
  __syncthreads();
  u32 qf[D / 16][4];
  load_q_frags<D>(qf, sq, LD);

  float m[2] = {PS_NEG_INF, PS_NEG_INF};
  float l[2] = {0.0f, 0.0f};
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

  for (int it = 0; it < num_tiles; ++it) {
    if (it + 1 < num_tiles) {
      load_tile((it + 1) & 1, part_start + (it + 1) * DECODE_TILE);
      cp_async_commit();
      cp_async_wait<1>();  // tile `it` has landed (for this thread's copies) ...
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();       // ... and for everyone's, zero-fills included

    const int stage = it & 1;
    const int warp_key0 = warp * 16;  // this warp's 16 keys of the tile
    float s[2][4];
    warp_qk<T, D, 2>(s, qf, sk + (stage * DECODE_TILE + warp_key0) * LD, LD);

    // Scale into log2 units; mask keys at or past the slice end. Element (n, i) is key 8n + 2t + (i & 1).
    const int key_base = part_start + it * DECODE_TILE + warp_key0 + 2 * (lane & 3);
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        s[n][i] = (key_base + 8 * n + (i & 1) < part_end) ? soft_cap(s[n][i] * scale_log2, softcap_log2) : PS_NEG_INF;

    online_softmax<D, 2>(s, m, l, acc);
    warp_pv<T, D, 2>(acc, s, sv + (stage * DECODE_TILE + warp_key0) * LD, LD);
    __syncthreads();       // the stage is free for the copies issued next iteration
  }

  // Merge the 4 warps. Each quad first sums its denominator shares; lane (g, t) then stores rows g, g + 8.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += shfl_xor(l[h], 1);
    l[h] += shfl_xor(l[h], 2);
  }
  float* so = reinterpret_cast<float*>(sk);       // [4][16][D]
  float* sm = so + DECODE_WARPS * DECODE_ROWS * D;  // [4][16]
  float* sl = sm + DECODE_WARPS * DECODE_ROWS;      // [4][16]
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (t == 0) {
      sm[warp * DECODE_ROWS + r] = m[h];
      sl[warp * DECODE_ROWS + r] = l[h];
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      so[(warp * DECODE_ROWS + r) * D + 8 * n + 2 * t] = acc[n][2 * h];
      so[(warp * DECODE_ROWS + r) * D + 8 * n + 2 * t + 1] = acc[n][2 * h + 1];
    }
  }
  __syncthreads();

  const i64 out_row = static_cast<i64>(q_row_start + row) * num_heads * D;
  const int head_base = kv_head * group + head0;  // query head of served row 0
  for (int idx = tid; idx < rows_here * D; idx += DECODE_THREADS) {
    const int r = idx / D, col = idx % D;
    float m_all = PS_NEG_INF;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) m_all = fmaxf(m_all, sm[w * DECODE_ROWS + r]);
    const float base = (m_all == PS_NEG_INF) ? 0.0f : m_all;
    float num = 0.0f, den = 0.0f;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) {
      const float f = fast_exp2(sm[w * DECODE_ROWS + r] - base);  // 0 for a warp that saw no key
      num += so[(w * DECODE_ROWS + r) * D + col] * f;
      den += sl[w * DECODE_ROWS + r] * f;
    }
    const float o = den > 0.0f ? num / den : 0.0f;  // den >= 1: the slice holds at least one key
    if (used == 1) {
      T* dst = out + out_row + static_cast<i64>(head_base + r) * D + col;
      PS_CHECK_GLOBAL(dst, sizeof(T));
      Elem<T>::store(dst, o);
    } else {
      const i64 part = (static_cast<i64>(row) * num_heads + head_base + r) * num_partitions + partition;
      PS_CHECK_GLOBAL(part_out + part * D + col, 4);
      part_out[part * D + col] = o;
      if (col == 0) {
        PS_CHECK_GLOBAL(part_ml + part * 2, 8);
        part_ml[part * 2] = m_all;
        part_ml[part * 2 + 1] = den;
      }
    }
  }
  if (used == 1) return;

  // Split-K: count this partition in; the last of the row's `used` CTAs to arrive merges them all.
  int* merges = reinterpret_cast<int*>(sl + DECODE_WARPS * DECODE_ROWS);
  thread_fence();  // this thread's partials reach L2 before the count below can be observed
  __syncthreads();
  u32* counter = part_counters + static_cast<i64>(row) * gridDim.y + blockIdx.y;
  if (tid == 0) {
    *merges = atomic_add_u32(counter, 1u) == static_cast<u32>(used - 1);
    thread_fence();  // the other CTAs' partials are read after their counts were seen
  }
  __syncthreads();
  if (!*merges) return;
  for (int idx = tid; idx < rows_here * D; idx += DECODE_THREADS) {
    const int r = idx / D, col = idx % D;
    const i64 first = (static_cast<i64>(row) * num_heads + head_base + r) * num_partitions;
    float m_all = PS_NEG_INF;
    for (int z = 0; z < used; ++z) m_all = fmaxf(m_all, load_cg(part_ml + (first + z) * 2));
    float num = 0.0f, den = 0.0f;
    for (int z = 0; z < used; ++z) {
      const float w = load_cg(part_ml + (first + z) * 2 + 1) * fast_exp2(load_cg(part_ml + (first + z) * 2) - m_all);
      num += w * load_cg(part_out + (first + z) * D + col);
      den += w;
    }
    T* dst = out + out_row + static_cast<i64>(head_base + r) * D + col;
    PS_CHECK_GLOBAL(dst, sizeof(T));
    Elem<T>::store(dst, den > 0.0f ? num / den : 0.0f);
  }
  if (tid == 0) *counter = 0u;  // every CTA of this row has counted: ready for the next launch
}

#define PS_DECODE(NAME, T, D)                                                                               \
  extern "C" __global__ void __launch_bounds__(DECODE_THREADS)                                              \
      NAME(T* out, float* part_out, float* part_ml, u32* part_counters, const T* query, const T* key_cache, \
           const T* value_cache, const int* block_tables, const int* context_lens, int num_heads,           \
           int num_kv_heads, int block_size_log2, int table_stride, i64 q_stride, int q_row_start,          \
           int partition_size, int num_partitions, float scale_log2, int window, float softcap_log2) {      \
    paged_decode<T, D>(out, part_out, part_ml, part_counters, query, key_cache, value_cache, block_tables,  \
                       context_lens, num_heads, num_kv_heads, block_size_log2, table_stride, q_stride,      \
                       q_row_start, partition_size, num_partitions, scale_log2, window, softcap_log2);      \
  }

PS_DECODE(paged_decode_bf16_d64, bf16, 64)
PS_DECODE(paged_decode_bf16_d128, bf16, 128)
PS_DECODE(paged_decode_f16_d64, fp16, 64)
PS_DECODE(paged_decode_f16_d128, fp16, 128)
// ---------------------------------------------------------------------------------------------------
// Row-wise attention on CUDA cores, for float32 caches (tests, reference runs): any query row over the
// first `row_keys[row]` positions of sequence `row_seq[row]` (the last `window` of them). A prefill query at
// position p is a row with p + 1 keys, a decode row one with its context length, so one launch covers a whole
// mixed batch.
// Grid: (num_rows, num_heads); block: one warp, lane owning elements d = lane + 32 j of the head.
// Keys are visited in order with an online softmax; the dot product is a warp reduction per key.
// ---------------------------------------------------------------------------------------------------
template <typename T, int D>
PS_DEVICE void paged_attention_rows(T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ key_cache,
                                    const T* __restrict__ value_cache, const int* __restrict__ block_tables,
                                    const int* __restrict__ row_seq, const int* __restrict__ row_keys,
                                    int num_heads, int num_kv_heads, int block_size_log2, int table_stride,
                                    i64 q_stride, float scale_log2, int window, float softcap_log2) {
  constexpr int PER_LANE = D / 32;
  const int row = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int num_keys = row_keys[row];
  const int* table = block_tables + static_cast<i64>(row_seq[row]) * table_stride;
  const int block_mask = (1 << block_size_log2) - 1;
  const T* q = query + static_cast<i64>(row) * q_stride + static_cast<i64>(head) * D;

  float qv[PER_LANE], acc[PER_LANE];
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    PS_CHECK_GLOBAL(q + lane + 32 * j, sizeof(T));
    qv[j] = Elem<T>::load(q + lane + 32 * j);
    acc[j] = 0.0f;
  }
  float m = PS_NEG_INF, l = 0.0f;
  for (int pos = max(0, num_keys - window); pos < num_keys; ++pos) {
    const int block = table[pos >> block_size_log2];
    const i64 base = ((static_cast<i64>(block) * num_kv_heads + kv_head) << block_size_log2 | (pos & block_mask)) * D;
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
      PS_CHECK_GLOBAL(key_cache + base + lane + 32 * j, sizeof(T));
      dot += qv[j] * Elem<T>::load(key_cache + base + lane + 32 * j);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += shfl_xor(dot, o);
    const float s = soft_cap(dot * scale_log2, softcap_log2);
    const float m_new = fmaxf(m, s);
    const float alpha = fast_exp2(m - m_new);  // 0 on the first key (m = -inf)
    const float p = fast_exp2(s - m_new);
    l = l * alpha + p;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
      PS_CHECK_GLOBAL(value_cache + base + lane + 32 * j, sizeof(T));
      acc[j] = acc[j] * alpha + p * Elem<T>::load(value_cache + base + lane + 32 * j);
    }
    m = m_new;
  }
  T* dst = out + static_cast<i64>(row) * num_heads * D + static_cast<i64>(head) * D;
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    PS_CHECK_GLOBAL(dst + lane + 32 * j, sizeof(T));
    Elem<T>::store(dst + lane + 32 * j, l > 0.0f ? acc[j] / l : 0.0f);
  }
}

#define PS_ROWS(NAME, T, D)                                                                                 \
  extern "C" __global__ void __launch_bounds__(32)                                                          \
      NAME(T* out, const T* query, const T* key_cache, const T* value_cache, const int* block_tables,       \
           const int* row_seq, const int* row_keys, int num_heads, int num_kv_heads, int block_size_log2,    \
           int table_stride, i64 q_stride, float scale_log2, int window, float softcap_log2) {              \
    paged_attention_rows<T, D>(out, query, key_cache, value_cache, block_tables, row_seq, row_keys,         \
                               num_heads, num_kv_heads, block_size_log2, table_stride, q_stride, scale_log2, \
                               window, softcap_log2);                                                       \
  }

PS_ROWS(paged_attention_rows_f32_d64, float, 64)
PS_ROWS(paged_attention_rows_f32_d128, float, 128)
PS_ROWS(paged_attention_rows_bf16_d64, bf16, 64)
PS_ROWS(paged_attention_rows_bf16_d128, bf16, 128)
PS_ROWS(paged_attention_rows_f16_d64, fp16, 64)
PS_ROWS(paged_attention_rows_f16_d128, fp16, 128)
