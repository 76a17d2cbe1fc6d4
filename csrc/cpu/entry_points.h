// Declarations of the CPU loops compiled once per instruction-set target; ops_cpu.cpp picks one at
// run time from what the processor supports.
#pragma once
#include <cstdint>

#include "../rules.h"

#define PIPEOPTIM_DECLARE_CPU_ENTRY_POINTS                                                           \
  void predict(int64_t n, const float* w, const float* m, const float* g, const float* v,            \
               const float* vc, void* out, int out_kind, int den, const PredictCoeffs& c, bool stream, \
               int64_t ahead);                                                                       \
  void adam_step_predict(int64_t n, float* w, const float* g, float* m, float* v, float* vmax,       \
                         void* out, int out_kind, const AdamStepCoeffs& c, bool stream, int64_t ahead); \
  void sgd_step_predict(int64_t n, float* w, const float* g, float* buf, void* out, int out_kind,    \
                        bool nesterov, bool first, const SgdStepCoeffs& c, bool stream,              \
                        int64_t ahead);

namespace pipeoptim {
namespace cpu {
namespace avx512 { PIPEOPTIM_DECLARE_CPU_ENTRY_POINTS }
namespace avx2 { PIPEOPTIM_DECLARE_CPU_ENTRY_POINTS }
namespace generic { PIPEOPTIM_DECLARE_CPU_ENTRY_POINTS }
}  // namespace cpu
}  // namespace pipeoptim
