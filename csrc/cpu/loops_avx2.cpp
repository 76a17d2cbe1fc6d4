// The CPU loops compiled for the avx2 target (see loops.h for why each target has its own file).
#include <cstdint>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#define PIPEOPTIM_VEC_BYTES 32
#else
#define PIPEOPTIM_VEC_BYTES 0
#endif

#include "entry_points.h"

#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#endif

#include "loops.h"

namespace pipeoptim {
namespace cpu {
namespace avx2 {
PIPEOPTIM_DEFINE_CPU_ENTRY_POINTS
}  // namespace avx2
}  // namespace cpu
}  // namespace pipeoptim
