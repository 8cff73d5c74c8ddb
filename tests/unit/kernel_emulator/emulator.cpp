// The kernels compiled for the host against emulator.h, with the CTA scheduler and the C entry points
// (emu_configure, emu_launch) that tests/unit/test_kernels_cpu.py calls through ctypes. Built with
// -I executor_svc/kernels and -DEMU_KERNEL_LIST(X)=X(name) X(name) ..., one per kernel.
#include "emulator.h"

#include "cache_write.cu"
#include "paged_decode.cu"
#include "paged_prefill.cu"

namespace emu {
static void fiber_main() {
  S.body();
  S.threads[S.cur].done = true;
  emu_flush_groups(S.threads[S.cur], 0);  // copies still in flight land anyway
  --S.alive;
  ++S.progress;
  if (S.cta_arrived > 0 && S.cta_arrived == S.alive) {  // the others wait at a barrier the exited thread skips
    S.cta_arrived = 0;
    ++S.cta_gen;
  }
}

static int run_cta(unsigned nthreads, size_t smem_bytes) {
  S.smem.assign(smem_bytes, 0xff);  // NaN in every float format: a read of unwritten shared memory shows
  S.threads.assign(nthreads, Thread());
  if (S.stacks.size() < nthreads) S.stacks.resize(nthreads);
  S.cta_arrived = 0;
  for (int w = 0; w < 32; ++w) S.warp_arrived[w] = 0, S.warp_gen[w] = 0;
  S.alive = static_cast<int>(nthreads);
  for (unsigned i = 0; i < nthreads; ++i) {
    auto& t = S.threads[i];
    t.idx.x = i % S.block_dim.x;
    t.idx.y = (i / S.block_dim.x) % S.block_dim.y;
    t.idx.z = i / (S.block_dim.x * S.block_dim.y);
    S.stacks[i].resize(1 << 18);
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = S.stacks[i].data();
    t.ctx.uc_stack.ss_size = S.stacks[i].size();
    t.ctx.uc_link = &S.scheduler;
    makecontext(&t.ctx, fiber_main, 0);
  }
  // Round robin keeps the warps in lockstep; the warp-serial orders run one warp until it is done or
  // parked at a CTA barrier before the next warp starts, so a warp runs ahead of the others the way a
  // missing __syncthreads would let it on hardware.
  const unsigned nwarps = (nthreads + 31) / 32;
  auto runnable = [&](unsigned i) {
    const Thread& t = S.threads[i];
    return !t.done && !(t.at_barrier && t.wait_gen == S.cta_gen);
  };
  auto resume = [&](unsigned i) {
    S.cur = static_cast<int>(i);
    swapcontext(&S.scheduler, &S.threads[i].ctx);
    return S.error.empty();
  };
  int stalled = 0;
  for (;;) {
    const long before = S.progress;
    if (S.order == 0) {
      for (unsigned i = 0; i < nthreads; ++i)
        if (!S.threads[i].done && !resume(i)) return -1;
    } else {
      for (unsigned k = 0; k < nwarps; ++k) {
        const unsigned w = S.order == 1 ? k : nwarps - 1 - k;
        const unsigned first = 32 * w, last = std::min(nthreads, first + 32);
        for (int spins = 0;; ++spins) {
          bool any = false;
          for (unsigned i = first; i < last; ++i)
            if (runnable(i)) {
              any = true;
              if (!resume(i)) return -1;
            }
          if (!any || spins > (1 << 22)) break;
        }
      }
    }
    bool all_done = true;
    for (unsigned i = 0; i < nthreads; ++i) all_done = all_done && S.threads[i].done;
    if (all_done) return 0;
    if (S.progress == before && ++stalled > 2) {
      S.error = "deadlock: threads wait at a barrier that others never reach";
      return -1;
    }
    if (S.progress != before) stalled = 0;
  }
}

template <class... A, size_t... I>
std::function<void()> bind_impl(void (*f)(A...), void** args, std::index_sequence<I...>) {
  auto values = std::make_tuple(*static_cast<A*>(args[I])...);
  return [f, values] { std::apply(f, values); };
}
template <class... A> std::function<void()> bind(void (*f)(A...), void** args) {
  return bind_impl(f, args, std::index_sequence_for<A...>{});
}

struct Entry { const char* name; std::function<void()> (*make)(void**); };
#define EMU_ENTRY(NAME) {#NAME, [](void** a) { return bind(NAME, a); }},
static const Entry kEntries[] = {EMU_KERNEL_LIST(EMU_ENTRY)};
}  // namespace emu

extern "C" void emu_configure(int eager_copies, int order, int reverse_grid) {
  emu::S.eager_copies = eager_copies != 0;
  emu::S.order = order;
  emu::S.reverse_grid = reverse_grid != 0;
}

extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, unsigned smem, void** args, const void* const* range_ptrs,
                          const unsigned long long* range_bytes, int num_ranges, char* error, int error_len) {
  using namespace emu;
  S.error.clear();
  S.ranges.clear();
  S.check_ranges = num_ranges >= 0;
  for (int i = 0; i < num_ranges; ++i) S.ranges.push_back({static_cast<const char*>(range_ptrs[i]), range_bytes[i]});
  const Entry* entry = nullptr;
  for (auto& e : kEntries)
    if (strcmp(e.name, name) == 0) entry = &e;
  int rc = 0;
  if (entry == nullptr) {
    S.error = std::string("unknown kernel ") + name;
    rc = -1;
  } else if (bx * by * bz > 1024 || bx * by * bz % 32) {
    S.error = "block size must be a multiple of 32, at most 1024";
    rc = -1;
  } else {
    S.body = entry->make(args);
    S.grid_dim = {gx, gy, gz};
    S.block_dim = {bx, by, bz};
    const unsigned long long ctas = static_cast<unsigned long long>(gx) * gy * gz;
    for (unsigned long long i = 0; i < ctas && rc == 0; ++i) {
      const unsigned long long k = S.reverse_grid ? ctas - 1 - i : i;  // x fastest, then y, then z
      S.block_idx = {static_cast<unsigned>(k % gx), static_cast<unsigned>(k / gx % gy),
                     static_cast<unsigned>(k / gx / gy)};
      rc = run_cta(bx * by * bz, smem);
    }
  }
  snprintf(error, static_cast<size_t>(error_len), "%s", S.error.c_str());
  return rc;
}
