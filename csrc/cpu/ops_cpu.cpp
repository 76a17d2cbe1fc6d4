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

template <typename T>
T* at_offset(T* p, int64_t o) { return p ? p + o : nullptr; }

void predict_cpu(const at::Tensor& w, const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& g,
                 const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& vc, const at::Tensor& out,
                 int64_t den, at::ArrayRef<double> coeffs) {
  const PredictArgs a = predict_args(w, m, g, v, vc, out, den, coeffs);
  const int64_t osz = out.element_size();
  const bool stream = !a.in_place && should_stream();
  const auto fn = isa().predict;
  at::parallel_for(0, a.n, kGrain, [&](int64_t b, int64_t e) {
    void* o = a.in_place ? static_cast<void*>(const_cast<float*>(a.w + b)) : static_cast<char*>(a.out) + b * osz;
    fn(e - b, a.w + b, at_offset(a.m, b), at_offset(a.g, b), at_offset(a.v, b), at_offset(a.vc, b), o, a.out_kind,
       a.den, a.c, stream);
  });
}

void adam_step_predict_cpu(const at::Tensor& w, const at::Tensor& grad, const at::Tensor& m, const at::Tensor& v,
                           const std::optional<at::Tensor>& vmax, const at::Tensor& out, at::ArrayRef<double> coeffs) {
  const AdamArgs a = adam_args(w, grad, m, v, vmax, out, coeffs);
  const int64_t osz = out.element_size();
  const bool stream = should_stream();
  const auto fn = isa().adam;
  at::parallel_for(0, a.n, kGrain, [&](int64_t b, int64_t e) {
    fn(e - b, a.w + b, a.g + b, a.m + b, a.v + b, at_offset(a.vmax, b), static_cast<char*>(a.out) + b * osz,
       a.out_kind, a.c, stream);
  });
}

void sgd_step_predict_cpu(const at::Tensor& w, const at::Tensor& grad, const std::optional<at::Tensor>& buf,
                          const at::Tensor& out, bool nesterov, bool first, at::ArrayRef<double> coeffs) {
  const SgdArgs a = sgd_args(w, grad, buf, out, coeffs);
  const int64_t osz = out.element_size();
  const bool stream = should_stream();
  const auto fn = isa().sgd;
  at::parallel_for(0, a.n, kGrain, [&](int64_t b, int64_t e) {
    fn(e - b, a.w + b, a.g + b, at_offset(a.buf, b), static_cast<char*>(a.out) + b * osz, a.out_kind, nesterov,
       first, a.c, stream);
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
