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

// Order matches the `coeffs` list built in pipeoptim_kernels/compiled.py.
struct PredictCoeffs {
  float scale, cm, cg, cw, dscale, eps, lam;
};

struct AdamStepCoeffs {
  float beta1, beta2, eps, sign, wd_coupled, decay, step_size, bc2_sqrt, pred_scale, pred_lam;
};

struct SgdStepCoeffs {
  float lr, momentum, dampening, wd, sign, pred_scale;
};

// HasM/HasG/HasVC say which optional buffers exist; absent ones are never read.
template <bool HasM, bool HasG, int DenKind, bool HasVC>
PO_HD float predict_one(const PredictCoeffs& c, float w, float m, float g, float v, float vc) {
  float num = c.cw * w;
  if (HasM) num += c.cm * m;
  if (HasG) num += c.cg * g;
  if (DenKind == DEN_SQRT) {
    float var = HasVC ? v - vc * vc : v;
    num = num / (c.dscale * PO_SQRT(var) + c.eps);
  } else if (DenKind == DEN_LINEAR) {
    num = num / v;
  }
  return w - c.scale * (num + c.lam * w);
}

// torch's lerp: two formulas so that weight 0 and 1 are exact.
PO_HD float lerp(float self, float end, float weight) {
  return weight < 0.5f ? self + weight * (end - self) : end - (end - self) * (1.0f - weight);
}

// One Adam/AdamW step as torch.optim takes it, then the prediction from the new state.
// Returns w_hat; updates w, m, v (and vmax when Amsgrad) through the references.
template <bool Amsgrad>
PO_HD float adam_step_predict_one(const AdamStepCoeffs& c, float& w, float grad, float& m, float& v, float& vmax) {
  float g = c.sign * grad + c.wd_coupled * w;
  w = w * c.decay;
  m = lerp(m, g, 1.0f - c.beta1);
  v = v * c.beta2 + (1.0f - c.beta2) * (g * g);
  float vhat = v;
  if (Amsgrad) {
    vmax = vmax > v ? vmax : v;
    vhat = vmax;
  }
  float denom = PO_SQRT(vhat) / c.bc2_sqrt + c.eps;
  float dir = m / denom;
  w = w - c.step_size * dir;
  return w - c.pred_scale * dir - c.pred_lam * w;
}

// One SGD step (momentum, dampening, nesterov, weight decay, maximize), then the prediction.
template <bool HasMomentum, bool Nesterov, bool First>
PO_HD float sgd_step_predict_one(const SgdStepCoeffs& c, float& w, float grad, float& buf) {
  float d = c.sign * grad + c.wd * w;
  float update = d;
  if (HasMomentum) {
    buf = First ? d : buf * c.momentum + (1.0f - c.dampening) * d;
    update = Nesterov ? d + c.momentum * buf : buf;
  }
  w = w - c.lr * update;
  float dir;
  if (HasMomentum && !Nesterov) {
    dir = buf;
  } else {
    dir = c.sign * grad + c.wd * w;
    if (HasMomentum) dir += c.momentum * buf;
  }
  return w - c.pred_scale * dir;
}

}  // namespace pipeoptim
