// Shared by the CPU and CUDA op implementations: argument checks and unpacking of the scalar lists
// that pipeoptim_kernels/compiled.py builds. The Python layer validates arguments first with messages
// for users; these checks only guard the raw pointers against a caller that skips it.
#pragma once
#include <torch/library.h>
#include <ATen/ATen.h>

#include "rules.h"

namespace pipeoptim {

inline int out_kind(const at::Tensor& out) {
  switch (out.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, "pipeoptim: out must be float32, bfloat16 or float16, got ", out.scalar_type());
  }
}

inline void check_buffer(const at::Tensor& t, const at::Tensor& w, const char* name, bool fp32 = true) {
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "pipeoptim: ", name, " must be a contiguous 1-D buffer");
  TORCH_CHECK(t.numel() == w.numel(), "pipeoptim: ", name, " has ", t.numel(), " elements, w has ", w.numel());
  TORCH_CHECK(t.device() == w.device(), "pipeoptim: ", name, " is on ", t.device(), ", w on ", w.device());
  TORCH_CHECK(!fp32 || t.scalar_type() == at::kFloat, "pipeoptim: ", name, " must be float32");
}

inline const float* opt_ptr(const std::optional<at::Tensor>& t, const at::Tensor& w, const char* name) {
  if (!t.has_value()) return nullptr;
  check_buffer(*t, w, name);
  return t->data_ptr<float>();
}

inline PredictCoeffs predict_coeffs(at::ArrayRef<double> c) {
  TORCH_CHECK(c.size() == 7, "pipeoptim::predict_: expected 7 coefficients, got ", c.size());
  return {float(c[0]), float(c[1]), float(c[2]), float(c[3]), float(c[4]), float(c[5]), float(c[6])};
}

inline AdamStepCoeffs adam_coeffs(at::ArrayRef<double> c) {
  TORCH_CHECK(c.size() == 11, "pipeoptim::adam_step_predict_: expected 11 coefficients, got ", c.size());
  return {float(c[0]), float(c[1]), float(c[2]), float(c[3]), float(c[4]), float(c[5]),
          float(c[6]), float(c[7]), float(c[8]), float(c[9]), float(c[10])};
}

inline SgdStepCoeffs sgd_coeffs(at::ArrayRef<double> c) {
  TORCH_CHECK(c.size() == 6, "pipeoptim::sgd_step_predict_: expected 6 coefficients, got ", c.size());
  return {float(c[0]), float(c[1]), float(c[2]), float(c[3]), float(c[4]), float(c[5])};
}

// Checked raw views of each op's arguments: the CPU and CUDA implementations share the checks and
// differ only in how they run the loop.
struct PredictArgs {
  int64_t n;
  const float *w, *m, *g, *v, *vc;
  void* out;
  int out_kind;
  int den;
  bool in_place;
  PredictCoeffs c;
};

inline PredictArgs predict_args(const at::Tensor& w, const std::optional<at::Tensor>& m,
                                const std::optional<at::Tensor>& g, const std::optional<at::Tensor>& v,
                                const std::optional<at::Tensor>& vc, const at::Tensor& out, int64_t den,
                                at::ArrayRef<double> coeffs) {
  check_buffer(w, w, "w");
  check_buffer(out, w, "out", false);
  TORCH_CHECK(den >= 0 && den <= 2, "pipeoptim::predict_: den must be 0, 1 or 2");
  PredictArgs a{w.numel(), w.data_ptr<float>(), opt_ptr(m, w, "m"), opt_ptr(g, w, "g"), opt_ptr(v, w, "v"),
                opt_ptr(vc, w, "vc"), out.data_ptr(), out_kind(out), int(den), false, predict_coeffs(coeffs)};
  TORCH_CHECK(den == 0 || a.v != nullptr, "pipeoptim::predict_: v is required when den != 0");
  a.in_place = a.out == static_cast<const void*>(a.w);
  TORCH_CHECK(!a.in_place || a.out_kind == 0, "pipeoptim::predict_: in place needs a float32 out");
  return a;
}

struct AdamArgs {
  int64_t n;
  float* w;
  const float* g;
  float *m, *v, *vmax;
  void* out;
  int out_kind;
  AdamStepCoeffs c;
};

inline AdamArgs adam_args(const at::Tensor& w, const at::Tensor& grad, const at::Tensor& m, const at::Tensor& v,
                          const std::optional<at::Tensor>& vmax, const at::Tensor& out, at::ArrayRef<double> coeffs) {
  check_buffer(w, w, "w");
  check_buffer(grad, w, "grad");
  check_buffer(m, w, "exp_avg");
  check_buffer(v, w, "exp_avg_sq");
  check_buffer(out, w, "out", false);
  TORCH_CHECK(out.data_ptr() != w.data_ptr(), "pipeoptim::adam_step_predict_: out must not be w");
  return {w.numel(), w.data_ptr<float>(), grad.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
          const_cast<float*>(opt_ptr(vmax, w, "max_exp_avg_sq")), out.data_ptr(), out_kind(out), adam_coeffs(coeffs)};
}

struct SgdArgs {
  int64_t n;
  float* w;
  const float* g;
  float* buf;
  void* out;
  int out_kind;
  SgdStepCoeffs c;
};

inline SgdArgs sgd_args(const at::Tensor& w, const at::Tensor& grad, const std::optional<at::Tensor>& buf,
                        const at::Tensor& out, at::ArrayRef<double> coeffs) {
  check_buffer(w, w, "w");
  check_buffer(grad, w, "grad");
  check_buffer(out, w, "out", false);
  TORCH_CHECK(out.data_ptr() != w.data_ptr(), "pipeoptim::sgd_step_predict_: out must not be w");
  return {w.numel(), w.data_ptr<float>(), grad.data_ptr<float>(),
          const_cast<float*>(opt_ptr(buf, w, "momentum_buffer")), out.data_ptr(), out_kind(out), sgd_coeffs(coeffs)};
}

// The *_into_grad_ ops are the step+predict ops with the gradient as the output: one definition for
// every device, over that device's step+predict implementation.
using AdamStepPredictFn = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&, const at::Tensor&, at::ArrayRef<double>);
using SgdStepPredictFn = void (*)(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                  const at::Tensor&, bool, bool, at::ArrayRef<double>);

template <AdamStepPredictFn Step>
void adam_step_predict_into_grad(const at::Tensor& w, const at::Tensor& grad, const at::Tensor& m, const at::Tensor& v,
                                 const std::optional<at::Tensor>& vmax, at::ArrayRef<double> coeffs) {
  Step(w, grad, m, v, vmax, grad, coeffs);
}

template <SgdStepPredictFn Step>
void sgd_step_predict_into_grad(const at::Tensor& w, const at::Tensor& grad, const std::optional<at::Tensor>& buf,
                                bool nesterov, bool first, at::ArrayRef<double> coeffs) {
  Step(w, grad, buf, grad, nesterov, first, coeffs);
}

}  // namespace pipeoptim
