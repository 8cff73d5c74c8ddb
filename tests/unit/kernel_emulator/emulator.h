// Host emulation of the CUDA kernels: each CTA runs as cooperative fibers (one per CUDA thread) that
// switch only at barriers and warp-collective operations, with shared memory poisoned (NaN bytes) at CTA
// start, cp.async copies deferred until their group is waited on, and every global access range-checked.
// The kernel sources, included after this header, see it in place of the CUDA runtime; emulator.cpp
// holds the scheduler that runs them.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

using std::max;
using std::min;

#define PAGEDSERVE_EMULATION 1
#define __global__
#define __device__
#define __forceinline__
#define __launch_bounds__(n)

struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct EmuDim { unsigned x = 1, y = 1, z = 1; };

namespace emu {
struct Copy { void* dst; const void* src; };
struct Thread {
  ucontext_t ctx;
  EmuDim idx;
  bool done = false;
  bool at_barrier = false;  // waiting in __syncthreads for generation wait_gen to end
  long wait_gen = 0;
  std::vector<Copy> open;
  std::vector<std::vector<Copy>> groups;
};
struct State {
  EmuDim block_idx, block_dim, grid_dim;
  std::vector<unsigned char> smem;
  std::vector<Thread> threads;
  std::vector<std::vector<char>> stacks;
  int cur = 0, alive = 0;
  ucontext_t scheduler;
  int cta_arrived = 0;
  long cta_gen = 0;
  int warp_arrived[32];
  long warp_gen[32];
  unsigned int xchg[32][32][6];
  const void* xptr[32][32];
  std::function<void()> body;
  std::vector<std::pair<const char*, size_t>> ranges;
  bool check_ranges = true;
  bool eager_copies = false;  // cp.async lands at issue (exposes write-after-read races) or at its wait
  int order = 0;  // 0: round robin over threads; 1: warp by warp, first to last; 2: last to first
  bool reverse_grid = false;  // CTAs last to first: whichever CTA of a split-K row counts last must merge
  std::string error;
  long progress = 0;
};
State S;
}  // namespace emu

#define threadIdx (emu::S.threads[emu::S.cur].idx)
#define blockIdx (emu::S.block_idx)
#define blockDim (emu::S.block_dim)
#define gridDim (emu::S.grid_dim)

static void emu_yield() { swapcontext(&emu::S.threads[emu::S.cur].ctx, &emu::S.scheduler); }

[[noreturn]] static void emu_trap(const char* why) {
  if (emu::S.error.empty()) {
    char where[160];
    snprintf(where, sizeof where, " (block %u,%u,%u thread %u)", emu::S.block_idx.x, emu::S.block_idx.y,
             emu::S.block_idx.z, threadIdx.x);
    emu::S.error = std::string(why) + where;
  }
  emu::S.threads[emu::S.cur].done = true;
  for (;;) emu_yield();  // never resumed: the scheduler abandons the launch
}

static void emu_check_global(const void* p, size_t bytes) {
  if (!emu::S.check_ranges) return;
  const char* c = static_cast<const char*>(p);
  for (auto& r : emu::S.ranges)
    if (c >= r.first && c + bytes <= r.first + r.second) return;
  emu_trap("global access outside every argument tensor");
}

static void emu_check_smem(const void* p, size_t bytes) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (c < emu::S.smem.data() || c + bytes > emu::S.smem.data() + emu::S.smem.size())
    emu_trap("shared access outside the dynamic shared memory");
  if (reinterpret_cast<uintptr_t>(c) % 16) emu_trap("shared access not 16-byte aligned");
}

static unsigned char* emu_smem() { return emu::S.smem.data(); }
static unsigned emu_smem_bytes() { return static_cast<unsigned>(emu::S.smem.size()); }

static void __syncthreads() {
  auto& s = emu::S;
  const long gen = s.cta_gen;
  if (++s.cta_arrived == s.alive) {
    s.cta_arrived = 0;
    ++s.cta_gen;
    ++s.progress;
    return;
  }
  auto& me = s.threads[s.cur];
  me.at_barrier = true;
  me.wait_gen = gen;
  while (s.cta_gen == gen) emu_yield();
  me.at_barrier = false;
}

static void emu_warp_sync() {
  auto& s = emu::S;
  const int w = threadIdx.x / 32;
  const long gen = s.warp_gen[w];
  if (++s.warp_arrived[w] == 32) {
    s.warp_arrived[w] = 0;
    ++s.warp_gen[w];
    ++s.progress;
    return;
  }
  while (s.warp_gen[w] == gen) emu_yield();
}

static float emu_shfl_xor(float v, int mask) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  memcpy(&emu::S.xchg[w][l][0], &v, 4);
  emu_warp_sync();
  float r;
  memcpy(&r, &emu::S.xchg[w][l ^ mask][0], 4);
  emu_warp_sync();
  return r;
}

static void emu_ldmatrix_x4(unsigned int r[4], const void* row, bool trans) {
  emu_check_smem(row, 16);
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  const int g = l >> 2, t = l & 3;
  emu::S.xptr[w][l] = row;
  emu_warp_sync();
  for (int j = 0; j < 4; ++j) {
    if (!trans) {  // r[j] = M_j[g][2t, 2t+1]
      const unsigned short* m = static_cast<const unsigned short*>(emu::S.xptr[w][8 * j + g]);
      r[j] = m[2 * t] | (static_cast<unsigned int>(m[2 * t + 1]) << 16);
    } else {  // r[j] = M_j[2t, 2t+1][g]
      const unsigned short* m0 = static_cast<const unsigned short*>(emu::S.xptr[w][8 * j + 2 * t]);
      const unsigned short* m1 = static_cast<const unsigned short*>(emu::S.xptr[w][8 * j + 2 * t + 1]);
      r[j] = m0[g] | (static_cast<unsigned int>(m1[g]) << 16);
    }
  }
  emu_warp_sync();
}

static float emu_half_bits(unsigned short bits, bool fp16) {
  if (fp16) {
    _Float16 h;
    memcpy(&h, &bits, 2);
    return static_cast<float>(h);
  }
  unsigned int u = static_cast<unsigned int>(bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// mma.m16n8k16: gathers the 32 lanes' fragments into A (16x16) and B (16x8) following the PTX ISA
// fragment tables, then each lane computes its own four C elements.
static void emu_mma_16816(float c[4], const unsigned int a[4], unsigned int b0, unsigned int b1, bool fp16) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  unsigned int* x = emu::S.xchg[w][l];
  x[0] = a[0]; x[1] = a[1]; x[2] = a[2]; x[3] = a[3]; x[4] = b0; x[5] = b1;
  emu_warp_sync();
  float A[16][16], B[16][8];
  for (int L = 0; L < 32; ++L) {
    const int g = L >> 2, t = L & 3;
    const unsigned int* y = emu::S.xchg[w][L];
    auto lo = [&](unsigned int v) { return emu_half_bits(static_cast<unsigned short>(v & 0xffff), fp16); };
    auto hi = [&](unsigned int v) { return emu_half_bits(static_cast<unsigned short>(v >> 16), fp16); };
    A[g][2 * t] = lo(y[0]);         A[g][2 * t + 1] = hi(y[0]);
    A[g + 8][2 * t] = lo(y[1]);     A[g + 8][2 * t + 1] = hi(y[1]);
    A[g][2 * t + 8] = lo(y[2]);     A[g][2 * t + 9] = hi(y[2]);
    A[g + 8][2 * t + 8] = lo(y[3]); A[g + 8][2 * t + 9] = hi(y[3]);
    B[2 * t][g] = lo(y[4]);         B[2 * t + 1][g] = hi(y[4]);
    B[2 * t + 8][g] = lo(y[5]);     B[2 * t + 9][g] = hi(y[5]);
  }
  const int g = l >> 2, t = l & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
    c[i] += sum;
  }
  emu_warp_sync();
}

static void emu_cp_async_16(void* dst, const void* src) {
  emu_check_smem(dst, 16);
  if (reinterpret_cast<uintptr_t>(src) % 16) emu_trap("cp.async source not 16-byte aligned");
  if (emu::S.eager_copies)
    memcpy(dst, src, 16);
  else
    emu::S.threads[emu::S.cur].open.push_back({dst, src});
}

static void emu_cp_async_commit() {
  auto& t = emu::S.threads[emu::S.cur];
  t.groups.push_back(std::move(t.open));
  t.open.clear();
}

static void emu_flush_groups(emu::Thread& t, size_t keep) {
  while (t.groups.size() > keep) {
    for (auto& c : t.groups.front()) memcpy(c.dst, c.src, 16);
    t.groups.erase(t.groups.begin());
  }
}

static void emu_cp_async_wait(int n) { emu_flush_groups(emu::S.threads[emu::S.cur], static_cast<size_t>(n)); }

static unsigned short emu_float_to_bf16(float x) {
  unsigned int u;
  memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<unsigned short>(u >> 16);
}

static float emu_fp16_to_float(unsigned short bits) { return emu_half_bits(bits, true); }

static unsigned short emu_float_to_fp16(float x) {
  _Float16 h = static_cast<_Float16>(x);
  unsigned short bits;
  memcpy(&bits, &h, 2);
  return bits;
}

// CTAs run one after another, so a fence has nothing to order and an atomic is a plain read-modify-write;
// what the emulator checks is the counting logic, under both grid orders (emu_configure).
static void emu_thread_fence() {}

static unsigned int emu_atomic_add(unsigned int* p, unsigned int v) {
  const unsigned int old = *p;
  *p = old + v;
  return old;
}
