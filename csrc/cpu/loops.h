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

template <int Out>
constexpr int out_size() { return Out == OUT_F32 ? 4 : 2; }

// Non-temporal copy of a small, cache-hot block to its final place. A separate output buffer written
// with ordinary stores is first read into cache (read-for-ownership): 4 extra bytes per fp32 element,
// a quarter of Adam's minimal traffic. Streaming stores skip that read; whether that wins depends on
// the processor (ops_cpu.cpp says what was measured and how to turn it on).
inline void stream_store(void* dst, const void* src, int64_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if PIPEOPTIM_STREAM_WIDTH > 0
  constexpr int64_t W = PIPEOPTIM_STREAM_WIDTH;
  const int64_t head = ((W - int64_t(reinterpret_cast<uintptr_t>(d) % W)) % W);
  if (head >= bytes) {
    __builtin_memcpy(d, s, bytes);
    return;
  }
  __builtin_memcpy(d, s, head);
  d += head, s += head, bytes -= head;
  for (; bytes >= W; bytes -= W, d += W, s += W) {
#if PIPEOPTIM_STREAM_WIDTH == 64
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d), _mm512_loadu_si512(s));
#else
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
#endif
  }
#endif
  __builtin_memcpy(d, s, bytes);
}

inline void stream_fence() {
#if PIPEOPTIM_STREAM_WIDTH > 0
  _mm_sfence();
#endif
}

// Elements per block when streaming: the block lives in L1 between the maths and the store.
constexpr int64_t kStreamBlock = 2048;

// Runs body(begin, len, block_out) over blocks, streaming each block to out + begin.
template <int Out, class Body>
void streamed(int64_t n, void* out, Body&& body) {
  alignas(64) unsigned char block[kStreamBlock * 4];
  for (int64_t b = 0; b < n; b += kStreamBlock) {
    const int64_t len = n - b < kStreamBlock ? n - b : kStreamBlock;
    body(b, len, static_cast<void*>(block));
    stream_store(static_cast<char*>(out) + b * out_size<Out>(), block, len * out_size<Out>());
  }
  stream_fence();
}

// InPlace writes through w itself, so the compiler sees a same-index read and write instead of a
// possible overlap that would send it to its scalar fallback.
template <bool HasM, bool HasG, int DenKind, bool HasVC, int Out, bool InPlace>
void predict_loop(int64_t n, const float* w, const float* m, const float* g, const float* v,
                  const float* vc, void* out, const PredictCoeffs& c, bool stream) {
  if (!InPlace && stream) {
    streamed<Out>(n, out, [&](int64_t b, int64_t len, void* block) {
      predict_loop<HasM, HasG, DenKind, HasVC, Out, false>(len, w + b, HasM ? m + b : m, HasG ? g + b : g,
                                                          DenKind ? v + b : v, HasVC ? vc + b : vc, block, c, false);
    });
    return;
  }
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
               const AdamStepCoeffs& c, bool stream) {
  if (stream) {
    streamed<Out>(n, out, [&](int64_t b, int64_t len, void* block) {
      adam_loop<Amsgrad, Out>(len, w + b, g + b, m + b, v + b, Amsgrad ? vmax + b : vmax, block, c, false);
    });
    return;
  }
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
void sgd_loop(int64_t n, float* w, const float* g, float* buf, void* out, const SgdStepCoeffs& c, bool stream) {
  if (stream) {
    streamed<Out>(n, out, [&](int64_t b, int64_t len, void* block) {
      sgd_loop<HasMomentum, Nesterov, First, Out>(len, w + b, g + b, HasMomentum ? buf + b : buf, block, c, false);
    });
    return;
  }
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
               const float* vc, void* out, int out_kind, int den, const PredictCoeffs& c, bool stream) { \
    with_bool(m != nullptr, [&](auto hm) {                                                         \
      with_bool(g != nullptr, [&](auto hg) {                                                       \
        with_den(den, [&](auto dk) {                                                               \
          with_bool(vc != nullptr && dk == DEN_SQRT, [&](auto hvc) {                               \
            if (out == static_cast<const void*>(w)) {                                              \
              predict_loop<hm, hg, dk, hvc, OUT_F32, true>(n, w, m, g, v, vc, out, c, false);       \
            } else {                                                                               \
              with_out(out_kind, [&](auto ok) {                                                    \
                predict_loop<hm, hg, dk, hvc, ok, false>(n, w, m, g, v, vc, out, c, stream);        \
              });                                                                                  \
            }                                                                                      \
          });                                                                                      \
        });                                                                                        \
      });                                                                                          \
    });                                                                                            \
  }                                                                                                \
  void adam_step_predict(int64_t n, float* w, const float* g, float* m, float* v, float* vmax,       \
                         void* out, int out_kind, const AdamStepCoeffs& c, bool stream) {           \
    with_bool(vmax != nullptr, [&](auto ams) {                                                     \
      with_out(out_kind, [&](auto ok) { adam_loop<ams, ok>(n, w, g, m, v, vmax, out, c, stream); }); \
    });                                                                                            \
  }                                                                                                \
  void sgd_step_predict(int64_t n, float* w, const float* g, float* buf, void* out, int out_kind,   \
                        bool nesterov, bool first, const SgdStepCoeffs& c, bool stream) {           \
    with_bool(buf != nullptr, [&](auto hm) {                                                       \
      with_bool(nesterov, [&](auto nes) {                                                          \
        with_bool(first, [&](auto fst) {                                                           \
          with_out(out_kind, [&](auto ok) { sgd_loop<hm, nes, fst, ok>(n, w, g, buf, out, c, stream); }); \
        });                                                                                        \
      });                                                                                          \
    });                                                                                            \
  }

}  // namespace cpu
}  // namespace pipeoptim
