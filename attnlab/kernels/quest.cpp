// Quest's page selection in the native decode step: see quest.h (and attnlab/model/quest.py, the reference).
#include "quest.h"

#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels_simd.h"

namespace attnlab_quest {

void bound_share(const float* q, const Pages& pg, int64_t Hkv, int64_t G, int64_t D, int64_t P, int64_t tid,
                 int64_t threads, float* out, int64_t ld) {
  const int64_t mid = P - 2, p0 = 1 + mid * tid / threads, p1 = 1 + mid * (tid + 1) / threads;
  if (p1 <= p0) return;
  thread_local std::vector<float> split;  // per query head: max(q, 0), then min(q, 0)
  split.resize(2 * G * D);
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < D; ++c) {
        const float x = q[(h * G + g) * D + c];
        split[2 * g * D + c] = std::max(x, 0.f), split[(2 * g + 1) * D + c] = std::min(x, 0.f);
      }
    const float *lo = pg.lo + h * pg.head, *hi = pg.hi + h * pg.head;
    for (int64_t p = p0; p < p1; ++p) {
      float best = -INFINITY;
      for (int64_t g = 0; g < G; ++g) {  // hi . max(q, 0) + lo . min(q, 0), as the eager two matmuls
        const float *up = split.data() + 2 * g * D, *down = up + D;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < D; c += 8) {
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(hi + p * D + c), _mm256_loadu_ps(up + c), acc);
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(lo + p * D + c), _mm256_loadu_ps(down + c), acc);
        }
        best = std::max(best, attnlab_simd::hsum(acc));
      }
      out[h * ld + p] = best;
    }
  }
}

void select(const float* bounds, int64_t P, int64_t k, int64_t* pages) {
  thread_local std::vector<int64_t> middle;
  middle.resize(P - 2);
  std::iota(middle.begin(), middle.end(), int64_t{1});
  // a NaN bound ranks last (a strict weak order needs it placed somewhere)
  auto key = [bounds](int64_t p) { return std::isnan(bounds[p]) ? -INFINITY : bounds[p]; };
  std::nth_element(middle.begin(), middle.begin() + (k - 2), middle.end(),
                   [&](int64_t a, int64_t b) { return key(a) > key(b) || (key(a) == key(b) && a < b); });
  pages[0] = 0;
  std::copy_n(middle.begin(), k - 2, pages + 1);
  std::sort(pages + 1, pages + k - 1);
  pages[k - 1] = P - 1;
}

namespace {

// The cache of KV head h alone (stretch's Hkv = 1).
attnlab_attend::Cache head_of(const attnlab_attend::Cache& c, int64_t h) {
  const int64_t bytes = c.dtype == 0 ? 4 : c.dtype == 1 ? 2 : 1;
  attnlab_attend::Cache one = c;
  one.k = static_cast<const char*>(c.k) + h * c.head * bytes;
  one.v = static_cast<const char*>(c.v) + h * c.head * bytes;
  if (c.ks) one.ks = c.ks + h * c.shead, one.vs = c.vs + h * c.shead;
  return one;
}

}  // namespace

void attend_share(const float* q, const attnlab_attend::Cache& c, const float* bounds, int64_t ld, int64_t Hkv,
                  int64_t G, int64_t D, int64_t P, int64_t k, int64_t page, int64_t n, int64_t tid, int64_t threads,
                  float scale, float* out, float* lse) {
  thread_local std::vector<int64_t> pages;
  thread_local std::vector<float> more;  // a later run's out [G, D] and lse [G]
  pages.resize(k), more.resize(G * D + G);
  const int64_t i0 = k * tid / threads, i1 = k * (tid + 1) / threads;
  for (int64_t h = 0; h < Hkv; ++h) {
    float *o = out + h * G * D, *l = lse + h * G;
    std::fill_n(l, G, -INFINITY);
    if (i1 <= i0) continue;
    select(bounds + h * ld, P, k, pages.data());
    const attnlab_attend::Cache one = head_of(c, h);
    bool first = true;
    for (int64_t i = i0; i < i1;) {  // each run of adjacent pages in one pass
      int64_t j = i + 1;
      while (j < i1 && pages[j] == pages[j - 1] + 1) ++j;
      const int64_t s0 = pages[i] * page, s1 = std::min(n, (pages[j - 1] + 1) * page);
      float *o2 = first ? o : more.data(), *l2 = first ? l : more.data() + G * D;
      attnlab_attend::stretch(q + h * G * D, one, 1, G, D, s0, s1, scale, o2, l2);
      if (!first)
        for (int64_t g = 0; g < G; ++g) {  // merge by log-sum-exp
          const float top = std::max(l[g], l2[g]), a = std::exp(l[g] - top), b = std::exp(l2[g] - top);
          for (int64_t d = 0; d < D; ++d) o[g * D + d] = (a * o[g * D + d] + b * o2[g * D + d]) / (a + b);
          l[g] = top + std::log(a + b);
        }
      first = false;
      i = j;
    }
  }
}

void add_key(const Pages& pg, const attnlab_attend::Cache& c, int64_t Hkv, int64_t slot, int64_t D) {
  thread_local std::vector<float> key;
  key.resize(D);
  for (int64_t h = 0; h < Hkv; ++h) {
    const int64_t at = h * c.head + slot * c.row;
    for (int64_t i = 0; i < D; ++i)
      key[i] = c.dtype == 0   ? static_cast<const float*>(c.k)[at + i]
               : c.dtype == 1 ? static_cast<float>(static_cast<const c10::Half*>(c.k)[at + i])
                              : static_cast<float>(static_cast<const int8_t*>(c.k)[at + i]) *
                                    c.ks[h * c.shead + slot * c.srow + i / 32];
    float *lo = pg.lo + h * pg.head + slot / pg.size * D, *hi = pg.hi + h * pg.head + slot / pg.size * D;
    if (slot % pg.size == 0) {
      std::copy_n(key.data(), D, lo), std::copy_n(key.data(), D, hi);
      continue;
    }
    for (int64_t i = 0; i < D; ++i) lo[i] = std::min(lo[i], key[i]), hi[i] = std::max(hi[i], key[i]);
  }
}

}  // namespace attnlab_quest
