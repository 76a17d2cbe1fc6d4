// The CPU loops compiled for the generic target (see loops.h for why each target has its own file).
#include <cstdint>
#include <type_traits>

#define PIPEOPTIM_VEC_BYTES 0

#include "entry_points.h"

// The baseline target of the build: no target pragma.

#include "loops.h"

namespace pipeoptim {
namespace cpu {
namespace generic {
PIPEOPTIM_DEFINE_CPU_ENTRY_POINTS
}  // namespace generic
}  // namespace cpu
}  // namespace pipeoptim
