// Per-element maths of weight prediction and fused step+predict, shared by the CPU and CUDA kernels.
//
// The host (pipeoptim_kernels/rules.py) reduces every optimizer to one form and a handful of scalars:
//
//     delta = (cm*m + cg*g + cw*w) / D + lam*w        w_hat = w - scale*delta
//     D     = 1 | dscale*sqrt(v - vc*vc) + eps | v      (DEN_NONE | DEN_SQRT | DEN_LINEAR)
//
// so this header holds only that form and the two optimizer steps that must match torch.optim's
// arithmetic (Adam/AdamW and SGD). It includes nothing, so the CPU loops can compile it under several
// instruction-set targets without touching torch's inline functions.
//
// Every function is a template over the value type T: float for the CUDA kernels and the plain CPU
// loops, a GCC vector of floats for the CPU loops that write with streaming stores (cpu/loops.h).
// The maths is element-wise and the same for both; Sqrt<T> is the one operation a vector type needs
// spelled out.
#pragma once

#if defined(__CUDACC__)
#define PO_HD __host__ __device__ __forceinline__
#define PO_SQRT(x) sqrtf(x)
#else
#define PO_HD inline __attribute__((always_inline))
#define PO_SQRT(x) __builtin_sqrtf(x)
#endif

namespace pipeoptim {

enum Den : int { DEN_NONE = 0, DEN_SQRT = 1, DEN_LINEAR = 2 };

// Correctly rounded square root of each element; cpu/loops.h specialises it for its vector types.
template <class T>
struct Sqrt;
template <>
struct Sqrt<float> {
  PO_HD static float of(float x) { return PO_SQRT(x); }
};

// Order matches the `coeffs` list built in pipeoptim_kernels/compiled.py.
struct PredictCoeffs {
  float scale, cm, cg, cw, dscale, eps, lam;
};

// 1−β1, 1−β2 and 1−dampening come from the host, formed in double as torch.optim forms them:
// 1 − float(0.999) is 1.3e-5 relatively off 1 − 0.999, and that error would land in every v.
struct AdamStepCoeffs {
  float beta2, one_minus_beta1, one_minus_beta2, eps, sign, wd_coupled, decay, step_size, bc2_sqrt, pred_scale,
      pred_lam;
};

struct SgdStepCoeffs {
  float lr, momentum, one_minus_dampening, wd, sign, pred_scale;
};

// HasM/HasG/HasVC say which optional buffers exist; absent ones are never read.
template <bool HasM, bool HasG, int DenKind, bool HasVC, class T = float>
PO_HD T predict_one(const PredictCoeffs& c, T w, T m, T g, T v, T vc) {
  T num = c.cw * w;
  if (HasM) num += c.cm * m;
  if (HasG) num += c.cg * g;
  if (DenKind == DEN_SQRT) {
    T var = HasVC ? v - vc * vc : v;
    num = num / (c.dscale * Sqrt<T>::of(var) + c.eps);
  } else if (DenKind == DEN_LINEAR) {
    num = num / v;
  }
  return w - c.scale * (num + c.lam * w);
}

// torch's lerp: two formulas so that weight 0 and 1 are exact.
template <class T>
PO_HD T lerp(T self, T end, float weight) {
  return weight < 0.5f ? self + weight * (end - self) : end - (end - self) * (1.0f - weight);
}

// One Adam/AdamW step as torch.optim takes it, then the prediction from the new state.
// Returns w_hat; updates w, m, v (and vmax when Amsgrad) through the references.
template <bool Amsgrad, class T = float>
PO_HD T adam_step_predict_one(const AdamStepCoeffs& c, T& w, T grad, T& m, T& v, T& vmax) {
  T g = c.sign * grad + c.wd_coupled * w;
  w = w * c.decay;
  m = lerp(m, g, c.one_minus_beta1);
  v = v * c.beta2 + c.one_minus_beta2 * (g * g);
  T vhat = v;
  if (Amsgrad) {
    vmax = vmax > v ? vmax : v;
    vhat = vmax;
  }
  T denom = Sqrt<T>::of(vhat) / c.bc2_sqrt + c.eps;
  T dir = m / denom;
  w = w - c.step_size * dir;
  return w - c.pred_scale * dir - c.pred_lam * w;
}

// One SGD step (momentum, dampening, nesterov, weight decay, maximize), then the prediction.
template <bool HasMomentum, bool Nesterov, bool First, class T = float>
PO_HD T sgd_step_predict_one(const SgdStepCoeffs& c, T& w, T grad, T& buf) {
  T d = c.sign * grad + c.wd * w;
  T update = d;
  if (HasMomentum) {
    buf = First ? d : buf * c.momentum + c.one_minus_dampening * d;
    update = Nesterov ? d + c.momentum * buf : buf;
  }
  w = w - c.lr * update;
  T dir;
  if (HasMomentum && !Nesterov) {
    dir = buf;
  } else {
    dir = c.sign * grad + c.wd * w;
    if (HasMomentum) dir += c.momentum * buf;
  }
  return w - c.pred_scale * dir;
}

}  // namespace pipeoptim
