// The linear layers of a step with few rows (decodes): out = x weight^T (+ bias) with the output features split
// evenly across torch's threads, each thread computing its share as one single-threaded matrix product. MKL's
// own split of such a product across threads left them waiting on each other: at 64 rows SmolLM2's float32
// layers ran about 1.3x faster this way on two cores (bfloat16, through oneDNN, 4-7%). With many rows (prefill
// chunks) MKL's threading is as fast or faster; the model keeps it there (models/llama.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <exception>
#include <optional>

namespace {

constexpr int64_t MIN_FEATURES_PER_THREAD = 64;
constexpr int64_t FEATURE_ALIGN = 16;  // each share starts on a whole vector (and cache line) of features

at::Tensor split_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x is [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && x.device() == weight.device(),
              "x and weight share a dtype and a device");
  const int64_t N = weight.size(0);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == x.scalar_type()),
              "bias is [N] in the dtype of x");
  // An inference op (it has no gradient): the products below skip autograd even where the weights require grad.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();  // rows may be strided (the MLP's gate half)
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N / MIN_FEATURES_PER_THREAD));
  std::exception_ptr error;
  const at::ThreadLocalState caller_state;  // the caller's modes (autograd's above all), as at::parallel_for passes them
  // Inside the parallel region each product runs on its own thread only (no nested parallelism).
#pragma omp parallel num_threads(threads)
  {
    const at::ThreadLocalStateGuard same_state(caller_state);
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t begin = N * t / n / FEATURE_ALIGN * FEATURE_ALIGN;
    const int64_t end = t + 1 == n ? N : N * (t + 1) / n / FEATURE_ALIGN * FEATURE_ALIGN;
    try {
      if (end > begin) {
        at::Tensor share = out.narrow(1, begin, end - begin);
        const at::Tensor w = weight.narrow(0, begin, end - begin).t();
        if (bias.has_value())
          at::addmm_out(share, bias->narrow(0, begin, end - begin), xc, w);
        else
          at::mm_out(share, xc, w);
      }
    } catch (...) {
#pragma omp critical
      error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("split_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("split_linear", split_linear);
}
