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
  TORCH_CHECK(c.size() == 10, "pipeoptim::adam_step_predict_: expected 10 coefficients, got ", c.size());
  return {float(c[0]), float(c[1]), float(c[2]), float(c[3]), float(c[4]),
          float(c[5]), float(c[6]), float(c[7]), float(c[8]), float(c[9])};
}

inline SgdStepCoeffs sgd_coeffs(at::ArrayRef<double> c) {
  TORCH_CHECK(c.size() == 6, "pipeoptim::sgd_step_predict_: expected 6 coefficients, got ", c.size());
  return {float(c[0]), float(c[1]), float(c[2]), float(c[3]), float(c[4]), float(c[5])};
}

}  // namespace pipeoptim
