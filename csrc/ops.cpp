// The torch.library schemas of the kernels (one definition for every backend) and the Python module
// that says what this build contains. CPU kernels register in cpu/ops_cpu.cpp, CUDA ones in
// cuda/ops_cuda.cu; fake (meta) implementations for torch.compile live in pipeoptim_kernels/compiled.py.
#include <torch/extension.h>
#include <torch/library.h>

TORCH_LIBRARY(pipeoptim, m) {
  m.def("predict_(Tensor w, Tensor? m, Tensor? g, Tensor? v, Tensor? vc, Tensor(a!) out, int den, float[] coeffs) -> ()");
  m.def("adam_step_predict_(Tensor(a!) w, Tensor grad, Tensor(b!) m, Tensor(c!) v, Tensor(d!)? vmax, Tensor(e!) out, float[] coeffs) -> ()");
  m.def("sgd_step_predict_(Tensor(a!) w, Tensor grad, Tensor(b!)? buf, Tensor(e!) out, bool nesterov, bool first, float[] coeffs) -> ()");
  // The same steps writing the prediction over the gradient, which the step has finished reading.
  m.def("adam_step_predict_into_grad_(Tensor(a!) w, Tensor(e!) grad, Tensor(b!) m, Tensor(c!) v, Tensor(d!)? vmax, float[] coeffs) -> ()");
  m.def("sgd_step_predict_into_grad_(Tensor(a!) w, Tensor(e!) grad, Tensor(b!)? buf, bool nesterov, bool first, float[] coeffs) -> ()");
}

namespace pipeoptim {
namespace cpu {
const char* selected_isa();
std::string set_isa(const std::string& name);
int set_stream_mode(int mode);
int64_t stream_threshold_bytes();
int64_t set_prefetch_bytes(int64_t bytes);
int64_t prefetch_bytes();
}
}  // namespace pipeoptim

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipeoptim_kernels compiled kernels (ops under torch.ops.pipeoptim)";
#ifdef PIPEOPTIM_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def("set_cpu_stream", &pipeoptim::cpu::set_stream_mode,
        "streaming stores for separate outputs on the CPU: -1 auto, 0 off, 1 on; returns the previous mode");
  m.def("cpu_stream_threshold_bytes", &pipeoptim::cpu::stream_threshold_bytes,
        "output size from which the CPU kernels stream in auto mode (the last-level cache)");
  m.def("set_cpu_prefetch", &pipeoptim::cpu::set_prefetch_bytes,
        "how many bytes ahead the CPU loops prefetch their inputs: -1 the instruction set's default, 0 off; "
        "returns the previous setting");
  m.def("cpu_prefetch_bytes", &pipeoptim::cpu::prefetch_bytes,
        "how many bytes ahead the CPU loops prefetch now (the setting, or the instruction set's default)");
  m.def("cpu_isa", &pipeoptim::cpu::selected_isa, "the instruction set the CPU loops run with");
  m.def("set_cpu_isa", &pipeoptim::cpu::set_isa,
        "run the CPU loops compiled for another instruction set this processor supports (avx512, avx2, generic); "
        "returns the previous one");
}
