// Paged prefill attention for prefill chunks: each query sees its sequence's cached context plus its own
// chunk causally. A chunk of n queries over a context of L keys (L - n cached, then the chunk itself, all
// already in the cache: the cache write runs first) puts query i at position L - n + i, and it sees keys
// at positions <= L - n + i (the causal mask aligned bottom-right); with a sliding window, only the last
// `window` of them, at positions > L - n + i - window.
//
// Layouts (elements; T is bf16 or fp16):
//   query        rows of [num_heads * D], row stride q_stride
//   key_cache    [num_blocks, num_kv_heads, block_size, D] (HND), value_cache the same
//   block_tables [num_seqs, table_stride] int32: row s is prefill sequence s
//   seqs         [num_prefills][3] int32: (first query row, query count n, context length L)
//   work         [num_work][2] int32: (sequence, first packed row m0), one CTA row-tile each
//   out          [num_tokens, num_heads * D], contiguous
//
// GQA packing: the G = num_heads / num_kv_heads query heads of one KV head are folded into the rows of
// one matrix, packed row m = i * G + g (query i, head kv_head * G + g), so the K/V tiles of a KV head are
// read once for all its query heads. Grid: x = work item, y = KV head. A CTA (4 warps) takes packed rows
// [m0, m0 + 64), 16 per warp, and sweeps keys [key_begin, key_end) in tiles of 64, where key_begin is the
// first key its first query sees (0 without a window) and key_end one past the position of its last query;
// cp.async double-buffers the tiles. S = Q K^T and O += P V run on tensor cores (mma.sync m16n8k16, float32
// accumulation) with an online softmax in between.
#include "common.cuh"

constexpr int PREFILL_WARPS = 4;
constexpr int PREFILL_THREADS = 32 * PREFILL_WARPS;
constexpr int PREFILL_ROWS = 16 * PREFILL_WARPS;  // packed (query, head) rows per CTA
constexpr int PREFILL_TILE = 64;                  // keys per shared-memory tile

// Dynamic shared memory (cupy_backend.prefill_smem_bytes computes the same):
//   sQ [64][D + PAD], then 2 stages x (sK [64][D + PAD], sV [64][D + PAD]), all of T.

template <typename T, int D>
PS_DEVICE void paged_prefill(T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ key_cache,
                             const T* __restrict__ value_cache, const int* __restrict__ block_tables,
                             const int* __restrict__ seqs, const int* __restrict__ work, int num_heads,
                             int num_kv_heads, int block_size_log2, int table_stride, i64 q_stride,
                             float scale_log2, int window, float softcap_log2) {
  constexpr int LD = D + PS_SMEM_PAD;
  constexpr int VECS = D / 8;
  static_assert(sizeof(T) == 2, "tensor-core path: 16-bit elements");
  constexpr int SMEM_BYTES = (PREFILL_ROWS + 2 * 2 * PREFILL_TILE) * LD * 2;
  require_smem(SMEM_BYTES);

  const int kv_head = blockIdx.y;
  const int seq = work[2 * blockIdx.x];
  const int m0 = work[2 * blockIdx.x + 1];
  const int q_start = seqs[3 * seq], num_queries = seqs[3 * seq + 1], context_len = seqs[3 * seq + 2];
  const int group = num_heads / num_kv_heads;
  const int rows_here = min(PREFILL_ROWS, num_queries * group - m0);
  const int first_pos = context_len - num_queries;                  // position of query 0
  const int key_end = first_pos + (m0 + rows_here - 1) / group + 1;  // keys this CTA's rows can see
  const int key_begin = max(0, first_pos + m0 / group - window + 1);
  const int* table = block_tables + static_cast<i64>(seq) * table_stride;

  T* sq = reinterpret_cast<T*>(dynamic_smem());
  T* sk = sq + PREFILL_ROWS * LD;  // stage s: sk + s * PREFILL_TILE * LD
  T* sv = sk + 2 * PREFILL_TILE * LD;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;

  // Copies of keys [tile_start, tile_start + PREFILL_TILE) into `stage` (zeros at and past key_end).
  auto load_tile = [&](int stage, int tile_start) {
    load_kv_tile<T, D, LD, PREFILL_TILE, PREFILL_THREADS>(sk + stage * PREFILL_TILE * LD, sv + stage * PREFILL_TILE * LD,
                                               key_cache, value_cache, table, tile_start, key_end,
                                               num_kv_heads, kv_head, block_size_log2, tid);
  };

  // Query rows into sQ, in the same copy group as the first K/V tile. Row r is packed row m0 + r.
#pragma unroll
  for (int i = 0; i < PREFILL_ROWS * VECS / PREFILL_THREADS; ++i) {
    const int c = tid + i * PREFILL_THREADS;
    const int r = c / VECS, col = (c % VECS) * 8;
    if (r < rows_here) {
      const int qi = (m0 + r) / group, head = kv_head * group + (m0 + r) - qi * group;
      cp_async_16(sq + r * LD + col, query + static_cast<i64>(q_start + qi) * q_stride + static_cast<i64>(head) * D + col);
    } else {
      store_zero_16(sq + r * LD + col);
    }
  }
  load_tile(0, key_begin);
  cp_async_commit();

  // Positions of this lane's two rows (g and g + 8 of the warp's 16); padding rows (past rows_here) take
  // the last position, so they stay finite, and are never stored.
  int row_pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + g + 8 * h;
    row_pos[h] = r < rows_here ? first_pos + (m0 + r) / group : key_end - 1;
  }

  u32 qf[D / 16][4];
  float m[2] = {PS_NEG_INF, PS_NEG_INF};
  float l[2] = {0.0f, 0.0f};
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

  const int num_tiles = (key_end - key_begin + PREFILL_TILE - 1) / PREFILL_TILE;
  for (int it = 0; it < num_tiles; ++it) {
    if (it + 1 < num_tiles) {
      load_tile((it + 1) & 1, key_begin + (it + 1) * PREFILL_TILE);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (it == 0) load_q_frags<D>(qf, sq + warp * 16 * LD, LD);

    const int stage = it & 1;
    float s[PREFILL_TILE / 8][4];
    warp_qk<T, D, PREFILL_TILE / 8>(s, qf, sk + stage * PREFILL_TILE * LD, LD);

    // Element (n, i) is key tile_start + 8n + 2t + (i & 1) of row h = i >> 1: visible iff key <= its position
    // and key > its position - window. (A row may see no key of a tile: online_softmax keeps it at zero.)
    const int key_base = key_begin + it * PREFILL_TILE + 2 * t;
#pragma unroll
    for (int n = 0; n < PREFILL_TILE / 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = key_base + 8 * n + (i & 1), pos = row_pos[i >> 1];
        s[n][i] = (key <= pos && key > pos - window) ? soft_cap(s[n][i] * scale_log2, softcap_log2) : PS_NEG_INF;
      }

    online_softmax<D, PREFILL_TILE / 8>(s, m, l, acc);
    warp_pv<T, D, PREFILL_TILE / 8>(acc, s, sv + stage * PREFILL_TILE * LD, LD);
    __syncthreads();
  }

  // Normalise and store: lane (g, t) holds columns 8n + 2t, 8n + 2t + 1 of rows g and g + 8.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += shfl_xor(l[h], 1);
    l[h] += shfl_xor(l[h], 2);
    const int r = warp * 16 + g + 8 * h;
    if (r >= rows_here) continue;
    const int qi = (m0 + r) / group, head = kv_head * group + (m0 + r) - qi * group;
    T* dst = out + static_cast<i64>(q_start + qi) * num_heads * D + static_cast<i64>(head) * D + 2 * t;
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // l >= 1: every row sees its own key
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      PS_CHECK_GLOBAL(dst + 8 * n, 4);
      *reinterpret_cast<u32*>(dst + 8 * n) = pack2<T>(acc[n][2 * h] * inv, acc[n][2 * h + 1] * inv);
    }
  }
}

#define PS_PREFILL(NAME, T, D)                                                                              \
  extern "C" __global__ void __launch_bounds__(PREFILL_THREADS)                                             \
      NAME(T* out, const T* query, const T* key_cache, const T* value_cache, const int* block_tables,       \
           const int* seqs, const int* work, int num_heads, int num_kv_heads, int block_size_log2,           \
           int table_stride, i64 q_stride, float scale_log2, int window, float softcap_log2) {              \
    paged_prefill<T, D>(out, query, key_cache, value_cache, block_tables, seqs, work, num_heads,            \
                        num_kv_heads, block_size_log2, table_stride, q_stride, scale_log2, window,          \
                        softcap_log2);                                                                      \
  }

PS_PREFILL(paged_prefill_bf16_d64, bf16, 64)
PS_PREFILL(paged_prefill_bf16_d128, bf16, 128)
PS_PREFILL(paged_prefill_f16_d64, fp16, 64)
PS_PREFILL(paged_prefill_f16_d128, fp16, 128)
