// CPU loops over one contiguous chunk, free of torch headers so that each instruction-set target
// (loops_avx512.cpp, loops_avx2.cpp, loops_generic.cpp) compiles them on its own without changing
// the code of any inline function it shares with other files. Threads split the buffer in
// ops_cpu.cpp; these loops are what the compiler vectorises (no aliasing between the state buffers,
// plain element-wise bodies, sqrt without errno).
#pragma once
#include <cstdint>
#include <type_traits>

#include "../rules.h"

namespace pipeoptim {
namespace cpu {

enum OutKind : int { OUT_F32 = 0, OUT_BF16 = 1, OUT_F16 = 2 };

// Internal linkage: each target file gets its own copies, so the linker can never hand one target's
// code to another (the templates have the same names in every file).
namespace {

// Round-to-nearest-even fp32 -> bf16, NaN kept quiet: the same bits as c10::BFloat16.
PO_HD uint16_t to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(rounded);
}

template <int Out>
PO_HD void store(void* out, int64_t i, float x) {
  if (Out == OUT_F32) static_cast<float*>(out)[i] = x;
  else if (Out == OUT_BF16) static_cast<uint16_t*>(out)[i] = to_bf16(x);
  else static_cast<_Float16*>(out)[i] = static_cast<_Float16>(x);
}

// InPlace writes through w itself, so the compiler sees a same-index read and write instead of a
// possible overlap that would send it to its scalar fallback.
template <bool HasM, bool HasG, int DenKind, bool HasVC, int Out, bool InPlace>
void predict_loop(int64_t n, const float* w, const float* m, const float* g, const float* v,
                  const float* vc, void* out, const PredictCoeffs& c) {
  const PredictCoeffs k = c;
  float* w_out = const_cast<float*>(w);
  for (int64_t i = 0; i < n; ++i) {
    float r = predict_one<HasM, HasG, DenKind, HasVC>(k, w[i], HasM ? m[i] : 0.f, HasG ? g[i] : 0.f,
                                                      DenKind ? v[i] : 0.f, HasVC ? vc[i] : 0.f);
    if (InPlace) w_out[i] = r;
    else store<Out>(out, i, r);
  }
}

template <bool Amsgrad, int Out>
void adam_loop(int64_t n, float* w, const float* g, float* m, float* v, float* vmax, void* out,
               const AdamStepCoeffs& c) {
  const AdamStepCoeffs k = c;
  for (int64_t i = 0; i < n; ++i) {
    float wi = w[i], mi = m[i], vi = v[i], vmi = Amsgrad ? vmax[i] : 0.f;
    float r = adam_step_predict_one<Amsgrad>(k, wi, g[i], mi, vi, vmi);
    w[i] = wi;
    m[i] = mi;
    v[i] = vi;
    if (Amsgrad) vmax[i] = vmi;
    store<Out>(out, i, r);
  }
}

template <bool HasMomentum, bool Nesterov, bool First, int Out>
void sgd_loop(int64_t n, float* w, const float* g, float* buf, void* out, const SgdStepCoeffs& c) {
  const SgdStepCoeffs k = c;
  for (int64_t i = 0; i < n; ++i) {
    float wi = w[i], bi = HasMomentum ? buf[i] : 0.f;
    float r = sgd_step_predict_one<HasMomentum, Nesterov, First>(k, wi, g[i], bi);
    w[i] = wi;
    if (HasMomentum) buf[i] = bi;
    store<Out>(out, i, r);
  }
}

// Compile-time dispatch of run-time flags: f(std::integral_constant<...>) for each value.
template <class F>
void with_bool(bool b, F&& f) {
  if (b) f(std::integral_constant<bool, true>{});
  else f(std::integral_constant<bool, false>{});
}
template <class F>
void with_out(int k, F&& f) {
  if (k == OUT_BF16) f(std::integral_constant<int, OUT_BF16>{});
  else if (k == OUT_F16) f(std::integral_constant<int, OUT_F16>{});
  else f(std::integral_constant<int, OUT_F32>{});
}
template <class F>
void with_den(int k, F&& f) {
  if (k == DEN_SQRT) f(std::integral_constant<int, DEN_SQRT>{});
  else if (k == DEN_LINEAR) f(std::integral_constant<int, DEN_LINEAR>{});
  else f(std::integral_constant<int, DEN_NONE>{});
}

}  // namespace

// The entry points each target file defines (in its own namespace, see ISA_NAMESPACE).
#define PIPEOPTIM_DEFINE_CPU_ENTRY_POINTS                                                              \
  void predict(int64_t n, const float* w, const float* m, const float* g, const float* v,            \
               const float* vc, void* out, int out_kind, int den, const PredictCoeffs& c) {         \
    with_bool(m != nullptr, [&](auto hm) {                                                         \
      with_bool(g != nullptr, [&](auto hg) {                                                       \
        with_den(den, [&](auto dk) {                                                               \
          with_bool(vc != nullptr && dk == DEN_SQRT, [&](auto hvc) {                               \
            if (out == static_cast<const void*>(w)) {                                              \
              predict_loop<hm, hg, dk, hvc, OUT_F32, true>(n, w, m, g, v, vc, out, c);              \
            } else {                                                                               \
              with_out(out_kind, [&](auto ok) {                                                    \
                predict_loop<hm, hg, dk, hvc, ok, false>(n, w, m, g, v, vc, out, c);                \
              });                                                                                  \
            }                                                                                      \
          });                                                                                      \
        });                                                                                        \
      });                                                                                          \
    });                                                                                            \
  }                                                                                                \
  void adam_step_predict(int64_t n, float* w, const float* g, float* m, float* v, float* vmax,       \
                         void* out, int out_kind, const AdamStepCoeffs& c) {                        \
    with_bool(vmax != nullptr, [&](auto ams) {                                                     \
      with_out(out_kind, [&](auto ok) { adam_loop<ams, ok>(n, w, g, m, v, vmax, out, c); });        \
    });                                                                                            \
  }                                                                                                \
  void sgd_step_predict(int64_t n, float* w, const float* g, float* buf, void* out, int out_kind,   \
                        bool nesterov, bool first, const SgdStepCoeffs& c) {                        \
    with_bool(buf != nullptr, [&](auto hm) {                                                       \
      with_bool(nesterov, [&](auto nes) {                                                          \
        with_bool(first, [&](auto fst) {                                                           \
          with_out(out_kind, [&](auto ok) { sgd_loop<hm, nes, fst, ok>(n, w, g, buf, out, c); });   \
        });                                                                                        \
      });                                                                                          \
    });                                                                                            \
  }

}  // namespace cpu
}  // namespace pipeoptim
