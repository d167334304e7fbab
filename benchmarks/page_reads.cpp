// The memory floor of one decode step's attention reads, no arithmetic: benchmarks/page_reads.py builds and runs it.
// L layers x H KV heads, each with float16 keys and values [rows, D]; per step and head: (full) every row read in
// order; (pages) k pages of `page` rows at random, ascending, as Quest's chosen pages; (summaries) every page's
// float16 minimum and maximum [rows / page, 2, D], in order, as Quest's bounds read them. Each byte is loaded and
// widened once (vcvtph2ps), summed so nothing is optimised away. Buffers on 4 KiB pages, or marked for
// transparent huge pages (`huge` 1); caches flushed before each repeat. Prints one line per mode: the median and
// best ms per step over `repeats`.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {
constexpr int64_t D = 64;

// n halves (a multiple of 64) widened and summed into 8 independent sums: the loads, not an add's latency, bound it
__m256 read(const uint16_t* p, int64_t n, __m256 acc) {
  __m256 a[8];
  for (auto& x : a) x = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 64)
    for (int j = 0; j < 8; ++j)
      a[j] = _mm256_add_ps(a[j], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + i + 8 * j))));
  for (auto& x : a) acc = _mm256_add_ps(acc, x);
  return acc;
}

uint16_t* buffer(size_t bytes, bool huge) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) std::exit(1);
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 0x11, bytes);  // touched: pages mapped before timing
  return static_cast<uint16_t*>(p);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: page_reads LAYERS HEADS ROWS PAGE PAGES_READ HUGE REPEATS THREADS\n");
    return 2;
  }
  omp_set_num_threads(atoi(argv[8]));  // the heads shared out, as the decode step's team shares them
  const int64_t L = atoll(argv[1]), H = atoll(argv[2]), rows = atoll(argv[3]), page = atoll(argv[4]),
                k = atoll(argv[5]), repeats = atoll(argv[7]);
  const bool huge = atoi(argv[6]) != 0;
  const int64_t P = rows / page, heads = L * H, per = rows * D;  // halves per K (or V) of one head
  uint16_t* kv = buffer(static_cast<size_t>(2 * heads * per) * 2, huge);
  uint16_t* summaries = buffer(static_cast<size_t>(heads * P * 2 * D) * 2, huge);
  const int64_t other = 64 << 20;  // halves (128 MiB, 4x the L3 of the machines measured) read between repeats:
  uint16_t* flush = buffer(static_cast<size_t>(other) * 2, huge);  // each repeat starts from memory, as a step does
  std::mt19937 rng(0);
  std::vector<std::vector<int64_t>> chosen(repeats * heads);  // drawn before timing
  std::vector<int64_t> all(P);
  for (auto& c : chosen) {
    for (int64_t i = 0; i < P; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    c.assign(all.begin(), all.begin() + std::min(k, P));
    std::sort(c.begin(), c.end());
  }
  __m256 acc = _mm256_setzero_ps();
  for (const char* mode : {"full", "pages", "summaries"}) {
    std::vector<double> ms;
    for (int64_t r = 0; r < repeats; ++r) {
      acc = read(flush, other, acc);
      const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
      {
        __m256 mine = _mm256_setzero_ps();
#pragma omp for schedule(static)
        for (int64_t h = 0; h < heads; ++h) {
          const uint16_t *K = kv + 2 * h * per, *V = K + per;
          if (mode[0] == 'f') mine = read(V, per, read(K, per, mine));
          else if (mode[0] == 's') mine = read(summaries + h * P * 2 * D, P * 2 * D, mine);
          else
            for (int64_t p : chosen[r * heads + h])
              mine = read(V + p * page * D, page * D, read(K + p * page * D, page * D, mine));
        }
#pragma omp critical
        acc = _mm256_add_ps(acc, mine);
      }
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    std::printf("%s %.3f %.3f\n", mode, ms[ms.size() / 2], ms[0]);
  }
  float sink[8];
  _mm256_storeu_ps(sink, acc);
  return sink[0] == 1234.5f;  // keeps the sums alive
}
