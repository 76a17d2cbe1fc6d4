// CPU implementations of the pipeoptim ops: split the flat buffer across ATen's threads and run the
// loops compiled for the best instruction set this processor has.
#include <ATen/Parallel.h>
#include <cstdlib>

#include "../ops.h"
#include "entry_points.h"

namespace pipeoptim {
namespace cpu {
namespace {

// Chunks large enough to amortise a thread's start, small enough to balance two to dozens of cores.
constexpr int64_t kGrain = 1 << 16;

struct Isa {
  const char* name;
  decltype(&generic::predict) predict;
  decltype(&generic::adam_step_predict) adam;
  decltype(&generic::sgd_step_predict) sgd;
};

Isa pick_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return {"avx512", avx512::predict, avx512::adam_step_predict, avx512::sgd_step_predict};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return {"avx2", avx2::predict, avx2::adam_step_predict, avx2::sgd_step_predict};
#endif
  return {"generic", generic::predict, generic::adam_step_predict, generic::sgd_step_predict};
}

const Isa& isa() {
  static const Isa chosen = pick_isa();
  return chosen;
}

// Streaming (non-temporal) stores for a separate output buffer skip its read-for-ownership (4 of
// Adam's 20 bytes per element), but on the AMD EPYC virtual machines this was built on they measured
// slower than ordinary stores (64M fp32: 38 ms against 30 ms), so they are opt-in:
// PIPEOPTIM_CPU_STREAM=1. Only buffers well past the last-level cache can gain from them.
bool should_stream() {
  static const bool on = [] {
    const char* env = std::getenv("PIPEOPTIM_CPU_STREAM");
    return env != nullptr && env[0] == '1';
  }();
  return on;
}

char* byte_ptr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

void predict_cpu(const at::Tensor& w, const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& g,
                 const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& vc, const at::Tensor& out,
                 int64_t den, at::ArrayRef<double> coeffs) {
  check_buffer(w, w, "w");
  check_buffer(out, w, "out", false);
  TORCH_CHECK(den >= 0 && den <= 2, "pipeoptim::predict_: den must be 0, 1 or 2");
  const float *pm = opt_ptr(m, w, "m"), *pg = opt_ptr(g, w, "g"), *pv = opt_ptr(v, w, "v"), *pvc = opt_ptr(vc, w, "vc");
  TORCH_CHECK(den == 0 || pv != nullptr, "pipeoptim::predict_: v is required when den != 0");
  const PredictCoeffs c = predict_coeffs(coeffs);
  const int ok = out_kind(out);
  const bool in_place = out.data_ptr() == w.data_ptr();
  TORCH_CHECK(!in_place || ok == 0, "pipeoptim::predict_: in place needs a float32 out");
  const float* pw = w.data_ptr<float>();
  char* po = byte_ptr(out);
  const int64_t osz = out.element_size();
  const bool stream = !in_place && should_stream();
  const auto fn = isa().predict;
  at::parallel_for(0, w.numel(), kGrain, [&](int64_t b, int64_t e) {
    fn(e - b, pw + b, pm ? pm + b : nullptr, pg ? pg + b : nullptr, pv ? pv + b : nullptr,
       pvc ? pvc + b : nullptr, in_place ? static_cast<void*>(const_cast<float*>(pw + b)) : po + b * osz, ok,
       int(den), c, stream);
  });
}

void adam_step_predict_cpu(const at::Tensor& w, const at::Tensor& grad, const at::Tensor& m, const at::Tensor& v,
                           const std::optional<at::Tensor>& vmax, const at::Tensor& out, at::ArrayRef<double> coeffs) {
  check_buffer(w, w, "w");
  check_buffer(grad, w, "grad");
  check_buffer(m, w, "exp_avg");
  check_buffer(v, w, "exp_avg_sq");
  check_buffer(out, w, "out", false);
  TORCH_CHECK(out.data_ptr() != w.data_ptr(), "pipeoptim::adam_step_predict_: out must not be w");
  float* pvm = const_cast<float*>(opt_ptr(vmax, w, "max_exp_avg_sq"));
  const AdamStepCoeffs c = adam_coeffs(coeffs);
  const int ok = out_kind(out);
  float *pw = w.data_ptr<float>(), *pm = m.data_ptr<float>(), *pv = v.data_ptr<float>();
  const float* pg = grad.data_ptr<float>();
  char* po = byte_ptr(out);
  const int64_t osz = out.element_size();
  const bool stream = should_stream();
  const auto fn = isa().adam;
  at::parallel_for(0, w.numel(), kGrain, [&](int64_t b, int64_t e) {
    fn(e - b, pw + b, pg + b, pm + b, pv + b, pvm ? pvm + b : nullptr, po + b * osz, ok, c, stream);
  });
}

void sgd_step_predict_cpu(const at::Tensor& w, const at::Tensor& grad, const std::optional<at::Tensor>& buf,
                          const at::Tensor& out, bool nesterov, bool first, at::ArrayRef<double> coeffs) {
  check_buffer(w, w, "w");
  check_buffer(grad, w, "grad");
  check_buffer(out, w, "out", false);
  TORCH_CHECK(out.data_ptr() != w.data_ptr(), "pipeoptim::sgd_step_predict_: out must not be w");
  float* pb = const_cast<float*>(opt_ptr(buf, w, "momentum_buffer"));
  const SgdStepCoeffs c = sgd_coeffs(coeffs);
  const int ok = out_kind(out);
  float* pw = w.data_ptr<float>();
  const float* pg = grad.data_ptr<float>();
  char* po = byte_ptr(out);
  const int64_t osz = out.element_size();
  const bool stream = should_stream();
  const auto fn = isa().sgd;
  at::parallel_for(0, w.numel(), kGrain, [&](int64_t b, int64_t e) {
    fn(e - b, pw + b, pg + b, pb ? pb + b : nullptr, po + b * osz, ok, nesterov, first, c, stream);
  });
}

}  // namespace

const char* selected_isa() { return isa().name; }

}  // namespace cpu
}  // namespace pipeoptim

TORCH_LIBRARY_IMPL(pipeoptim, CPU, m) {
  m.impl("predict_", &pipeoptim::cpu::predict_cpu);
  m.impl("adam_step_predict_", &pipeoptim::cpu::adam_step_predict_cpu);
  m.impl("sgd_step_predict_", &pipeoptim::cpu::sgd_step_predict_cpu);
}
