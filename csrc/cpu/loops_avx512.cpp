// The CPU loops compiled for the avx512 target (see loops.h for why each target has its own file).
#include <cstdint>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#define PIPEOPTIM_VEC_BYTES 64
#else
#define PIPEOPTIM_VEC_BYTES 0
#endif

#include "entry_points.h"

#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

#include "loops.h"

namespace pipeoptim {
namespace cpu {
namespace avx512 {
PIPEOPTIM_DEFINE_CPU_ENTRY_POINTS
}  // namespace avx512
}  // namespace cpu
}  // namespace pipeoptim
