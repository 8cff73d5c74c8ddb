// Cache write: scatters one step's new K and V rows into their slots of the paged HND cache.
//
//   key, value:  [num_tokens, num_kv_heads * head_dim], rows `key_stride` / `value_stride` elements apart
//                (V is usually a column slice of the fused qkv projection, so its rows are not dense)
//   key_cache:   [num_blocks, num_kv_heads, block_size, head_dim], contiguous (the same for value_cache)
//   slot_mapping [num_tokens] int32: slot = block * block_size + offset; a negative slot is padding
//
// One thread moves one 16-byte vector of K and the vector at the same place of V. The flat thread index
// runs vector-fastest, then KV head, then token, so a warp reads whole contiguous head rows and writes
// whole contiguous rows of the destination tile (one head of one block is a block_size x head_dim tile).
#include "common.cuh"

template <typename T>
PS_DEVICE void cache_write(const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ key_cache,
                           T* __restrict__ value_cache, const int* __restrict__ slot_mapping, int num_tokens,
                           int num_kv_heads, int head_dim, int block_size, i64 key_stride, i64 value_stride) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector
  const int vecs_per_head = head_dim / VEC;
  const i64 index = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= static_cast<i64>(num_tokens) * num_kv_heads * vecs_per_head) return;

  const int vec = static_cast<int>(index % vecs_per_head);
  const i64 token_head = index / vecs_per_head;
  const int head = static_cast<int>(token_head % num_kv_heads);
  const int token = static_cast<int>(token_head / num_kv_heads);

  const int slot = slot_mapping[token];
  if (slot < 0) return;  // padding row: nothing to write
  const int block = slot / block_size;
  const int offset = slot - block * block_size;

  // Element offsets; 64-bit because a cache holds more than 2^31 elements.
  const i64 dst = ((static_cast<i64>(block) * num_kv_heads + head) * block_size + offset) * head_dim + vec * VEC;
  const i64 column = static_cast<i64>(head) * head_dim + vec * VEC;
  const T* k_src = key + token * key_stride + column;
  const T* v_src = value + token * value_stride + column;
  PS_CHECK_GLOBAL(k_src, 16);
  PS_CHECK_GLOBAL(v_src, 16);
  PS_CHECK_GLOBAL(key_cache + dst, 16);
  PS_CHECK_GLOBAL(value_cache + dst, 16);
  *reinterpret_cast<uint4*>(key_cache + dst) = *reinterpret_cast<const uint4*>(k_src);
  *reinterpret_cast<uint4*>(value_cache + dst) = *reinterpret_cast<const uint4*>(v_src);
}

#define PS_CACHE_WRITE(NAME, T)                                                                            \
  extern "C" __global__ void __launch_bounds__(128)                                                        \
      NAME(const T* key, const T* value, T* key_cache, T* value_cache, const int* slot_mapping,            \
           int num_tokens, int num_kv_heads, int head_dim, int block_size, i64 key_stride, i64 value_stride) { \
    cache_write<T>(key, value, key_cache, value_cache, slot_mapping, num_tokens, num_kv_heads, head_dim,   \
                   block_size, key_stride, value_stride);                                                  \
  }

PS_CACHE_WRITE(cache_write_f32, float)
PS_CACHE_WRITE(cache_write_bf16, bf16)
PS_CACHE_WRITE(cache_write_f16, fp16)
