// Paged attention and the KV cache write for the CPU, reading K/V through the block tables in place.
//
// One work item is (sequence, KV head, a run of that head's query rows): the rows of the G query heads that
// share the KV head are served by one pass over its blocks (GQA). Softmax is online, in float32. Items run on
// torch's OpenMP threads, heaviest first with dynamic scheduling. The instruction set is picked at run time
// (AVX-512 with its bfloat16 dot products, AVX-512, AVX2 + FMA, or the baseline ISA with 128-bit vectors) from
// what the CPU reports; select_isa forces one for tests.
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int MAX_HEAD_DIM = 256;
constexpr int MAX_DOT_ROWS = 16;  // items with fewer rows than a vector holds take the dot-product path
constexpr int ROW_VECS = 3;  // vectors of query rows per prefill item: 3 x ROWS_KEY_CHUNK accumulators + 3 + 1 fit the registers
constexpr int KEY_TILE = 32;  // keys per online-softmax step of either path
constexpr int NO_WINDOW = 1 << 30;  // wider than any context

// All-zero bits are 0.0 in float32 and in bfloat16: one row serves both.
alignas(64) const float kZeros[MAX_HEAD_DIM] = {};

struct Args {
  const void* query;
  const void* key_cache;
  const void* value_cache;
  void* out;
  const void* zeros;  // a row of head_dim zeros: keys past the end read it
  const int32_t* query_start;
  const int32_t* context_lens;
  const int32_t* block_tables;
  long query_stride, out_stride, block_table_stride;
  int num_heads, num_kv_heads, head_dim, block_size;
  int window;  // a query at position p sees the keys at (p - window, p]; NO_WINDOW: all up to p
  float scale;
  float softcap;  // scores become softcap * tanh(scores / softcap) (before the mask); 0: as they are
  bool bf16;
};

struct WorkItem {
  int seq, kv_head, kv_heads, row0, rows;  // KV heads [kv_head, kv_head + kv_heads), rows [row0, row0 + rows) of each
  bool rows_path;
  double cost;
};

}  // namespace

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#define PAGED_AVX512 1
namespace isa_avx512 {
constexpr int W = 16;
constexpr int ROWS_KEY_CHUNK = 8;  // ROW_VECS x 8 score accumulators of the 32 vector registers
constexpr int DOT_ROW_BLOCK = 4;   // query rows a dot-product step serves at once (see dot_tile)
#include "paged_attention_impl.h"
}  // namespace isa_avx512
#pragma GCC pop_options

// The same with AVX512-BF16: bfloat16 caches take their score and value products as bfloat16 pairs, two per
// float32 lane and instruction (PAGED_BF16_DOT in the header).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")
#define PAGED_BF16_DOT 1
namespace isa_avx512_bf16 {
constexpr int W = 16;
constexpr int ROWS_KEY_CHUNK = 8;
constexpr int DOT_ROW_BLOCK = 4;
#include "paged_attention_impl.h"
}  // namespace isa_avx512_bf16
#undef PAGED_BF16_DOT
#undef PAGED_AVX512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define PAGED_AVX2 1
namespace isa_avx2 {
constexpr int W = 8;
constexpr int ROWS_KEY_CHUNK = 4;  // 16 vector registers: more accumulators would spill
constexpr int DOT_ROW_BLOCK = 3;
#include "paged_attention_impl.h"
}  // namespace isa_avx2
#undef PAGED_AVX2
#pragma GCC pop_options
#endif

namespace isa_baseline {
constexpr int W = 4;  // 128-bit vectors: SSE2 on x86-64, NEON on arm64
constexpr int ROWS_KEY_CHUNK = 4;
constexpr int DOT_ROW_BLOCK = 3;
#include "paged_attention_impl.h"
}  // namespace isa_baseline

namespace {

enum class Isa { baseline, avx2, avx512, avx512_bf16 };

bool supported(Isa isa) {
#if !defined(__x86_64__)
  return isa == Isa::baseline;
#else
  switch (isa) {
    case Isa::avx512_bf16:
      return supported(Isa::avx512) && __builtin_cpu_supports("avx512bf16");
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default:
      return true;
  }
#endif
}

Isa best_isa() {
  for (Isa isa : {Isa::avx512_bf16, Isa::avx512, Isa::avx2})
    if (supported(isa)) return isa;
  return Isa::baseline;
}

Isa current_isa = best_isa();

const char* isa_name(Isa isa) {
  return isa == Isa::avx512_bf16 ? "avx512_bf16" : isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "baseline";
}

int vector_width(Isa isa) { return isa == Isa::avx512_bf16 || isa == Isa::avx512 ? 16 : isa == Isa::avx2 ? 8 : 4; }

std::string select_isa(const std::string& name) {
  std::string previous = isa_name(current_isa);
  Isa isa;
  if (name == "auto")
    isa = best_isa();
  else if (name == "avx512_bf16")
    isa = Isa::avx512_bf16;
  else if (name == "avx512")
    isa = Isa::avx512;
  else if (name == "avx2")
    isa = Isa::avx2;
  else if (name == "baseline")
    isa = Isa::baseline;
  else
    TORCH_CHECK(false, "unknown instruction set ", name, "; choose auto, avx512_bf16, avx512, avx2 or baseline");
  TORCH_CHECK(supported(isa), "this CPU cannot run the ", name, " path");
  current_isa = isa;
  return previous;
}

std::string active_isa() { return isa_name(current_isa); }

void check_cache(const at::Tensor& cache, const at::Tensor& other) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), "caches are contiguous [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(cache.sizes() == other.sizes() && cache.scalar_type() == other.scalar_type(), "key and value caches differ");
  TORCH_CHECK(cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(cache.size(3) % 16 == 0 && cache.size(3) <= MAX_HEAD_DIM, "head_dim must be a multiple of 16, at most ", MAX_HEAD_DIM);
}

// out [T, H * D] and query [T, H * D] (rows may be strided, each row's heads contiguous), caches HND,
// query_start [S + 1], context_lens [S], block_tables [S, max_blocks] (int32): sequence s owns rows
// [query_start[s], query_start[s + 1]), its queries are its last n positions of context_lens[s], and a query
// at position p sees the keys at positions <= p, and with a sliding window (window > 0) only the last `window`
// of them: (p - window, p]. With softcap > 0 the scaled scores s become softcap * tanh(s / softcap).
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& query_start, const at::Tensor& context_lens,
                     const at::Tensor& block_tables, int64_t num_heads, double scale, int64_t window,
                     double softcap) {
  check_cache(key_cache, value_cache);
  const int kvh = key_cache.size(1), D = key_cache.size(3);
  TORCH_CHECK(num_heads % kvh == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.dim() == 2 && query.size(1) == num_heads * D && query.stride(1) == 1, "query is [T, H * D]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(1) == 1, "out is [T, H * D]");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == key_cache.scalar_type(),
              "query, out and caches share a dtype");
  for (const at::Tensor* t : {&query_start, &context_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "metadata is contiguous int32");
  const int num_seqs = context_lens.size(0);
  TORCH_CHECK(query_start.size(0) == num_seqs + 1 && block_tables.dim() == 2 && block_tables.size(0) >= num_seqs,
              "metadata sizes disagree");
  if (num_seqs == 0) return;

  const int G = num_heads / kvh, W = vector_width(current_isa);
  Args a{query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(), kZeros,
         query_start.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(),
         query.stride(0), out.stride(0), block_tables.stride(0), (int)num_heads, kvh, D, (int)key_cache.size(2),
         window > 0 && window < NO_WINDOW ? (int)window : NO_WINDOW, (float)scale, softcap > 0 ? (float)softcap : 0.f,
         key_cache.scalar_type() == at::kBFloat16};

  std::vector<WorkItem> items;
  const int32_t* qs = a.query_start;
  const int32_t* cl = a.context_lens;
  // Items of the dot-product path serve several KV heads at once (see attend_dot) where the rows fit and
  // there are sequences enough to keep every thread busy.
  const bool group_heads = num_seqs >= 8 * at::get_num_threads();
  for (int s = 0; s < num_seqs; s++) {
    const int n = qs[s + 1] - qs[s], rows = n * G;
    TORCH_CHECK(n > 0 && n <= cl[s], "sequence ", s, " has ", n, " queries over a context of ", cl[s]);
    TORCH_CHECK((cl[s] + a.block_size - 1) / a.block_size <= block_tables.size(1), "block table too short");
    const bool rows_path = rows >= W;
    const int tile = rows_path ? ROW_VECS * W : rows;
    for (int row0 = 0; row0 < rows; row0 += tile) {
      const int r = std::min(tile, rows - row0);
      const int first_pos = cl[s] - n;
      const double keys = first_pos + (row0 + r - 1) / G + 1 - std::max(0, first_pos + row0 / G - a.window + 1);
      const int most = rows_path || !group_heads ? 1 : std::max(1, MAX_DOT_ROWS / r);
      const int groups = (kvh + most - 1) / most, per_group = (kvh + groups - 1) / groups;
      for (int h = 0; h < kvh; h += per_group) {
        const int heads = std::min(per_group, kvh - h);
        items.push_back({s, h, heads, row0, r, rows_path, keys * heads * (rows_path ? tile : r + 4)});
      }
    }
  }
  // Heaviest first: the dynamic schedule then ends with small items and the threads finish together.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  const long num_items = items.size();
  const WorkItem* it = items.data();
  const Isa isa = current_isa;
  const int threads = std::min<long>(at::get_num_threads(), num_items);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (long i = 0; i < num_items; i++) {
#if defined(__x86_64__)
    if (isa == Isa::avx512_bf16)
      isa_avx512_bf16::run(a, it[i]);
    else if (isa == Isa::avx512)
      isa_avx512::run(a, it[i]);
    else if (isa == Isa::avx2)
      isa_avx2::run(a, it[i]);
    else
#endif
      isa_baseline::run(a, it[i]);
  }
}

// out [T, I] = silu(gate) * up for gu [T, 2I] = (gate, up), float32 or bfloat16 (rows may be strided; out may be
// gu's gate half).
template <typename T>
void silu_mul_for(T* o, long os, const T* g, long gs, long T_rows, int I) {
  const Isa isa = current_isa;
  // A decode step's few rows stay on one thread, where waking the others would cost more.
  at::parallel_for(0, T_rows, std::max<long>(1, (1 << 15) / std::max(I, 1)), [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    if (isa == Isa::avx512_bf16)
      isa_avx512_bf16::silu_mul_rows(g, gs, o, os, begin, end, I);
    else if (isa == Isa::avx512)
      isa_avx512::silu_mul_rows(g, gs, o, os, begin, end, I);
    else if (isa == Isa::avx2)
      isa_avx2::silu_mul_rows(g, gs, o, os, begin, end, I);
    else
#endif
      isa_baseline::silu_mul_rows(g, gs, o, os, begin, end, I);
  });
}

void silu_mul(at::Tensor out, const at::Tensor& gu) {
  const at::ScalarType dtype = gu.scalar_type();
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0 &&
              (dtype == at::kFloat || dtype == at::kBFloat16),
              "gate_up is [T, 2 * I] float32 or bfloat16 with contiguous rows");
  const long T = gu.size(0);
  const int I = gu.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == I && out.stride(1) == 1 && out.scalar_type() == dtype,
              "out is [T, I] in gate_up's dtype with contiguous rows");
  if (dtype == at::kFloat)
    silu_mul_for(out.data_ptr<float>(), out.stride(0), gu.data_ptr<float>(), gu.stride(0), T, I);
  else
    silu_mul_for(static_cast<unsigned short*>(out.data_ptr()), out.stride(0),
                 static_cast<const unsigned short*>(gu.data_ptr()), gu.stride(0), T, I);
}

// The greedy token of each row of logits [T, N] float32: torch's argmax(dim=-1) (the first largest, a NaN
// before any number), vectorised where torch's CPU argmax is scalar.
at::Tensor argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat && logits.size(1) > 0 &&
              logits.size(1) < (1 << 24), "logits are [T, N] float32 with 0 < N < 2^24 and contiguous rows");
  const long T = logits.size(0), N = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({T}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const Isa isa = current_isa;
  at::parallel_for(0, T, std::max<long>(1, (1 << 15) / N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
#if defined(__x86_64__)
      if (isa == Isa::avx512 || isa == Isa::avx512_bf16)
        o[t] = isa_avx512::argmax_row(x + t * stride, N);
      else if (isa == Isa::avx2)
        o[t] = isa_avx2::argmax_row(x + t * stride, N);
      else
#endif
        o[t] = isa_baseline::argmax_row(x + t * stride, N);
    }
  });
  return out;
}

// key/value [T, KVH * D] (rows may be strided) into their slots; a negative slot is skipped (padding).
void write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                 const at::Tensor& slot_mapping) {
  check_cache(key_cache, value_cache);
  const int kvh = key_cache.size(1), bs = key_cache.size(2), D = key_cache.size(3);
  const long num_slots = key_cache.size(0) * bs;
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 2 && t->size(1) == kvh * D && t->stride(1) == 1 && t->scalar_type() == key_cache.scalar_type(),
                "key and value are [T, KVH * D] in the caches' dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0), "slot_mapping is [T] int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const long T = key.size(0);
  for (long t = 0; t < T; t++) TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " outside the cache");
  const long elem = key_cache.element_size(), row_bytes = D * elem;
  char* kc = (char*)key_cache.data_ptr();
  char* vc = (char*)value_cache.data_ptr();
  const char* k = (const char*)key.data_ptr();
  const char* v = (const char*)value.data_ptr();
  const long ks = key.stride(0) * elem, vs = value.stride(0) * elem;
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      if (slots[t] < 0) continue;
      const long block = slots[t] / bs, offset = slots[t] % bs;
      for (int h = 0; h < kvh; h++) {
        const long dst = ((block * kvh + h) * bs + offset) * row_bytes;
        std::memcpy(kc + dst, k + t * ks + h * row_bytes, row_bytes);
        std::memcpy(vc + dst, v + t * vs + h * row_bytes, row_bytes);
      }
    }
  });
}

}  // namespace

// fused_cpu.cpp's bfloat16 loops, on this CPU's widest vectors (declared there).
#if defined(__x86_64__)
#define PAGED_FOR_ISA(call)                                                   \
  if (current_isa == Isa::avx512_bf16)                                        \
    isa_avx512_bf16::call;                                                    \
  else if (current_isa == Isa::avx512)                                        \
    isa_avx512::call;                                                         \
  else if (current_isa == Isa::avx2)                                          \
    isa_avx2::call;                                                           \
  else                                                                        \
    isa_baseline::call
#else
#define PAGED_FOR_ISA(call) isa_baseline::call
#endif

void norm_bf16_rows(uint16_t* out, long out_stride, uint16_t* residual, long residual_stride, const uint16_t* x,
                    long x_stride, const uint16_t* weight, const float* weight32, long begin, long end, int H,
                    float eps) {
  PAGED_FOR_ISA(norm_bf16_rows(out, out_stride, residual, residual_stride, x, x_stride, weight, weight32, begin, end,
                               H, eps));
}

void rotary_bf16_rows(uint16_t* q, long q_stride, uint16_t* k, long k_stride, const uint16_t* cos,
                      const uint16_t* sin, long begin, long end, int hq, int hk, int D, int R) {
  PAGED_FOR_ISA(rotary_bf16_rows(q, q_stride, k, k_stride, cos, sin, begin, end, hq, hk, D, R));
}
#undef PAGED_FOR_ISA

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor query_start, "
        "Tensor context_lens, Tensor block_tables, int num_heads, float scale, int window=0, float softcap=0.) -> ()");
  m.def("write_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("argmax(Tensor logits) -> Tensor");
  m.def("select_isa(str name) -> str", select_isa);
  m.def("active_isa() -> str", active_isa);
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_attention", paged_attention);
  m.impl("write_cache", write_cache);
  m.impl("silu_mul", silu_mul);
  m.impl("argmax", argmax);
}
