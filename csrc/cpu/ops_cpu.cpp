// CPU implementations of the pipeoptim ops: split the flat buffer across ATen's threads and run the
// loops compiled for the best instruction set this processor has.
#include <ATen/Parallel.h>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <string>
#include <unistd.h>

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
  int64_t prefetch_bytes;  // how far ahead the loops prefetch their inputs by default (loops.h); 0: not at all
};

// Best first. Every instruction set computes the same bits (no contraction, correctly rounded sqrt and
// division), so the choice changes only the speed. The prefetch distances are what measured best where
// they were measured (an AMD EPYC with AVX2 only; the AVX-512 Xeon gained nothing); the baseline loops
// have no vectors to prefetch for.
const Isa kIsas[] = {
    {"avx512", avx512::predict, avx512::adam_step_predict, avx512::sgd_step_predict, 0},
    {"avx2", avx2::predict, avx2::adam_step_predict, avx2::sgd_step_predict, 1024},
    {"generic", generic::predict, generic::adam_step_predict, generic::sgd_step_predict, 0},
};

bool supported(const Isa& isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const std::string name = isa.name;
  if (name == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (name == "avx2")
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return true;
#else
  return std::string(isa.name) == "generic";
#endif
}

std::string supported_names() {
  std::string names;
  for (const Isa& isa : kIsas)
    if (supported(isa)) names += (names.empty() ? "" : ", ") + std::string(isa.name);
  return names;
}

const Isa& find_isa(const std::string& name, const char* who) {
  for (const Isa& isa : kIsas) {
    if (name == isa.name) {
      TORCH_CHECK(supported(isa), who, ": this processor cannot run the ", name, " loops; it can run: ",
                  supported_names());
      return isa;
    }
  }
  TORCH_CHECK(false, who, ": unknown instruction set '", name, "'; this processor can run: ", supported_names());
}

// The best this processor supports, or the one PIPEOPTIM_CPU_ISA names (for comparing the loops).
const Isa& initial_isa() {
  const char* env = std::getenv("PIPEOPTIM_CPU_ISA");
  if (env != nullptr && env[0] != '\0') return find_isa(env, "PIPEOPTIM_CPU_ISA");
  for (const Isa& isa : kIsas)
    if (supported(isa)) return isa;
  return kIsas[2];
}

std::atomic<const Isa*> g_isa{nullptr};

const Isa& isa() {
  const Isa* chosen = g_isa.load(std::memory_order_relaxed);
  if (chosen == nullptr) {
    chosen = &initial_isa();
    g_isa.store(chosen, std::memory_order_relaxed);
  }
  return *chosen;
}

// Streaming stores for a separate output (loops.h says why) pay off only when the op's buffers do not
// fit in the cache together: otherwise the output lines may still be cached when they are read next
// (by the forward pass that reads ŵ), and streaming would push them out. So by default they are used
// when all the bytes the op touches reach the last-level cache's size. PIPEOPTIM_CPU_STREAM=1 forces
// them on, =0 off; set_stream_mode() changes the mode at run time (the benchmark compares both in
// one process).
constexpr int kStreamAuto = -1, kStreamOff = 0, kStreamOn = 1, kStreamUnset = -2;
std::atomic<int> g_stream_mode{kStreamUnset};

int stream_mode() {
  int mode = g_stream_mode.load(std::memory_order_relaxed);
  if (mode == kStreamUnset) {
    const char* env = std::getenv("PIPEOPTIM_CPU_STREAM");
    const std::string value = env == nullptr ? "" : env;
    TORCH_CHECK(value.empty() || value == "0" || value == "1",
                "PIPEOPTIM_CPU_STREAM must be 1 (streaming stores on), 0 (off) or unset (on for buffers past the "
                "last-level cache); got '", value, "'");
    mode = value.empty() ? kStreamAuto : value == "1" ? kStreamOn : kStreamOff;
    g_stream_mode.store(mode, std::memory_order_relaxed);
  }
  return mode;
}

// Software prefetch distance in bytes: the instruction set's own (kIsas) unless PIPEOPTIM_CPU_PREFETCH
// or set_prefetch_bytes() names one; 0 turns it off (the benchmark compares both in one process).
constexpr int64_t kPrefetchIsaDefault = -1, kPrefetchUnset = -2, kPrefetchMaxBytes = 1 << 20;
std::atomic<int64_t> g_prefetch_bytes{kPrefetchUnset};

int64_t prefetch_setting() {
  int64_t bytes = g_prefetch_bytes.load(std::memory_order_relaxed);
  if (bytes == kPrefetchUnset) {
    const char* env = std::getenv("PIPEOPTIM_CPU_PREFETCH");
    const std::string value = env == nullptr ? "" : env;
    bytes = kPrefetchIsaDefault;
    if (!value.empty()) {
      char* end = nullptr;
      const long long parsed = std::strtoll(value.c_str(), &end, 10);
      TORCH_CHECK(*end == '\0' && parsed >= 0 && parsed <= kPrefetchMaxBytes,
                  "PIPEOPTIM_CPU_PREFETCH must be how many bytes ahead the CPU loops prefetch their inputs, from 0 "
                  "(off) to ", kPrefetchMaxBytes, ", or unset (the instruction set's default); got '", value, "'");
      bytes = parsed;
    }
    g_prefetch_bytes.store(bytes, std::memory_order_relaxed);
  }
  return bytes;
}

// Elements ahead, as the loops take it.
int64_t prefetch_ahead() {
  const int64_t bytes = prefetch_setting();
  return (bytes == kPrefetchIsaDefault ? isa().prefetch_bytes : bytes) / 4;
}

// Size of the largest cache of CPU 0 as the kernel reports it. sysfs first: in virtual machines
// sysconf(_SC_LEVEL3_CACHE_SIZE) can report the whole host's cache (320 MiB for a 32 MiB slice).
int64_t sysfs_cache_bytes() {
  int64_t best_level = 0, best_bytes = 0;
  for (int index = 0; index < 10; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int64_t level = 0, size = 0;
    std::string unit;
    if (!(level_file >> level) || !(size_file >> size)) continue;
    size_file >> unit;
    if (unit == "K") size <<= 10;
    else if (unit == "M") size <<= 20;
    if (level > best_level) best_level = level, best_bytes = size;
  }
  return best_bytes;
}

int64_t last_level_cache_bytes() {
  static const int64_t bytes = [] {
    const int64_t from_sysfs = sysfs_cache_bytes();
    if (from_sysfs > 0) return from_sysfs;
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return l3 > 0 ? int64_t(l3) : int64_t(32) << 20;
  }();
  return bytes;
}

// footprint: all the bytes the op reads and writes.
bool should_stream(int64_t footprint) {
  const int mode = stream_mode();
  return mode == kStreamOn || (mode == kStreamAuto && footprint >= last_level_cache_bytes());
}

// Bytes per element an optional fp32 buffer adds to an op's footprint.
int64_t fp32_bytes(const float* p) { return p != nullptr ? 4 : 0; }

template <typename T>
T* at_offset(T* p, int64_t o) { return p ? p + o : nullptr; }

void predict_cpu(const at::Tensor& w, const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& g,
                 const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& vc, const at::Tensor& out,
                 int64_t den, at::ArrayRef<double> coeffs) {
  const PredictArgs a = predict_args(w, m, g, v, vc, out, den, coeffs);
  const int64_t osz = out.element_size();
  const int64_t per_element = 4 + fp32_bytes(a.m) + fp32_bytes(a.g) + fp32_bytes(a.v) + fp32_bytes(a.vc) + osz;
  const bool stream = !a.in_place && should_stream(a.n * per_element);
  const auto fn = isa().predict;
  const int64_t ahead = prefetch_ahead();
  at::parallel_for(0, a.n, kGrain, [&](int64_t b, int64_t e) {
    void* o = a.in_place ? static_cast<void*>(const_cast<float*>(a.w + b)) : static_cast<char*>(a.out) + b * osz;
    fn(e - b, a.w + b, at_offset(a.m, b), at_offset(a.g, b), at_offset(a.v, b), at_offset(a.vc, b), o, a.out_kind,
       a.den, a.c, stream, ahead);
  });
}

void adam_step_predict_cpu(const at::Tensor& w, const at::Tensor& grad, const at::Tensor& m, const at::Tensor& v,
                           const std::optional<at::Tensor>& vmax, const at::Tensor& out, at::ArrayRef<double> coeffs) {
  const AdamArgs a = adam_args(w, grad, m, v, vmax, out, coeffs);
  const int64_t osz = out.element_size();
  const bool into_grad = a.out == static_cast<const void*>(a.g);  // the gradient's lines are cached: no stream
  const bool stream = !into_grad && should_stream(a.n * (16 + fp32_bytes(a.vmax) + osz));
  const auto fn = isa().adam;
  const int64_t ahead = prefetch_ahead();
  at::parallel_for(0, a.n, kGrain, [&](int64_t b, int64_t e) {
    fn(e - b, a.w + b, a.g + b, a.m + b, a.v + b, at_offset(a.vmax, b), static_cast<char*>(a.out) + b * osz,
       a.out_kind, a.c, stream, ahead);
  });
}

void sgd_step_predict_cpu(const at::Tensor& w, const at::Tensor& grad, const std::optional<at::Tensor>& buf,
                          const at::Tensor& out, bool nesterov, bool first, at::ArrayRef<double> coeffs) {
  const SgdArgs a = sgd_args(w, grad, buf, out, coeffs);
  const int64_t osz = out.element_size();
  const bool into_grad = a.out == static_cast<const void*>(a.g);
  const bool stream = !into_grad && should_stream(a.n * (8 + fp32_bytes(a.buf) + osz));
  const auto fn = isa().sgd;
  const int64_t ahead = prefetch_ahead();
  at::parallel_for(0, a.n, kGrain, [&](int64_t b, int64_t e) {
    fn(e - b, a.w + b, a.g + b, at_offset(a.buf, b), static_cast<char*>(a.out) + b * osz, a.out_kind, nesterov,
       first, a.c, stream, ahead);
  });
}

}  // namespace

const char* selected_isa() { return isa().name; }

std::string set_isa(const std::string& name) {
  const std::string previous = isa().name;
  g_isa.store(&find_isa(name, "set_cpu_isa"), std::memory_order_relaxed);
  return previous;
}

int set_stream_mode(int mode) {
  TORCH_CHECK(mode >= kStreamAuto && mode <= kStreamOn,
              "set_cpu_stream: mode must be -1 (auto: outputs at least the last-level cache), 0 (off) or 1 (on); got ",
              mode);
  const int previous = stream_mode();
  g_stream_mode.store(mode, std::memory_order_relaxed);
  return previous;
}

int64_t stream_threshold_bytes() { return last_level_cache_bytes(); }

int64_t set_prefetch_bytes(int64_t bytes) {
  TORCH_CHECK(bytes == kPrefetchIsaDefault || (bytes >= 0 && bytes <= kPrefetchMaxBytes),
              "set_cpu_prefetch: bytes must be -1 (the instruction set's default) or from 0 (off) to ",
              kPrefetchMaxBytes, "; got ", bytes);
  const int64_t previous = prefetch_setting();
  g_prefetch_bytes.store(bytes, std::memory_order_relaxed);
  return previous;
}

int64_t prefetch_bytes() { return prefetch_ahead() * 4; }

}  // namespace cpu
}  // namespace pipeoptim

TORCH_LIBRARY_IMPL(pipeoptim, CPU, m) {
  m.impl("predict_", &pipeoptim::cpu::predict_cpu);
  m.impl("adam_step_predict_", &pipeoptim::cpu::adam_step_predict_cpu);
  m.impl("sgd_step_predict_", &pipeoptim::cpu::sgd_step_predict_cpu);
  m.impl("adam_step_predict_into_grad_",
         &pipeoptim::adam_step_predict_into_grad<&pipeoptim::cpu::adam_step_predict_cpu>);
  m.impl("sgd_step_predict_into_grad_", &pipeoptim::sgd_step_predict_into_grad<&pipeoptim::cpu::sgd_step_predict_cpu>);
}
