// The decoder's elementwise steps that torch runs as many small operators (RMSNorm: six, rotary embedding of
// q and k: ten), each as one pass over the rows. The arithmetic is transformers' in the same order, so that
// results differ from torch's by the rounding of the sum of squares at most; no contraction into fused
// multiply-adds, which would round differently. bfloat16 rows go to the vector loops of paged_attention_impl.h
// (the widest this CPU runs, as torch's operators round each result); the float32 loops here vectorise as
// they are.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

// paged_attention_cpu.cpp: the bfloat16 loops, on rows [begin, end).
void norm_bf16_rows(uint16_t* out, long out_stride, uint16_t* residual, long residual_stride, const uint16_t* x,
                    long x_stride, const uint16_t* weight, const float* weight32, long begin, long end, int H,
                    float eps);
void rotary_bf16_rows(uint16_t* q, long q_stride, uint16_t* k, long k_stride, const uint16_t* cos,
                      const uint16_t* sin, long begin, long end, int hq, int hk, int D, int R);

namespace {

// Rows per task: a decode step's few rows stay on one thread, where waking the others would cost more.
constexpr int64_t ELEMENTS_PER_TASK = 1 << 15;

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, ELEMENTS_PER_TASK / std::max<int64_t>(row_elements, 1)); }

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " is [T, N] float32 or bfloat16 with contiguous rows");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has the dtype of the other tensors");
}

// A bfloat16 tensor's data as its bits.
uint16_t* bits(const at::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); }

// out[t] = weight * (h / sqrt(mean(h^2) + eps)) for h = x[t], as LlamaRMSNorm computes it in float32 (in
// bfloat16, the normalised row rounded before the weight's product; a float32 weight on bfloat16 rows, Gemma's
// 1 + w, multiplies before the one rounding, as Gemma's norm does); with a residual, h = residual[t] + x[t] is
// stored into residual first (the decoder's skip connection and the norm after it in one pass, bit for bit
// what the add and then the norm give).
void norm_rows(const at::Tensor& out, const at::Tensor* residual, const at::Tensor& x, const at::Tensor& weight,
               double eps) {
  const at::ScalarType dtype = x.scalar_type();
  check_rows(x, "x", dtype);
  check_rows(out, "out", dtype);
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(out.size(0) == T && out.size(1) == H, "out has x's shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous() &&
              (weight.scalar_type() == dtype || weight.scalar_type() == at::kFloat),
              "weight is [N] in x's dtype or float32");
  if (residual != nullptr) {
    check_rows(*residual, "residual", dtype);
    TORCH_CHECK(residual->size(0) == T && residual->size(1) == H, "residual has x's shape");
  }
  if (dtype == at::kBFloat16) {
    at::parallel_for(0, T, grain(H), [&](int64_t begin, int64_t end) {
      const bool weight32 = weight.scalar_type() == at::kFloat;
      norm_bf16_rows(bits(out), out.stride(0), residual != nullptr ? bits(*residual) : nullptr,
                     residual != nullptr ? residual->stride(0) : 0, bits(x), x.stride(0),
                     weight32 ? nullptr : bits(weight), weight32 ? weight.data_ptr<float>() : nullptr, begin, end,
                     (int)H, (float)eps);
    });
    return;
  }
  const float* xp = x.data_ptr<float>();
  float* rp = residual != nullptr ? residual->data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual != nullptr ? residual->stride(0) : 0, os = out.stride(0);
  const float epsf = (float)eps;
  at::parallel_for(0, T, grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const float* xr = xp + t * xs;
      if (rp != nullptr) {
        float* rr = rp + t * rs;
        for (int64_t k = 0; k < H; k++) rr[k] += xr[k];
        xr = rr;
      }
      float* o = op + t * os;
      float partial[8] = {};  // eight running sums: the loop vectorises and its chains overlap
      int64_t i = 0;
      for (; i + 8 <= H; i += 8)
        for (int j = 0; j < 8; j++) partial[j] += xr[i + j] * xr[i + j];
      float sum = 0.f;
      for (int j = 0; j < 8; j++) sum += partial[j];
      for (; i < H; i++) sum += xr[i] * xr[i];
      const float r = 1.f / std::sqrt(sum / (float)H + epsf);
      for (int64_t k = 0; k < H; k++) o[k] = w[k] * (xr[k] * r);
    }
  });
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  norm_rows(out, nullptr, x, weight, eps);
}

void add_rms_norm(at::Tensor out, at::Tensor residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  norm_rows(out, &residual, x, weight, eps);
}

// In place on q [T, Hq * D] and k [T, Hk * D]: the first R (rotary_dim) of each head's D values, x, become
// x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x[R/2:], x[:R/2]) and cos, sin the [T, R] rows of the
// tokens' positions, in the dtype of q and k (in bfloat16 each product and the sum rounded, as torch's three
// operators round them); the other D - R pass through (a partial rotary embedding, R < D).
void rotary(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim) {
  const at::ScalarType dtype = q.scalar_type();
  check_rows(q, "q", dtype);
  check_rows(k, "k", dtype);
  const int64_t T = q.size(0), D = head_dim;
  TORCH_CHECK(D > 0 && D % 2 == 0 && q.size(1) % D == 0 && k.size(1) % D == 0 && k.size(0) == T,
              "q and k are [T, heads * head_dim] with an even head_dim");
  if (T == 0) return;
  const int64_t R = cos.numel() / T, half = R / 2;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->is_contiguous() && t->numel() == T * R && R > 0 && R % 2 == 0 && R <= D &&
                t->scalar_type() == dtype,
                "cos and sin are [T, rotary_dim] (an even rotary_dim up to head_dim) in the dtype of q and k");
  const int64_t hq = q.size(1) / D, hk = k.size(1) / D;
  if (dtype == at::kBFloat16) {
    at::parallel_for(0, T, grain((hq + hk) * R), [&](int64_t begin, int64_t end) {
      rotary_bf16_rows(bits(q), q.stride(0), bits(k), k.stride(0), bits(cos), bits(sin), begin, end, (int)hq,
                       (int)hk, (int)D, (int)R);
    });
    return;
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0);
  at::parallel_for(0, T, grain((hq + hk) * R), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const float* c = cp + t * R;
      const float* s = sp + t * R;
      for (int64_t h = 0; h < hq + hk; h++) {
        float* x = h < hq ? qp + t * qs + h * D : kp + t * ks + (h - hq) * D;
        for (int64_t i = 0; i < half; i++) {
          const float a = x[i], b = x[i + half];
          x[i] = a * c[i] + (-b) * s[i];
          x[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
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
