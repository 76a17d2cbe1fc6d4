// What this machine's memory charges for the access patterns of the kernels, without any arithmetic:
// reading k buffers, reading three and writing one back (in-place predict), reading three and writing a
// fourth with ordinary or streaming stores (predict into a separate buffer), and Adam's four reads and
// three write-backs. Each pattern runs round-robin with the others; the median of each is printed.
//
//   g++ -O3 -march=native -fopenmp benchmarks/memory_probe.cpp -o /tmp/memory_probe
//   OMP_NUM_THREADS=2 /tmp/memory_probe 67108864      # elements per buffer (fp32)
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

constexpr int kBuffers = 5;
constexpr long kLanes = 16;
float* buf[kBuffers];
long n_elems;

// Splits [0, n_elems) between the threads in whole vectors and runs body(begin, end) on each share.
void parallel(const std::function<void(long, long)>& body) {
#pragma omp parallel
  {
    const long threads = omp_get_num_threads(), t = omp_get_thread_num();
    const long share = (n_elems / kLanes / threads) * kLanes;
    const long begin = t * share, end = t == threads - 1 ? n_elems : begin + share;
    body(begin, end);
  }
}

float sink;

template <int K>
void read_k() {
  float total = 0;
  parallel([&](long b, long e) {
    __m512 acc = _mm512_setzero_ps();
    for (long i = b; i < e; i += kLanes)
      for (int k = 0; k < K; ++k) acc = _mm512_add_ps(acc, _mm512_load_ps(buf[k] + i));
#pragma omp atomic
    total += _mm512_reduce_add_ps(acc);
  });
  sink = total;
}

// out = -1: write back into buffer 0; otherwise write into buffer `out`, streaming or not.
template <int K, int Out, bool Stream, int WriteBacks = 1>
void read_write() {
  parallel([](long b, long e) {
    for (long i = b; i < e; i += kLanes) {
      __m512 acc = _mm512_load_ps(buf[0] + i);
      for (int k = 1; k < K; ++k) acc = _mm512_add_ps(acc, _mm512_load_ps(buf[k] + i));
      if (Out < 0) {
        for (int k = 0; k < WriteBacks; ++k) _mm512_store_ps(buf[k] + i, acc);
      } else if (Stream) {
        _mm512_stream_ps(buf[Out] + i, acc);
      } else {
        _mm512_store_ps(buf[Out] + i, acc);
      }
    }
    if (Stream) _mm_sfence();
  });
}

}  // namespace

int main(int argc, char** argv) {
  n_elems = argc > 1 ? std::atol(argv[1]) : (64L << 20);
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 9;
  for (auto& b : buf) {
    b = static_cast<float*>(std::aligned_alloc(64, n_elems * sizeof(float)));
    std::memset(b, 0, n_elems * sizeof(float));
  }
  struct Pattern {
    std::string name;
    int bytes;  // per element, counting each buffer read or written once
    void (*run)();
  };
  const std::vector<Pattern> patterns = {
      {"read 1 buffer", 4, read_k<1>},
      {"read 2 buffers", 8, read_k<2>},
      {"read 3 buffers", 12, read_k<3>},
      {"read 4 buffers", 16, read_k<4>},
      {"read 3, write 1 of them back (in-place predict)", 16, read_write<3, -1, false>},
      {"read 3, write a 4th, ordinary stores", 16, read_write<3, 3, false>},
      {"read 3, write a 4th, streaming stores", 16, read_write<3, 3, true>},
      {"read 4, write 3 of them back (Adam step)", 28, read_write<4, -1, false, 3>},
  };
  std::vector<std::vector<double>> ms(patterns.size());
  for (const auto& p : patterns) p.run();  // first touch and warm-up
  for (int r = 0; r < rounds; ++r)
    for (size_t k = 0; k < patterns.size(); ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      patterns[k].run();
      ms[k].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  std::printf("%ld fp32 elements per buffer, %d threads, median of %d rounds\n", n_elems, omp_get_max_threads(),
              rounds);
  for (size_t k = 0; k < patterns.size(); ++k) {
    std::sort(ms[k].begin(), ms[k].end());
    const double med = ms[k][ms[k].size() / 2];
    std::printf("%-50s %8.2f ms  %6.1f GB/s at %2d B/element\n", patterns[k].name.c_str(), med,
                patterns[k].bytes * double(n_elems) / med * 1e-6, patterns[k].bytes);
  }
  return 0;
}
