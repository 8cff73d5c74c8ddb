// Shared device helpers for the paged-attention kernels.
//
// Built with NVRTC (through CuPy, at run time) or nvcc (tools/kernels_check.py), and also as plain C++ on
// the host against the emulator in tests/unit/kernel_emulator/emulator.h (PAGEDSERVE_EMULATION defined):
// every PTX instruction the kernels use sits in one small wrapper below, with a host version beside it.
// No headers are included: bf16 and fp16 are handled as raw 16-bit words with explicit conversions,
// which sidesteps NVRTC's cuda_bf16.h / cuda_fp16.h mismatches.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

// Storage types of the KV cache and activations. Only their bits are stored; arithmetic is in float32.
struct bf16 { u16 bits; };
struct fp16 { u16 bits; };

#ifndef PAGEDSERVE_EMULATION
#define PS_DEVICE __device__ __forceinline__
#define PS_CHECK_GLOBAL(ptr, bytes) ((void)0)
#else
#define PS_DEVICE inline
#define PS_CHECK_GLOBAL(ptr, bytes) emu_check_global((const void*)(ptr), (bytes))
#endif

// Shared-memory rows of K, V and Q tiles are padded by 8 elements (16 bytes): row strides of 144 or 272
// bytes put the 8 rows that one ldmatrix phase reads on 8 distinct 4-bank groups (no bank conflicts).
constexpr int PS_SMEM_PAD = 8;

// ---------------------------------------------------------------------------------------------------
// Scalar conversions
// ---------------------------------------------------------------------------------------------------

PS_DEVICE float bits_as_float(u32 bits) {
#ifndef PAGEDSERVE_EMULATION
  return __uint_as_float(bits);
#else
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
#endif
}

// -infinity (no constexpr spelling of it is portable across nvcc, NVRTC and g++).
#define PS_NEG_INF (bits_as_float(0xff800000u))

PS_DEVICE float bf16_to_float(u16 bits) { return bits_as_float(static_cast<u32>(bits) << 16); }

PS_DEVICE u16 float_to_bf16(float x) {  // round to nearest even
#ifndef PAGEDSERVE_EMULATION
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
#else
  return emu_float_to_bf16(x);
#endif
}

PS_DEVICE float fp16_to_float(u16 bits) {
#ifndef PAGEDSERVE_EMULATION
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
  return f;
#else
  return emu_fp16_to_float(bits);
#endif
}

PS_DEVICE u16 float_to_fp16(float x) {  // round to nearest even
#ifndef PAGEDSERVE_EMULATION
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
#else
  return emu_float_to_fp16(x);
#endif
}

// Element traits: how one stored element becomes a float and back.
template <typename T> struct Elem;
template <> struct Elem<float> {
  static PS_DEVICE float load(const float* p) { return *p; }
  static PS_DEVICE void store(float* p, float x) { *p = x; }
};
template <> struct Elem<bf16> {
  static PS_DEVICE float load(const bf16* p) { return bf16_to_float(p->bits); }
  static PS_DEVICE void store(bf16* p, float x) { p->bits = float_to_bf16(x); }
  static PS_DEVICE u16 from_float(float x) { return float_to_bf16(x); }
};
template <> struct Elem<fp16> {
  static PS_DEVICE float load(const fp16* p) { return fp16_to_float(p->bits); }
  static PS_DEVICE void store(fp16* p, float x) { p->bits = float_to_fp16(x); }
  static PS_DEVICE u16 from_float(float x) { return float_to_fp16(x); }
};

// Two floats as one register of two 16-bit elements: `lo` in bits 0-15 (the lower column index, as the
// mma fragments expect), `hi` in bits 16-31.
template <typename T> PS_DEVICE u32 pack2(float lo, float hi) {
  return static_cast<u32>(Elem<T>::from_float(lo)) | (static_cast<u32>(Elem<T>::from_float(hi)) << 16);
}

PS_DEVICE float fast_exp2(float x) {  // 2^x; exp2(-inf) = +0
#ifndef PAGEDSERVE_EMULATION
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return __builtin_exp2f(x);
#endif
}

// Gemma 2's attention softcapping, c * tanh(s / c), in the scores' log2 units (cap_log2 = c * log2(e)); 0: none.
PS_DEVICE float soft_cap(float s, float cap_log2) {
#ifndef PAGEDSERVE_EMULATION
  return cap_log2 > 0.0f ? cap_log2 * tanhf(s / cap_log2) : s;
#else
  return cap_log2 > 0.0f ? cap_log2 * __builtin_tanhf(s / cap_log2) : s;
#endif
}

PS_DEVICE float shfl_xor(float v, int lane_mask) {
#ifndef PAGEDSERVE_EMULATION
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#else
  return emu_shfl_xor(v, lane_mask);
#endif
}

[[noreturn]] PS_DEVICE void kernel_trap(const char* why) {
#ifndef PAGEDSERVE_EMULATION
  (void)why;
  __trap();
  __builtin_unreachable();
#else
  emu_trap(why);
#endif
}

// ---------------------------------------------------------------------------------------------------
// Shared memory
// ---------------------------------------------------------------------------------------------------

#ifndef PAGEDSERVE_EMULATION
// The kernels use dynamic shared memory only; each carves its regions out of this one array.
extern __shared__ __align__(16) unsigned char ps_dynamic_smem[];
PS_DEVICE unsigned char* dynamic_smem() { return ps_dynamic_smem; }
PS_DEVICE u32 dynamic_smem_bytes() {
  u32 r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}
PS_DEVICE u32 smem_addr(const void* p) {  // generic pointer -> 32-bit shared-window address
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
#else
PS_DEVICE unsigned char* dynamic_smem() { return emu_smem(); }
PS_DEVICE u32 dynamic_smem_bytes() { return emu_smem_bytes(); }
#endif

// The launch must provide at least `needed` bytes of dynamic shared memory; a wrong size from the host
// stops the kernel with a trap (an error at the next synchronisation) instead of corrupting memory.
PS_DEVICE void require_smem(u32 needed) {
  if (dynamic_smem_bytes() < needed) kernel_trap("dynamic shared memory smaller than the kernel needs");
}

// 16-byte asynchronous copy global -> shared (sm_80+), bypassing L1 (.cg): K/V are read once per CTA.
PS_DEVICE void cp_async_16(void* smem_dst, const void* gmem_src) {
  PS_CHECK_GLOBAL(gmem_src, 16);
#ifndef PAGEDSERVE_EMULATION
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem_dst)), "l"(gmem_src));
#else
  emu_cp_async_16(smem_dst, gmem_src);
#endif
}

PS_DEVICE void cp_async_commit() {
#ifndef PAGEDSERVE_EMULATION
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#else
  emu_cp_async_commit();
#endif
}

// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N> PS_DEVICE void cp_async_wait() {
#ifndef PAGEDSERVE_EMULATION
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else
  emu_cp_async_wait(N);
#endif
}

// ---------------------------------------------------------------------------------------------------
// Cross-CTA hand-off in global memory (the split-K merge): a CTA publishes results, fences, then counts
// itself with an atomic; the CTA that counts last reads everyone's results through L2.
// ---------------------------------------------------------------------------------------------------

// Makes this thread's earlier global writes visible device-wide before its later ones (and, after an
// atomic, orders the atomic before the reads that follow it).
PS_DEVICE void thread_fence() {
#ifndef PAGEDSERVE_EMULATION
  __threadfence();
#else
  emu_thread_fence();
#endif
}

PS_DEVICE u32 atomic_add_u32(u32* p, u32 v) {
  PS_CHECK_GLOBAL(p, 4);
#ifndef PAGEDSERVE_EMULATION
  return atomicAdd(p, v);
#else
  return emu_atomic_add(p, v);
#endif
}

// A float written by another CTA of the same launch: ld.global.cg reads L2, never a stale L1 line.
PS_DEVICE float load_cg(const float* p) {
  PS_CHECK_GLOBAL(p, 4);
#ifndef PAGEDSERVE_EMULATION
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
#else
  return *p;
#endif
}

PS_DEVICE void store_zero_16(void* smem_dst) {
  uint4 z;
  z.x = z.y = z.z = z.w = 0u;
  *reinterpret_cast<uint4*>(smem_dst) = z;
}

// ---------------------------------------------------------------------------------------------------
// Tensor-core fragments (mma.sync.m16n8k16, ldmatrix), lane l = 4 * g + t (g = l / 4, t = l % 4):
//   A (16x16, row-major): a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1],
//                         a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9]
//   B (16x8, "col"):      b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]
//   C (16x8 float):       c[0], c[1] = C[g][2t, 2t+1]; c[2], c[3] = C[g+8][2t, 2t+1]
// (two 16-bit elements per register, the lower index in the low half).
// ---------------------------------------------------------------------------------------------------

// ldmatrix .x4: lanes 8j..8j+7 give the addresses of rows 0..7 of 8x8 matrix j (16 bytes each, 16-byte
// aligned). Without .trans lane l receives r[j] = M_j[g][2t, 2t+1]; with .trans r[j] = M_j[2t, 2t+1][g].
PS_DEVICE void ldmatrix_x4(u32 r[4], const void* smem_row) {
#ifndef PAGEDSERVE_EMULATION
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
#else
  emu_ldmatrix_x4(r, smem_row, false);
#endif
}

PS_DEVICE void ldmatrix_x4_trans(u32 r[4], const void* smem_row) {
#ifndef PAGEDSERVE_EMULATION
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
#else
  emu_ldmatrix_x4(r, smem_row, true);
#endif
}

// c += A * B with float32 accumulation.
template <typename T> PS_DEVICE void mma_16816(float c[4], const u32 a[4], u32 b0, u32 b1);

template <> PS_DEVICE void mma_16816<bf16>(float c[4], const u32 a[4], u32 b0, u32 b1) {
#ifndef PAGEDSERVE_EMULATION
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  emu_mma_16816(c, a, b0, b1, /*fp16=*/false);
#endif
}

template <> PS_DEVICE void mma_16816<fp16>(float c[4], const u32 a[4], u32 b0, u32 b1) {
#ifndef PAGEDSERVE_EMULATION
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  emu_mma_16816(c, a, b0, b1, /*fp16=*/true);
#endif
}

// ---------------------------------------------------------------------------------------------------
// Warp-level attention steps shared by the decode and prefill kernels. One warp owns 16 query rows; keys
// and values are rows of a shared-memory tile with row stride `ld` elements.
// ---------------------------------------------------------------------------------------------------

// A fragments of the warp's 16 query rows (row-major in shared memory), for all D / 16 k-chunks.
// ldmatrix matrices: j = 0: rows 0-7, cols 0-7; j = 1: rows 8-15, cols 0-7; j = 2: rows 0-7, cols 8-15;
// j = 3: rows 8-15, cols 8-15 -- exactly a[0..3] above.
template <int D, typename T> PS_DEVICE void load_q_frags(u32 qf[D / 16][4], const T* sq, int ld) {
  const int lane = threadIdx.x & 31;
  const int j = lane >> 3, r = lane & 7;
  const T* row = sq + ((j & 1) * 8 + r) * ld + (j >> 1) * 8;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) ldmatrix_x4(qf[kc], row + kc * 16);
}

// s[n] (n-tile n = keys 8n..8n+7) = Q K^T for the warp's 16 rows and NT * 8 keys starting at sk.
// K rows are keys with D contiguous elements: B[k = d][n = key] is K read "column-major", so plain
// ldmatrix yields B fragments. Matrices: j = 0: keys 0-7, d 0-7 (b0 of n-tile 2p); j = 1: keys 0-7,
// d 8-15 (b1 of 2p); j = 2: keys 8-15, d 0-7 (b0 of 2p+1); j = 3: keys 8-15, d 8-15 (b1 of 2p+1).
template <typename T, int D, int NT> PS_DEVICE void warp_qk(float s[NT][4], const u32 qf[D / 16][4], const T* sk, int ld) {
  static_assert(NT % 2 == 0, "keys come in pairs of n-tiles");
  const int lane = threadIdx.x & 31;
  const int j = lane >> 3, r = lane & 7;
  const T* row = sk + ((j >> 1) * 8 + r) * ld + (j & 1) * 8;
#pragma unroll
  for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
    for (int p = 0; p < NT / 2; ++p) {
      u32 b[4];
      ldmatrix_x4(b, row + p * 16 * ld + kc * 16);
      mma_16816<T>(s[2 * p], qf[kc], b[0], b[1]);
      mma_16816<T>(s[2 * p + 1], qf[kc], b[2], b[3]);
    }
  }
}

// acc[n] (columns 8n..8n+7 of the output) += P V for NT * 8 keys starting at sv. P comes from the score
// accumulators: the C fragments of n-tiles 2p and 2p+1 are, element for element, the A fragment of
// k-chunk p. V rows are keys, so B[k = key][n = d] is V row-major: ldmatrix .trans yields B fragments.
// Matrices: j = 0: keys 0-7, d 0-7 (b0 of d-tile 2q); j = 1: keys 8-15, d 0-7 (b1 of 2q); j = 2:
// keys 0-7, d 8-15 (b0 of 2q+1); j = 3: keys 8-15, d 8-15 (b1 of 2q+1).
template <typename T, int D, int NT> PS_DEVICE void warp_pv(float acc[D / 8][4], const float p[NT][4], const T* sv, int ld) {
  const int lane = threadIdx.x & 31;
  const int j = lane >> 3, r = lane & 7;
  const T* row = sv + ((j & 1) * 8 + r) * ld + (j >> 1) * 8;
#pragma unroll
  for (int kp = 0; kp < NT / 2; ++kp) {
    u32 a[4];
    a[0] = pack2<T>(p[2 * kp][0], p[2 * kp][1]);
    a[1] = pack2<T>(p[2 * kp][2], p[2 * kp][3]);
    a[2] = pack2<T>(p[2 * kp + 1][0], p[2 * kp + 1][1]);
    a[3] = pack2<T>(p[2 * kp + 1][2], p[2 * kp + 1][3]);
#pragma unroll
    for (int q = 0; q < D / 16; ++q) {
      u32 b[4];
      ldmatrix_x4_trans(b, row + kp * 16 * ld + q * 16);
      mma_16816<T>(acc[2 * q], a, b[0], b[1]);
      mma_16816<T>(acc[2 * q + 1], a, b[2], b[3]);
    }
  }
}

// Online softmax over one block of scores (already scaled by scale * log2(e) and masked with -inf).
// Lane (g, t) holds rows g (h = 0: s[n][0..1]) and g + 8 (h = 1: s[n][2..3]); the 4 lanes of a quad share
// a row, so row maxima are reduced over lane bits 0 and 1. m is the running maximum (log2 domain), l this
// lane's share of the running denominator (reduced over the quad at the end), acc the unnormalised output.
// Scores become probabilities in place. A row that has seen only masked keys keeps m = -inf; exp2 is then
// taken relative to 0, so nothing turns into NaN.
template <int D, int NT> PS_DEVICE void online_softmax(float s[NT][4], float m[2], float l[2], float acc[D / 8][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = PS_NEG_INF;
#pragma unroll
    for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
    mx = fmaxf(mx, shfl_xor(mx, 1));
    mx = fmaxf(mx, shfl_xor(mx, 2));
    const float m_new = fmaxf(m[h], mx);
    const float base = (m_new == PS_NEG_INF) ? 0.0f : m_new;
    const float alpha = fast_exp2(m[h] - base);
    m[h] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      s[n][2 * h] = fast_exp2(s[n][2 * h] - base);
      s[n][2 * h + 1] = fast_exp2(s[n][2 * h + 1] - base);
      sum += s[n][2 * h] + s[n][2 * h + 1];
    }
    l[h] = l[h] * alpha + sum;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      acc[n][2 * h] *= alpha;
      acc[n][2 * h + 1] *= alpha;
    }
  }
}

// Copies one tile of TILE keys [tile_start, tile_start + TILE) of one KV head, K and V, from the paged
// cache into shared-memory rows of stride LD, zero-filling keys at and past key_end (nothing past the
// context is read). Vector c of the tile is key c / VECS, columns (c % VECS) * 8..+7: consecutive threads
// take consecutive 16-byte pieces of a head row, and rows of one block are contiguous, so reads coalesce.
template <typename T, int D, int LD, int TILE, int THREADS>
PS_DEVICE void load_kv_tile(T* k_dst, T* v_dst, const T* __restrict__ key_cache,
                            const T* __restrict__ value_cache, const int* table, int tile_start, int key_end,
                            int num_kv_heads, int kv_head, int block_size_log2, int tid) {
  constexpr int VECS = D / 8;
  const int block_mask = (1 << block_size_log2) - 1;
#pragma unroll
  for (int i = 0; i < TILE * VECS / THREADS; ++i) {
    const int c = tid + i * THREADS;
    const int key = c / VECS, col = (c % VECS) * 8;
    const int pos = tile_start + key;
    if (pos < key_end) {
      const int block = table[pos >> block_size_log2];
      const i64 src = ((static_cast<i64>(block) * num_kv_heads + kv_head) << block_size_log2 | (pos & block_mask)) * D + col;
      cp_async_16(k_dst + key * LD + col, key_cache + src);
      cp_async_16(v_dst + key * LD + col, value_cache + src);
    } else {
      store_zero_16(k_dst + key * LD + col);
      store_zero_16(v_dst + key * LD + col);
    }
  }
}
