// CPU loops over one contiguous chunk, free of torch headers so that each instruction-set target
// (loops_avx512.cpp, loops_avx2.cpp, loops_generic.cpp) compiles them on its own without changing
// the code of any inline function it shares with other files. Threads split the buffer in
// ops_cpu.cpp; these loops are what the compiler vectorises (no aliasing between the state buffers,
// plain element-wise bodies, sqrt without errno). A target file defines PIPEOPTIM_VEC_BYTES, its
// vector width (0: no vectors, so no streaming stores).
#pragma once
#include <cstdint>
#include <type_traits>

#include "../rules.h"

namespace pipeoptim {

#if PIPEOPTIM_VEC_BYTES > 0
// rules.h's square root for this target's vector of floats (see vfloat below). The zero-masked
// AVX-512 forms are the same instructions; the plain ones trip a false uninitialised warning in GCC 12.
typedef float cpu_vfloat __attribute__((vector_size(PIPEOPTIM_VEC_BYTES)));
template <>
struct Sqrt<cpu_vfloat> {
#if PIPEOPTIM_VEC_BYTES == 64
  static cpu_vfloat of(cpu_vfloat x) { return reinterpret_cast<cpu_vfloat>(_mm512_maskz_sqrt_ps(0xFFFF, reinterpret_cast<__m512>(x))); }
#else
  static cpu_vfloat of(cpu_vfloat x) { return reinterpret_cast<cpu_vfloat>(_mm256_sqrt_ps(reinterpret_cast<__m256>(x))); }
#endif
};
#endif

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

template <int Out>
constexpr int out_size() { return Out == OUT_F32 ? 4 : 2; }

#if PIPEOPTIM_VEC_BYTES > 0
// Streaming (non-temporal) stores. A separate output buffer written with ordinary stores is first
// read into the cache (read-for-ownership): 4 bytes per fp32 element that the kernel never uses, a
// quarter of Adam's 16-byte prediction. Streaming stores write whole lines without that read. They
// need whole vectors, so the loops below compute on vectors of the target's width (rules.h's
// templates, instantiated for vfloat) and store each with one instruction.
typedef float vfloat __attribute__((vector_size(PIPEOPTIM_VEC_BYTES)));
typedef uint32_t vbits __attribute__((vector_size(PIPEOPTIM_VEC_BYTES)));
typedef uint16_t vhalfbits __attribute__((vector_size(PIPEOPTIM_VEC_BYTES / 2)));
constexpr int64_t kLanes = PIPEOPTIM_VEC_BYTES / 4;

inline vfloat load_vec(const float* p) {
  vfloat x;
  __builtin_memcpy(&x, p, sizeof x);
  return x;
}

inline void store_vec(float* p, vfloat x) { __builtin_memcpy(p, &x, sizeof x); }

// The same bits as to_bf16, lane by lane.
inline vhalfbits to_bf16_vec(vfloat x) {
  const vbits u = reinterpret_cast<vbits>(x);
  const vbits rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const vbits quiet_nan = vbits{} + 0x7FC0u;
  return __builtin_convertvector((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded, vhalfbits);
}

// One aligned streaming store of a vector of results, converted to the output type.
template <int Out>
inline void stream_vec(void* p, vfloat x) {
#if PIPEOPTIM_VEC_BYTES == 64
  if (Out == OUT_F32) _mm512_stream_ps(static_cast<float*>(p), reinterpret_cast<__m512>(x));
  else if (Out == OUT_BF16) _mm256_stream_si256(static_cast<__m256i*>(p), reinterpret_cast<__m256i>(to_bf16_vec(x)));
  else _mm256_stream_si256(static_cast<__m256i*>(p), _mm512_maskz_cvtps_ph(0xFFFF, reinterpret_cast<__m512>(x), _MM_FROUND_TO_NEAREST_INT));
#else
  if (Out == OUT_F32) _mm256_stream_ps(static_cast<float*>(p), reinterpret_cast<__m256>(x));
  else if (Out == OUT_BF16) _mm_stream_si128(static_cast<__m128i*>(p), reinterpret_cast<__m128i>(to_bf16_vec(x)));
  else _mm_stream_si128(static_cast<__m128i*>(p), _mm256_cvtps_ph(reinterpret_cast<__m256>(x), _MM_FROUND_TO_NEAREST_INT));
#endif
}

// Software prefetch. On an AVX2-only AMD EPYC (Zen 3) the hardware prefetchers alone left in-place
// predict, which reads three buffers, about 10 % slower than torch's addcmul_ with the same traffic;
// asking for each input's line `ahead` elements early closed the gap (benchmarks/probe_cpu_prefetch.py).
// On the AVX-512 Xeon it measured no better, so each instruction set has its own default
// (ops_cpu.cpp). touch(i) prefetches element i of every input; ahead = 0 turns it off.
constexpr int64_t kLineFloats = 64 / 4;

template <class T>
inline void prefetch(const T* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// kLanes elements at a time through vec(i) from `first`, touching the inputs `ahead` elements early
// once per cache line (a line is kLanes or more elements), then the tail through one(i).
template <class One, class Vec, class Touch>
void vector_loop(int64_t first, int64_t n, int64_t ahead, One&& one, Vec&& vec, Touch&& touch) {
  int64_t i = first;
  for (; i + kLineFloats <= n; i += kLineFloats) {
    if (ahead > 0 && i + ahead < n) touch(i + ahead);
    for (int64_t j = i; j < i + kLineFloats; j += kLanes) vec(j);
  }
  for (; i < n; ++i) one(i);
}

// Element i through one(i) (ordinary store) until out is aligned for a vector store, then kLanes
// elements at a time through vec(i), streamed, then the tail through one(i) again.
template <int Out, class One, class Vec, class Touch>
void streamed(int64_t n, void* out, int64_t ahead, One&& one, Vec&& vec, Touch&& touch) {
  constexpr int64_t kAlign = kLanes * out_size<Out>();
  char* o = static_cast<char*>(out);
  int64_t i = 0;
  while (i < n && reinterpret_cast<uintptr_t>(o + i * out_size<Out>()) % kAlign != 0) one(i++);
  vector_loop(i, n, ahead, one, [&](int64_t j) { stream_vec<Out>(o + j * out_size<Out>(), vec(j)); }, touch);
  _mm_sfence();  // streaming stores are weakly ordered: make them visible before the op returns
}

// The vector ways a loop can write its output `out`, which with InPlace is one of its inputs: streaming
// stores when `stream` asks (never in place: there is no separate line to skip reading), else explicit
// vectors when prefetch is on and the output is fp32. one(i) computes and writes element i; vec(i)
// computes kLanes elements from i and returns them. False when neither applies: the caller then runs its
// element loop, which the compiler vectorises.
template <int Out, bool InPlace, class One, class Vec, class Touch>
bool vector_write(int64_t n, void* out, bool stream, int64_t ahead, One&& one, Vec&& vec, Touch&& touch) {
  if (stream && !InPlace) {
    streamed<Out>(n, out, ahead, one, vec, touch);
    return true;
  }
  if (Out == OUT_F32 && ahead > 0) {
    float* o = static_cast<float*>(out);
    vector_loop(0, n, ahead, one, [&](int64_t i) { store_vec(o + i, vec(i)); }, touch);
    return true;
  }
  return false;
}
#endif

// Each loop writes its output with ordinary stores (the compiler vectorises the scalar body) or, when
// `stream` is set and the target has vectors, with streaming stores. InPlace writes through w itself,
// so the compiler sees a same-index read and write instead of a possible overlap that would send it
// to its scalar fallback; in place there is no separate line to skip reading, so it never streams.
// With `ahead` > 0 (prefetch, above) the fp32 loops run on explicit vectors, which the prefetch needs;
// the vector and scalar bodies compute the same bits (rules.h).
template <bool HasM, bool HasG, int DenKind, bool HasVC, int Out, bool InPlace>
void predict_loop(int64_t n, const float* w, const float* m, const float* g, const float* v,
                  const float* vc, void* out, const PredictCoeffs& c, bool stream, int64_t ahead) {
  const PredictCoeffs k = c;
  auto one = [&](int64_t i) {
    return predict_one<HasM, HasG, DenKind, HasVC>(k, w[i], HasM ? m[i] : 0.f, HasG ? g[i] : 0.f,
                                                   DenKind ? v[i] : 0.f, HasVC ? vc[i] : 0.f);
  };
#if PIPEOPTIM_VEC_BYTES > 0
  const vfloat zero{};
  auto vec = [&](int64_t i) {
    return predict_one<HasM, HasG, DenKind, HasVC, vfloat>(
        k, load_vec(w + i), HasM ? load_vec(m + i) : zero, HasG ? load_vec(g + i) : zero,
        DenKind ? load_vec(v + i) : zero, HasVC ? load_vec(vc + i) : zero);
  };
  auto touch = [&](int64_t i) {
    prefetch(w + i);
    if (HasM) prefetch(m + i);
    if (HasG) prefetch(g + i);
    if (DenKind) prefetch(v + i);
    if (HasVC) prefetch(vc + i);
  };
  // (in place, out is w and Out is OUT_F32)
  if (vector_write<Out, InPlace>(n, out, stream, ahead, [&](int64_t i) { store<Out>(out, i, one(i)); }, vec, touch))
    return;
#endif
  (void)stream;
  (void)ahead;
  float* w_out = const_cast<float*>(w);
  for (int64_t i = 0; i < n; ++i) {
    if (InPlace) w_out[i] = one(i);
    else store<Out>(out, i, one(i));
  }
}

// IntoGrad: out is g itself (fp32), written through g so that, as for InPlace above, the compiler sees
// a same-index read and write.
template <bool Amsgrad, int Out, bool IntoGrad>
void adam_loop(int64_t n, float* w, const float* g, float* m, float* v, float* vmax, void* out,
               const AdamStepCoeffs& c, bool stream, int64_t ahead) {
  const AdamStepCoeffs k = c;
  float* g_out = const_cast<float*>(g);
  auto one = [&](int64_t i) {
    float wi = w[i], mi = m[i], vi = v[i], vmi = Amsgrad ? vmax[i] : 0.f;
    float r = adam_step_predict_one<Amsgrad>(k, wi, g[i], mi, vi, vmi);
    w[i] = wi;
    m[i] = mi;
    v[i] = vi;
    if (Amsgrad) vmax[i] = vmi;
    if (IntoGrad) g_out[i] = r;
    else store<Out>(out, i, r);
  };
#if PIPEOPTIM_VEC_BYTES > 0
  auto vec = [&](int64_t i) {
    vfloat wi = load_vec(w + i), mi = load_vec(m + i), vi = load_vec(v + i);
    vfloat vmi = Amsgrad ? load_vec(vmax + i) : vfloat{};
    vfloat r = adam_step_predict_one<Amsgrad, vfloat>(k, wi, load_vec(g + i), mi, vi, vmi);
    store_vec(w + i, wi);
    store_vec(m + i, mi);
    store_vec(v + i, vi);
    if (Amsgrad) store_vec(vmax + i, vmi);
    return r;
  };
  auto touch = [&](int64_t i) {
    prefetch(w + i);
    prefetch(g + i);
    prefetch(m + i);
    prefetch(v + i);
    if (Amsgrad) prefetch(vmax + i);
  };
  if (vector_write<Out, IntoGrad>(n, out, stream, ahead, one, vec, touch)) return;  // (IntoGrad: out is g)
#endif
  (void)stream;
  (void)ahead;
  for (int64_t i = 0; i < n; ++i) one(i);
}

template <bool HasMomentum, bool Nesterov, bool First, int Out, bool IntoGrad>
void sgd_loop(int64_t n, float* w, const float* g, float* buf, void* out, const SgdStepCoeffs& c, bool stream,
              int64_t ahead) {
  const SgdStepCoeffs k = c;
  float* g_out = const_cast<float*>(g);
  auto one = [&](int64_t i) {
    float wi = w[i], bi = HasMomentum ? buf[i] : 0.f;
    float r = sgd_step_predict_one<HasMomentum, Nesterov, First>(k, wi, g[i], bi);
    w[i] = wi;
    if (HasMomentum) buf[i] = bi;
    if (IntoGrad) g_out[i] = r;
    else store<Out>(out, i, r);
  };
#if PIPEOPTIM_VEC_BYTES > 0
  auto vec = [&](int64_t i) {
    vfloat wi = load_vec(w + i), bi = HasMomentum ? load_vec(buf + i) : vfloat{};
    vfloat r = sgd_step_predict_one<HasMomentum, Nesterov, First, vfloat>(k, wi, load_vec(g + i), bi);
    store_vec(w + i, wi);
    if (HasMomentum) store_vec(buf + i, bi);
    return r;
  };
  auto touch = [&](int64_t i) {
    prefetch(w + i);
    prefetch(g + i);
    if (HasMomentum) prefetch(buf + i);
  };
  if (vector_write<Out, IntoGrad>(n, out, stream, ahead, one, vec, touch)) return;  // (IntoGrad: out is g)
#endif
  (void)stream;
  (void)ahead;
  for (int64_t i = 0; i < n; ++i) one(i);
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
#define PIPEOPTIM_DEFINE_CPU_ENTRY_POINTS                                                            \
  void predict(int64_t n, const float* w, const float* m, const float* g, const float* v,            \
               const float* vc, void* out, int out_kind, int den, const PredictCoeffs& c, bool stream, \
               int64_t ahead) {                                                                      \
    with_bool(m != nullptr, [&](auto hm) {                                                           \
      with_bool(g != nullptr, [&](auto hg) {                                                         \
        with_den(den, [&](auto dk) {                                                                 \
          with_bool(vc != nullptr && dk == DEN_SQRT, [&](auto hvc) {                                 \
            if (out == static_cast<const void*>(w)) {                                                \
              predict_loop<hm, hg, dk, hvc, OUT_F32, true>(n, w, m, g, v, vc, out, c, false, ahead); \
            } else {                                                                                 \
              with_out(out_kind, [&](auto ok) {                                                      \
                predict_loop<hm, hg, dk, hvc, ok, false>(n, w, m, g, v, vc, out, c, stream, ahead);  \
              });                                                                                    \
            }                                                                                        \
          });                                                                                        \
        });                                                                                          \
      });                                                                                            \
    });                                                                                              \
  }                                                                                                  \
  void adam_step_predict(int64_t n, float* w, const float* g, float* m, float* v, float* vmax,       \
                         void* out, int out_kind, const AdamStepCoeffs& c, bool stream,              \
                         int64_t ahead) {                                                            \
    with_bool(vmax != nullptr, [&](auto ams) {                                                       \
      if (out == static_cast<const void*>(g)) {                                                      \
        adam_loop<ams, OUT_F32, true>(n, w, g, m, v, vmax, out, c, false, ahead);                    \
      } else {                                                                                       \
        with_out(out_kind, [&](auto ok) { adam_loop<ams, ok, false>(n, w, g, m, v, vmax, out, c, stream, ahead); }); \
      }                                                                                              \
    });                                                                                              \
  }                                                                                                  \
  void sgd_step_predict(int64_t n, float* w, const float* g, float* buf, void* out, int out_kind,    \
                        bool nesterov, bool first, const SgdStepCoeffs& c, bool stream,              \
                        int64_t ahead) {                                                             \
    with_bool(buf != nullptr, [&](auto hm) {                                                         \
      with_bool(nesterov, [&](auto nes) {                                                            \
        with_bool(first, [&](auto fst) {                                                             \
          if (out == static_cast<const void*>(g)) {                                                  \
            sgd_loop<hm, nes, fst, OUT_F32, true>(n, w, g, buf, out, c, false, ahead);               \
          } else {                                                                                   \
            with_out(out_kind, [&](auto ok) { sgd_loop<hm, nes, fst, ok, false>(n, w, g, buf, out, c, stream, ahead); }); \
          }                                                                                          \
        });                                                                                          \
      });                                                                                            \
    });                                                                                              \
  }

}  // namespace cpu
}  // namespace pipeoptim
