// The decoder's elementwise steps that torch runs as many small operators (RMSNorm: six, rotary embedding of
// q and k: ten), each as one pass over the rows, in float32 or bfloat16. The arithmetic is transformers' in the
// same order, each bfloat16 result rounded where torch's operators round it (to nearest even), so that results
// differ from torch's by the rounding of the sum of squares at most; no contraction into fused multiply-adds,
// which would round differently.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

// Rows per task: a decode step's few rows stay on one thread, where waking the others would cost more.
constexpr int64_t ELEMENTS_PER_TASK = 1 << 15;

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, ELEMENTS_PER_TASK / std::max<int64_t>(row_elements, 1)); }

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " is [T, N] float32 or bfloat16 with contiguous rows");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has the dtype of the other tensors");
}

// A value as float, and a float rounded to T as torch's operators round their results (float: as it is).
inline float f32(float x) { return x; }
inline float f32(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline T round_to(float x) { return T(x); }

// Calls body with a value of the C++ type of dtype (float32 or bfloat16, checked before), which names it.
template <typename Body>
void for_dtype(at::ScalarType dtype, Body&& body) {
  if (dtype == at::kBFloat16)
    body(c10::BFloat16());
  else
    body(0.f);
}

// out[t] = weight * (h / sqrt(mean(h^2) + eps)) for h = x[t], as LlamaRMSNorm computes it in float32 (the
// normalised row rounded to the dtype before the weight's product); with a residual, h = residual[t] + x[t] is
// stored into residual first (the decoder's skip connection and the norm after it in one pass, bit for bit
// what the add and then the norm give).
void norm_rows(const at::Tensor& out, const at::Tensor* residual, const at::Tensor& x, const at::Tensor& weight,
               double eps) {
  const at::ScalarType dtype = x.scalar_type();
  check_rows(x, "x", dtype);
  check_rows(out, "out", dtype);
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(out.size(0) == T && out.size(1) == H, "out has x's shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous() && weight.scalar_type() == dtype,
              "weight is [N] in x's dtype");
  if (residual != nullptr) {
    check_rows(*residual, "residual", dtype);
    TORCH_CHECK(residual->size(0) == T && residual->size(1) == H, "residual has x's shape");
  }
  const float epsf = (float)eps;
  for_dtype(dtype, [&](auto tag) {
    using E = decltype(tag);
    const E* xp = x.data_ptr<E>();
    E* rp = residual != nullptr ? residual->data_ptr<E>() : nullptr;
    const E* w = weight.data_ptr<E>();
    E* op = out.data_ptr<E>();
    const int64_t xs = x.stride(0), rs = residual != nullptr ? residual->stride(0) : 0, os = out.stride(0);
    at::parallel_for(0, T, grain(H), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; t++) {
        const E* xr = xp + t * xs;
        if (rp != nullptr) {
          E* rr = rp + t * rs;
          for (int64_t k = 0; k < H; k++) rr[k] = round_to<E>(f32(rr[k]) + f32(xr[k]));
          xr = rr;
        }
        E* o = op + t * os;
        float partial[8] = {};  // eight running sums: the loop vectorises and its chains overlap
        int64_t i = 0;
        for (; i + 8 <= H; i += 8)
          for (int j = 0; j < 8; j++) partial[j] += f32(xr[i + j]) * f32(xr[i + j]);
        float sum = 0.f;
        for (int j = 0; j < 8; j++) sum += partial[j];
        for (; i < H; i++) sum += f32(xr[i]) * f32(xr[i]);
        const float r = 1.f / std::sqrt(sum / (float)H + epsf);
        for (int64_t k = 0; k < H; k++) o[k] = round_to<E>(f32(w[k]) * f32(round_to<E>(f32(xr[k]) * r)));
      }
    });
  });
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  norm_rows(out, nullptr, x, weight, eps);
}

void add_rms_norm(at::Tensor out, at::Tensor residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  norm_rows(out, &residual, x, weight, eps);
}

// In place on q [T, Hq * D] and k [T, Hk * D]: each head's x becomes x * cos + rotate_half(x) * sin, with
// rotate_half(x) = (-x[D/2:], x[:D/2]) and cos, sin the [T, D] rows of the tokens' positions, in the dtype of q
// and k (each product and the sum rounded to it, as torch's three operators do).
void rotary(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim) {
  const at::ScalarType dtype = q.scalar_type();
  check_rows(q, "q", dtype);
  check_rows(k, "k", dtype);
  const int64_t T = q.size(0), D = head_dim, half = D / 2;
  TORCH_CHECK(D > 0 && D % 2 == 0 && q.size(1) % D == 0 && k.size(1) % D == 0 && k.size(0) == T,
              "q and k are [T, heads * head_dim] with an even head_dim");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->is_contiguous() && t->numel() == T * D && t->scalar_type() == dtype,
                "cos and sin are [T, head_dim] in the dtype of q and k");
  const int64_t hq = q.size(1) / D, hk = k.size(1) / D;
  const int64_t qs = q.stride(0), ks = k.stride(0);
  for_dtype(dtype, [&](auto tag) {
    using E = decltype(tag);
    const E* cp = cos.data_ptr<E>();
    const E* sp = sin.data_ptr<E>();
    E* qp = q.data_ptr<E>();
    E* kp = k.data_ptr<E>();
    at::parallel_for(0, T, grain((hq + hk) * D), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; t++) {
        const E* c = cp + t * D;
        const E* s = sp + t * D;
        for (int64_t h = 0; h < hq + hk; h++) {
          E* x = h < hq ? qp + t * qs + h * D : kp + t * ks + (h - hq) * D;
          for (int64_t i = 0; i < half; i++) {
            const float a = f32(x[i]), b = f32(x[i + half]);
            x[i] = round_to<E>(f32(round_to<E>(a * f32(c[i]))) + f32(round_to<E>((-b) * f32(s[i]))));
            x[i + half] = round_to<E>(f32(round_to<E>(b * f32(c[i + half]))) + f32(round_to<E>(a * f32(s[i + half]))));
          }
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor x, Tensor weight, float eps) -> ()");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rotary", rotary);
}
