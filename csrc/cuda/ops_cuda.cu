// CUDA implementations of the pipeoptim ops: one pass over the flat buffers, fp32 maths, fp32/bf16/fp16
// output, 4-element vector loads and stores (16 bytes of fp32, 8 of bf16/fp16) over the aligned body,
// scalar over a head that aligns it (buffers misaligned alike) and the tail.
// Only c10/cuda headers: ATen/cuda/CUDAContext.h pulls in cuSPARSE and cuBLAS headers that a bare
// toolkit may lack.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../ops.h"

namespace pipeoptim {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename T> struct OutT;
template <> struct OutT<float> { static __device__ __forceinline__ float cvt(float x) { return x; } };
template <> struct OutT<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 cvt(float x) { return __float2bfloat16_rn(x); }
};
template <> struct OutT<__half> { static __device__ __forceinline__ __half cvt(float x) { return __float2half_rn(x); } };

// 4 consecutive floats; the pointer is 16-byte aligned on the vector path.
struct F4 { float x[4]; };
__device__ __forceinline__ F4 load4(const float* p) {
  float4 t = *reinterpret_cast<const float4*>(p);
  return {{t.x, t.y, t.z, t.w}};
}
__device__ __forceinline__ void store4(float* p, const F4& v) {
  *reinterpret_cast<float4*>(p) = make_float4(v.x[0], v.x[1], v.x[2], v.x[3]);
}
template <typename T>
__device__ __forceinline__ void store_out4(T* p, const F4& v) {
  if constexpr (sizeof(T) == 4) {
    store4(reinterpret_cast<float*>(p), v);
  } else {
    struct alignas(8) Four { T e[4]; } o;
#pragma unroll
    for (int k = 0; k < 4; ++k) o.e[k] = OutT<T>::cvt(v.x[k]);
    *reinterpret_cast<Four*>(p) = o;
  }
}

// ---- predict --------------------------------------------------------------------------------------

template <bool HasM, bool HasG, int DenKind, bool HasVC, typename T, bool Vec>
__global__ void predict_kernel(int64_t n, const float* w, const float* m, const float* g, const float* v,
                               const float* vc, T* out, PredictCoeffs c) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if constexpr (Vec) {
    const int64_t n4 = n / 4;
    for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < n4; q += stride) {
      const int64_t i = q * 4;
      F4 wv = load4(w + i), mv{}, gv{}, vv{}, cv{}, r;
      if (HasM) mv = load4(m + i);
      if (HasG) gv = load4(g + i);
      if (DenKind) vv = load4(v + i);
      if (HasVC) cv = load4(vc + i);
#pragma unroll
      for (int k = 0; k < 4; ++k)
        r.x[k] = predict_one<HasM, HasG, DenKind, HasVC>(c, wv.x[k], mv.x[k], gv.x[k], vv.x[k], cv.x[k]);
      store_out4(out + i, r);
    }
  } else {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
      float r = predict_one<HasM, HasG, DenKind, HasVC>(c, w[i], HasM ? m[i] : 0.f, HasG ? g[i] : 0.f,
                                                        DenKind ? v[i] : 0.f, HasVC ? vc[i] : 0.f);
      out[i] = OutT<T>::cvt(r);
    }
  }
}

// ---- Adam / AdamW step + predict ----------------------------------------------------------------------

template <bool Amsgrad, typename T, bool Vec>
__global__ void adam_kernel(int64_t n, float* w, const float* g, float* m, float* v, float* vmax, T* out,
                            AdamStepCoeffs c) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if constexpr (Vec) {
    const int64_t n4 = n / 4;
    for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < n4; q += stride) {
      const int64_t i = q * 4;
      F4 wv = load4(w + i), gv = load4(g + i), mv = load4(m + i), vv = load4(v + i), xv{}, r;
      if (Amsgrad) xv = load4(vmax + i);
#pragma unroll
      for (int k = 0; k < 4; ++k) r.x[k] = adam_step_predict_one<Amsgrad>(c, wv.x[k], gv.x[k], mv.x[k], vv.x[k], xv.x[k]);
      store4(w + i, wv);
      store4(m + i, mv);
      store4(v + i, vv);
      if (Amsgrad) store4(vmax + i, xv);
      store_out4(out + i, r);
    }
  } else {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
      float wi = w[i], mi = m[i], vi = v[i], xi = Amsgrad ? vmax[i] : 0.f;
      float r = adam_step_predict_one<Amsgrad>(c, wi, g[i], mi, vi, xi);
      w[i] = wi;
      m[i] = mi;
      v[i] = vi;
      if (Amsgrad) vmax[i] = xi;
      out[i] = OutT<T>::cvt(r);
    }
  }
}

// ---- SGD step + predict ---------------------------------------------------------------------------------

template <bool HasMomentum, bool Nesterov, bool First, typename T, bool Vec>
__global__ void sgd_kernel(int64_t n, float* w, const float* g, float* buf, T* out, SgdStepCoeffs c) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  if constexpr (Vec) {
    const int64_t n4 = n / 4;
    for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < n4; q += stride) {
      const int64_t i = q * 4;
      F4 wv = load4(w + i), gv = load4(g + i), bv{}, r;
      if (HasMomentum && !First) bv = load4(buf + i);
#pragma unroll
      for (int k = 0; k < 4; ++k) r.x[k] = sgd_step_predict_one<HasMomentum, Nesterov, First>(c, wv.x[k], gv.x[k], bv.x[k]);
      store4(w + i, wv);
      if (HasMomentum) store4(buf + i, bv);
      store_out4(out + i, r);
    }
  } else {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
      float wi = w[i], bi = (HasMomentum && !First) ? buf[i] : 0.f;
      float r = sgd_step_predict_one<HasMomentum, Nesterov, First>(c, wi, g[i], bi);
      w[i] = wi;
      if (HasMomentum) buf[i] = bi;
      out[i] = OutT<T>::cvt(r);
    }
  }
}

// ---- launch helpers -----------------------------------------------------------------------------------------

// Elements to run on the scalar path first so that every buffer is aligned for 4-element vectors after
// them (16 bytes for fp32, 8 for a bf16/fp16 out), or -1 when the buffers are misaligned differently
// (then everything runs scalar). Views into flat buffers at one offset share their misalignment.
int64_t vector_head(std::initializer_list<std::pair<const void*, int>> buffers) {
  int64_t phase = -1;
  for (const auto& [p, size] : buffers) {
    if (p == nullptr) continue;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (a % size != 0) return -1;
    const int64_t k = int64_t(a / size) % 4;
    if (phase < 0) phase = k;
    else if (phase != k) return -1;
  }
  return phase <= 0 ? 0 : 4 - phase;
}

int blocks_for(int64_t work) {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t want = (work + kThreads - 1) / kThreads;
  return int(std::max<int64_t>(1, std::min<int64_t>(want, int64_t(sms) * 16)));
}

template <class F>
void with_bool(bool b, F&& f) {
  if (b) f(std::integral_constant<bool, true>{});
  else f(std::integral_constant<bool, false>{});
}

// Calls f(T{}) with T the device type of `out`.
template <class F>
void with_out_type(const at::Tensor& out, F&& f) {
  switch (out_kind(out)) {
    case 1: f(__nv_bfloat16{}); break;
    case 2: f(__half{}); break;
    default: f(float{}); break;
  }
}

// Runs the scalar kernel over the first `head` elements, the vector kernel over the multiple of 4 after
// them, and the scalar kernel over the rest; head < 0: the scalar kernel over everything.
template <class Launch>
void launch_split(int64_t n, int64_t head, Launch&& launch) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t first = head < 0 ? n : std::min(head, n);
  const int64_t body = ((n - first) / 4) * 4;
  const auto scalar = std::integral_constant<bool, false>{};
  if (first > 0) launch(scalar, int64_t(0), first, blocks_for(first), stream);
  if (body > 0) launch(std::integral_constant<bool, true>{}, first, body, blocks_for(body / 4), stream);
  if (n > first + body) launch(scalar, first + body, n - first - body, blocks_for(n - first - body), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
T* offset(T* p, int64_t o) { return p ? p + o : nullptr; }

void predict_cuda(const at::Tensor& w, const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& g,
                  const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& vc, const at::Tensor& out,
                  int64_t den, at::ArrayRef<double> coeffs) {
  const PredictArgs a = predict_args(w, m, g, v, vc, out, den, coeffs);
  const c10::cuda::CUDAGuard guard(w.device());
  with_out_type(out, [&](auto tag) {
    using T = decltype(tag);
    T* po = static_cast<T*>(a.out);
    const int64_t head = vector_head({{a.w, 4}, {a.m, 4}, {a.g, 4}, {a.v, 4}, {a.vc, 4}, {po, int(sizeof(T))}});
    with_bool(a.m != nullptr, [&](auto hm) {
      with_bool(a.g != nullptr, [&](auto hg) {
        with_bool(a.vc != nullptr && a.den == DEN_SQRT, [&](auto hvc) {
          auto run = [&](auto dk) {
            launch_split(a.n, head, [&](auto vec, int64_t o, int64_t n, int blocks, cudaStream_t s) {
              predict_kernel<hm, hg, decltype(dk)::value, hvc, T, vec><<<blocks, kThreads, 0, s>>>(
                  n, a.w + o, offset(a.m, o), offset(a.g, o), offset(a.v, o), offset(a.vc, o), po + o, a.c);
            });
          };
          if (a.den == DEN_SQRT) run(std::integral_constant<int, DEN_SQRT>{});
          else if (a.den == DEN_LINEAR) run(std::integral_constant<int, DEN_LINEAR>{});
          else run(std::integral_constant<int, DEN_NONE>{});
        });
      });
    });
  });
}

void adam_step_predict_cuda(const at::Tensor& w, const at::Tensor& grad, const at::Tensor& m, const at::Tensor& v,
                            const std::optional<at::Tensor>& vmax, const at::Tensor& out, at::ArrayRef<double> coeffs) {
  const AdamArgs a = adam_args(w, grad, m, v, vmax, out, coeffs);
  const c10::cuda::CUDAGuard guard(w.device());
  with_out_type(out, [&](auto tag) {
    using T = decltype(tag);
    T* po = static_cast<T*>(a.out);
    const int64_t head = vector_head({{a.w, 4}, {a.g, 4}, {a.m, 4}, {a.v, 4}, {a.vmax, 4}, {po, int(sizeof(T))}});
    with_bool(a.vmax != nullptr, [&](auto ams) {
      launch_split(a.n, head, [&](auto vec, int64_t o, int64_t n, int blocks, cudaStream_t s) {
        adam_kernel<ams, T, vec><<<blocks, kThreads, 0, s>>>(n, a.w + o, a.g + o, a.m + o, a.v + o,
                                                              offset(a.vmax, o), po + o, a.c);
      });
    });
  });
}

void sgd_step_predict_cuda(const at::Tensor& w, const at::Tensor& grad, const std::optional<at::Tensor>& buf,
                           const at::Tensor& out, bool nesterov, bool first, at::ArrayRef<double> coeffs) {
  const SgdArgs a = sgd_args(w, grad, buf, out, coeffs);
  const c10::cuda::CUDAGuard guard(w.device());
  with_out_type(out, [&](auto tag) {
    using T = decltype(tag);
    T* po = static_cast<T*>(a.out);
    const int64_t head = vector_head({{a.w, 4}, {a.g, 4}, {a.buf, 4}, {po, int(sizeof(T))}});
    with_bool(a.buf != nullptr, [&](auto hm) {
      with_bool(nesterov, [&](auto nes) {
        with_bool(first, [&](auto fst) {
          launch_split(a.n, head, [&](auto vec, int64_t o, int64_t n, int blocks, cudaStream_t s) {
            sgd_kernel<hm, nes, fst, T, vec><<<blocks, kThreads, 0, s>>>(n, a.w + o, a.g + o, offset(a.buf, o),
                                                                         po + o, a.c);
          });
        });
      });
    });
  });
}

}  // namespace
}  // namespace cuda
}  // namespace pipeoptim

TORCH_LIBRARY_IMPL(pipeoptim, CUDA, m) {
  m.impl("predict_", &pipeoptim::cuda::predict_cuda);
  m.impl("adam_step_predict_", &pipeoptim::cuda::adam_step_predict_cuda);
  m.impl("sgd_step_predict_", &pipeoptim::cuda::sgd_step_predict_cuda);
  // Each thread reads its elements of grad before it writes the prediction over them: out = grad is safe.
  m.impl("adam_step_predict_into_grad_",
         &pipeoptim::adam_step_predict_into_grad<&pipeoptim::cuda::adam_step_predict_cuda>);
  m.impl("sgd_step_predict_into_grad_", &pipeoptim::sgd_step_predict_into_grad<&pipeoptim::cuda::sgd_step_predict_cuda>);
}
