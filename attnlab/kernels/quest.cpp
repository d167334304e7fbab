// Quest's page selection in the native decode step: see quest.h (and attnlab/model/quest.py, the reference).
#include "quest.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "kernels_simd.h"
#include "ops.h"

namespace attnlab_quest {

namespace {

inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// lane j = the sum of a[j]'s lanes (one transposed pass, as attend.cpp's)
inline __m128 hsum4(const __m256* a) {
  const __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));
  const __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, 0x44), _mm256_shuffle_ps(s01, s23, 0xEE));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// The registers the bounds and the channel scores run on: 8 float lanes, or 16 on AVX-512 (half the conversions,
// loads and FMAs for the same bytes). fold: the lanes summed down to 8 (hsum4's input).
struct Lanes8 {
  using F = __m256;
  static constexpr int N = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F half(const uint16_t* p) { return half8(p); }
  static F codes(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F splat(float x) { return _mm256_set1_ps(x); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store_mul(float* out, F a, const float* b) { _mm256_storeu_ps(out, _mm256_mul_ps(a, _mm256_loadu_ps(b))); }
  static __m256 fold(F a) { return a; }
};
#if defined(__AVX512F__)
struct Lanes16 {
  using F = __m512;
  static constexpr int N = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F codes(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F splat(float x) { return _mm512_set1_ps(x); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store_mul(float* out, F a, const float* b) { _mm512_storeu_ps(out, _mm512_mul_ps(a, _mm512_loadu_ps(b))); }
  static __m256 fold(F a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }
};
using Widest = Lanes16;
#else
using Widest = Lanes8;
#endif

// The bounds go 4 pages x up to 3 query heads at a time: 12 independent FMA chains (a page's own chain waits on
// the FMA latency), each page's float16 summaries widened once for the 3 heads. D a multiple of W::N.
template <class W, int GN>  // query heads up..up + GN (of the group), pages p .. p + 3: best[j] = max(best[j], bounds)
inline void bound4(const float* up, const uint16_t* lo, const uint16_t* hi, int64_t D, int64_t p, __m128& best) {
  typename W::F acc[GN][4];
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = W::zero();
  for (int64_t c = 0; c < D; c += W::N)
    for (int j = 0; j < 4; ++j) {
      const typename W::F a = W::half(hi + (p + j) * D + c), b = W::half(lo + (p + j) * D + c);
      for (int g = 0; g < GN; ++g) {  // hi . max(q, 0) + lo . min(q, 0), as the eager two matmuls
        acc[g][j] = W::fma(a, W::load(up + 2 * g * D + c), acc[g][j]);
        acc[g][j] = W::fma(b, W::load(up + (2 * g + 1) * D + c), acc[g][j]);
      }
    }
  for (int g = 0; g < GN; ++g) {
    const __m256 f[4] = {W::fold(acc[g][0]), W::fold(acc[g][1]), W::fold(acc[g][2]), W::fold(acc[g][3])};
    best = _mm_max_ps(best, hsum4(f));
  }
}

template <int GN>  // bound4 on the widest lanes D allows
inline void bound4_best(const float* up, const uint16_t* lo, const uint16_t* hi, int64_t D, int64_t p, __m128& best) {
  if (D % Widest::N == 0) bound4<Widest, GN>(up, lo, hi, D, p, best);
  else bound4<Lanes8, GN>(up, lo, hi, D, p, best);
}

// score_keys' passes of 8 W::N keys from t (8 independent FMA chains: one chain would wait on the FMA latency);
// returns where they stopped
template <class W>
inline int64_t score_passes(const float* q, const int8_t* kt, const float* ks, const int64_t* order, int64_t R,
                            int64_t ld, int64_t t, int64_t n, float* m) {
  for (; t + 8 * W::N <= n; t += 8 * W::N) {
    typename W::F acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = W::zero();
    for (int64_t i = 0; i < R; ++i) {
      const int8_t* row = kt + order[i] * ld + t;
      const typename W::F w = W::splat(q[i]);
      for (int j = 0; j < 8; ++j) acc[j] = W::fma(w, W::codes(row + W::N * j), acc[j]);
    }
    for (int j = 0; j < 8; ++j) W::store_mul(m + t + W::N * j, acc[j], ks + t + W::N * j);
  }
  return t;
}

// Keys 0 .. n - 1 of channel-major int8 rows kt (channel c at kt + c * ld) with scales ks: m[t] = ks[t] * sum_i q[i]
// * code[order[i]][t]; 8 x 16 keys at a time on AVX-512, 8 x 8, then 8, then 1.
inline void score_keys(const float* q, const int8_t* kt, const float* ks, const int64_t* order, int64_t R, int64_t ld,
                       int64_t n, float* m) {
  int64_t t = score_passes<Widest>(q, kt, ks, order, R, ld, 0, n, m);
  t = score_passes<Lanes8>(q, kt, ks, order, R, ld, t, n, m);
  for (; t + 8 <= n; t += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < R; ++i) acc = _mm256_fmadd_ps(_mm256_set1_ps(q[i]), Lanes8::codes(kt + order[i] * ld + t), acc);
    _mm256_storeu_ps(m + t, _mm256_mul_ps(acc, _mm256_loadu_ps(ks + t)));
  }
  for (; t < n; ++t) {  // pages of fewer than 8 slots: the tail
    float acc = 0.f;
    for (int64_t i = 0; i < R; ++i) acc = std::fma(q[i], static_cast<float>(kt[order[i] * ld + t]), acc);
    m[t] = acc * ks[t];
  }
}

}  // namespace

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
    const uint16_t *lo = pg.lo + h * pg.head, *hi = pg.hi + h * pg.head;
    float* o = out + h * ld;
    int64_t p = p0;
    for (; p + 4 <= p1; p += 4) {  // 4 pages x 3 query heads: 12 independent FMA chains, each page widened once
      __m128 best = _mm_set1_ps(-INFINITY);
      for (int64_t g = 0; g < G; g += 3) {
        const float* up = split.data() + 2 * g * D;
        if (G - g >= 3) bound4_best<3>(up, lo, hi, D, p, best);
        else if (G - g == 2) bound4_best<2>(up, lo, hi, D, p, best);
        else bound4_best<1>(up, lo, hi, D, p, best);
      }
      _mm_storeu_ps(o + p, best);
    }
    for (; p < p1; ++p) {
      float best = -INFINITY;
      for (int64_t g = 0; g < G; ++g) {
        const float *up = split.data() + 2 * g * D, *down = up + D;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < D; c += 8) {
          acc = _mm256_fmadd_ps(half8(hi + p * D + c), _mm256_loadu_ps(up + c), acc);
          acc = _mm256_fmadd_ps(half8(lo + p * D + c), _mm256_loadu_ps(down + c), acc);
        }
        best = std::max(best, attnlab_simd::hsum(acc));
      }
      o[p] = best;
    }
  }
}

void score_share(const float* q, const Pages& pg, int64_t Hkv, int64_t G, int64_t D, int64_t P, int64_t channels,
                 int64_t tid, int64_t threads, float* out, int64_t ld) {
  const int64_t mid = P - 2, p0 = 1 + mid * tid / threads, p1 = 1 + mid * (tid + 1) / threads;
  if (p1 <= p0) return;
  const int64_t page = pg.size, s0 = p0 * page, s1 = p1 * page, R = channels;  // pages before P - 1 are whole
  thread_local std::vector<float> sum, qs, best;
  thread_local std::vector<int64_t> order;
  sum.resize(D), order.resize(D), qs.resize(R), best.resize(s1 - s0);
  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t c = 0; c < D; ++c) {  // the group's query, summed in head order as the eager reference
      float x = 0.f;
      for (int64_t g = 0; g < G; ++g) x += q[(h * G + g) * D + c];
      sum[c] = x;
    }
    std::iota(order.begin(), order.end(), int64_t{0});
    const float* w = sum.data();
    std::partial_sort(order.begin(), order.begin() + R, order.end(), [w](int64_t a, int64_t b) {
      return std::fabs(w[a]) > std::fabs(w[b]) || (std::fabs(w[a]) == std::fabs(w[b]) && a < b);
    });
    for (int64_t i = 0; i < R; ++i) qs[i] = sum[order[i]];
    score_keys(qs.data(), pg.keys_t + h * pg.t_head + s0, pg.keys_s + h * pg.s_head + s0, order.data(), R, pg.t_row,
               s1 - s0, best.data());  // best[t - s0] for key t
    float* o = out + h * ld;
    for (int64_t p = p0; p < p1; ++p) o[p] = *std::max_element(best.begin() + (p - p0) * page, best.begin() + (p - p0 + 1) * page);
  }
}

void select(const float* bounds, int64_t P, int64_t k, int64_t* pages) {
  // The (k - 2)-th highest bound by bisection over the bounds as integers ordered as the floats are (32 counting
  // passes the compiler vectorises), then one ascending pass takes every page above it and, lowest first, as many
  // equal to it as fit: the order the comparison (bound, then page) gives, already sorted. Ranking through that
  // comparison (nth_element, its branches mispredicted on every other page) cost half the bounds' own time.
  thread_local std::vector<int32_t> key;  // a NaN bound ranks last, as -inf (a strict weak order needs it placed)
  const int64_t m = P - 2, want = k - 2;
  pages[0] = 0, pages[k - 1] = P - 1;
  if (want <= 0) return;
  key.resize(m);
  for (int64_t p = 0; p < m; ++p) {
    const float x = bounds[p + 1], b = std::isnan(x) ? -INFINITY : x == 0.f ? 0.f : x;  // -0 ties +0, as floats
    int32_t i;
    std::memcpy(&i, &b, 4);
    key[p] = i < 0 ? i ^ 0x7fffffff : i;  // negative floats' bits count down: flipped, signed order = float order
  }
  const int32_t* kk = key.data();
  auto at_least = [kk, m](int32_t t) {
    int64_t c = 0;
    for (int64_t p = 0; p < m; ++p) c += kk[p] >= t;
    return c;
  };
  int64_t lo = INT32_MIN, hi = INT32_MAX;  // the largest t with at_least(t) >= want: at_least(lo) = m >= want
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (at_least(static_cast<int32_t>(mid)) >= want) lo = mid;
    else hi = mid - 1;
  }
  const int32_t cut = static_cast<int32_t>(lo);
  int64_t ties = want - (cut == INT32_MAX ? 0 : at_least(cut + 1));
  for (int64_t p = 0, i = 1; p < m && i <= want; ++p)
    if (kk[p] > cut || (kk[p] == cut && ties-- > 0)) pages[i++] = p + 1;
}

void attend_share(const float* q, const attnlab_attend::Cache& c, const float* bounds, int64_t ld, int64_t Hkv,
                  int64_t G, int64_t D, int64_t P, int64_t k, int64_t page, int64_t n, int64_t tid, int64_t threads,
                  float scale, float* out, float* lse) {
  thread_local std::vector<int64_t> pages, runs;  // runs: [first slot, end) of each run of adjacent chosen pages
  pages.resize(k), runs.resize(2 * k);
  const int64_t bytes = c.dtype == 0 ? 4 : c.dtype == 1 ? 2 : 1;
  const int64_t i0 = k * tid / threads, i1 = k * (tid + 1) / threads;
  for (int64_t h = 0; h < Hkv; ++h) {
    float *o = out + h * G * D, *l = lse + h * G;
    if (i1 <= i0) {
      std::fill_n(l, G, -INFINITY);
      continue;
    }
    select(bounds + h * ld, P, k, pages.data());
    int64_t m = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s0 = pages[i] * page, s1 = std::min(n, s0 + page);
      if (m && runs[2 * m - 1] == s0) runs[2 * m - 1] = s1;
      else runs[2 * m] = s0, runs[2 * m + 1] = s1, ++m;
    }
    attnlab_attend::Cache one = c;  // KV head h alone
    one.k = static_cast<const char*>(c.k) + h * c.head * bytes;
    one.v = static_cast<const char*>(c.v) + h * c.head * bytes;
    if (c.ks) one.ks = c.ks + h * c.shead, one.vs = c.vs + h * c.shead;
    attnlab_attend::runs(q + h * G * D, one, G, D, runs.data(), m, scale, o, l);
  }
}

void add_key(const Pages& pg, const attnlab_attend::Cache& c, int64_t Hkv, int64_t slot, int64_t D) {
  thread_local std::vector<float> key;
  key.resize(D);
  constexpr int kDown = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC, kUp = _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC;
  for (int64_t h = 0; h < Hkv; ++h) {
    const int64_t at = h * c.head + slot * c.row;
    for (int64_t i = 0; i < D; ++i)
      key[i] = c.dtype == 0   ? static_cast<const float*>(c.k)[at + i]
               : c.dtype == 1 ? static_cast<float>(static_cast<const attnlab::Half*>(c.k)[at + i])
                              : static_cast<float>(static_cast<const int8_t*>(c.k)[at + i]) *
                                    c.ks[h * c.shead + slot * c.srow + i / 32];
    if (pg.keys_t) {  // as channel_codes: one scale per key, codes rounded to nearest even (the default mode)
      float top = 0.f;
      for (int64_t i = 0; i < D; ++i) top = std::max(top, std::fabs(key[i]));
      const float scale = top / 127.f;
      for (int64_t i = 0; i < D; ++i)
        pg.keys_t[h * pg.t_head + i * pg.t_row + slot] =
            static_cast<int8_t>(scale > 0.f ? std::clamp(std::nearbyint(key[i] / scale), -127.f, 127.f) : 0.f);
      pg.keys_s[h * pg.s_head + slot] = scale;
    }
    uint16_t *lo = pg.lo + h * pg.head + slot / pg.size * D, *hi = pg.hi + h * pg.head + slot / pg.size * D;
    const bool opens = slot % pg.size == 0;
    for (int64_t i = 0; i < D; i += 8) {  // min and max in float32, stored rounded outward (the eager `outward`)
      __m256 k = _mm256_loadu_ps(key.data() + i), a = k, b = k;
      if (!opens) a = _mm256_min_ps(half8(lo + i), k), b = _mm256_max_ps(half8(hi + i), k);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i), _mm256_cvtps_ph(a, kDown));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), _mm256_cvtps_ph(b, kUp));
    }
  }
}

}  // namespace attnlab_quest
