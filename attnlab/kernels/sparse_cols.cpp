// TEAL's column-sparse matvec for batch-1 decoding: one fused op per projection.
//
// y = W x with x thresholded: an input channel j whose |x_j| <= tau is dropped, so its column of W is
// never read. The weight is stored transposed, wt [K inputs, N outputs], so one input channel's
// weights are one contiguous row: the op selects the active channels (threshold, select), then streams
// each active row once and accumulates a_j * wt[j] into y (gather-accumulate), y kept in L1.
//   f32: wt float32 [K, N]
//   q8:  q int8 [K, N], scale [K, N/32]               w = q * s          (groups of 32 outputs)
//   q4:  qs uint8 [K, N/2], scale, min [K, N/32]       w = code * s + m   (ggml's Q4 nibble layout: byte
//        i of a 16-byte block holds output i in its low nibble and output i + 16 in its high one)
// Quantised along the output dimension because a row here is one input channel (see docs/dejavu.md).
// f32 and q8 multiply in float (dequantised in registers), four rows per pass over the thread's slice
// of y; q4 multiplies in integers (q4_cols_int below: its coefficients rounded to int8 per 8 rows and
// block, as the dense kernels round activations). The next pass's rows are prefetched (they are
// scattered, so the hardware prefetcher restarts at each). AVX2 + FMA everywhere, 16-lane AVX-512 paths
// for f32/q8 where the build has them. Columns split across torch's threads (none at 1 thread).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

using attnlab::Alloc;
using attnlab::View;

namespace {

constexpr int ROWS = 4;  // rows accumulated per pass

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int VN = 2;  // vectors per 32-column block
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float a) { return _mm512_set1_ps(a); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void block_f32(const float* p, Vec v[VN]) { v[0] = _mm512_loadu_ps(p), v[1] = _mm512_loadu_ps(p + 16); }
inline void block_q8(const int8_t* p, Vec v[VN]) {
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i))));
}
#else
using Vec = __m256;
constexpr int VN = 4;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float a) { return _mm256_set1_ps(a); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void block_f32(const float* p, Vec v[VN]) {
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(p + 8 * i);
}
inline void block_q8(const int8_t* p, Vec v[VN]) {
  for (int i = 0; i < 4; ++i)
    v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
}
#endif

// The active channels of x [K]: |x_j| > tau (tau < 0 keeps them all). Per-thread buffers, reused.
struct Active {
  const int64_t* idx;
  const float* a;
  int64_t k;
  // by_magnitude: ordered by |x_j|'s binary exponent (a counting sort, largest first), so the rows the q4
  // kernel rounds to one int8 scale have coefficients of similar size (about 3x less rounding error)
  Active(const float* x, int64_t K, float tau, bool by_magnitude = false) {
    thread_local std::vector<int64_t> ib, sb;
    thread_local std::vector<float> ab, tb;
    if (static_cast<int64_t>(ib.size()) < K) ib.resize(K), ab.resize(K), sb.resize(K), tb.resize(K);
    k = 0;
    for (int64_t j = 0; j < K; ++j)
      if (std::fabs(x[j]) > tau) ib[k] = j, ab[k++] = x[j];
    idx = ib.data(), a = ab.data();
    if (!by_magnitude || k < 16) return;
    int64_t count[257] = {0};
    auto bucket = [&](float v) {  // 255 - biased exponent: larger magnitudes first
      uint32_t u;
      std::memcpy(&u, &v, 4);
      return 255 - static_cast<int>((u >> 23) & 0xFF);
    };
    for (int64_t t = 0; t < k; ++t) ++count[bucket(ab[t]) + 1];
    for (int e = 1; e < 257; ++e) count[e] += count[e - 1];
    for (int64_t t = 0; t < k; ++t) {
      const int64_t at = count[bucket(ab[t])]++;
      sb[at] = ib[t], tb[at] = ab[t];
    }
    idx = sb.data(), a = tb.data();
  }
};

// y [N] = sum over active j of a_j * row j (f32, q8), rows given by fmt: fmt.row(j) -> a Row (its code and
// scale pointers, looked up once per pass), fmt.block(row, b, v) loads block b (32 outputs) as floats,
// fmt.scale(row, b) its factor, fmt.addr(row, b) for prefetching.
template <class Fmt>
View cols(const Alloc& alloc, const View& x, double tau, int64_t K, int64_t N, const Fmt& fmt) {
  ATTNLAB_CHECK(x.scalar_type() == attnlab::kFloat && x.is_contiguous() && x.numel() == K,
              "x must be a contiguous float32 vector of size ", K);
  ATTNLAB_CHECK(N % 32 == 0, "the output size must be a multiple of 32, got ", N);
  const Active act(x.data_ptr<float>(), K, static_cast<float>(tau));
  auto out = alloc({N}, attnlab::kFloat, Alloc::ZEROED);
  float* O = out.data_ptr<float>();
  const int64_t nb = N / 32;
  using Row = typename Fmt::Row;
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t j = 0; j < act.k; j += ROWS) {
      const int n = static_cast<int>(std::min<int64_t>(ROWS, act.k - j));
      const int nn = static_cast<int>(std::min<int64_t>(ROWS, act.k - j - n));
      Row r[ROWS], next[ROWS];
      float a[ROWS];
      for (int t = 0; t < n; ++t) r[t] = fmt.row(act.idx[j + t]), a[t] = act.a[j + t];
      for (int t = 0; t < nn; ++t) next[t] = fmt.row(act.idx[j + n + t]);
      for (int64_t b = b0; b < b1; ++b) {
        for (int t = 0; t < nn; ++t) _mm_prefetch(fmt.addr(next[t], b), _MM_HINT_T0);
        Vec acc[VN];
        for (int i = 0; i < VN; ++i) acc[i] = vload(O + b * 32 + i * (32 / VN));
        for (int t = 0; t < n; ++t) {
          Vec v[VN];
          fmt.block(r[t], b, v);
          const Vec c = vset1(a[t] * fmt.scale(r[t], b));
          for (int i = 0; i < VN; ++i) acc[i] = vfma(v[i], c, acc[i]);
        }
        for (int i = 0; i < VN; ++i) vstore(O + b * 32 + i * (32 / VN), acc[i]);
      }
    }
  };
  if (attnlab::num_threads() == 1 || act.k * N < (1 << 16)) run(0, nb); else attnlab::parallel_for(0, nb, 4, run);
  return out;
}

void check_scales(const View& w, int64_t K, int64_t N, int64_t group, std::initializer_list<View> ps) {
  ATTNLAB_CHECK(w.is_contiguous() && w.dim() == 2 && w.size(0) == K, "weights must be contiguous [K, *]");
  ATTNLAB_CHECK(group == 32, "the column-sparse formats quantise in groups of 32 outputs, got group ", group);
  for (const auto& p : ps)
    ATTNLAB_CHECK(p.scalar_type() == attnlab::kFloat && p.is_contiguous() && p.numel() == K * (N / 32),
                "scales must be contiguous float32 [K, N/32]");
}

struct F32 {
  struct Row { const float* w; };
  const float* W;
  int64_t N;
  Row row(int64_t j) const { return {W + j * N}; }
  void block(const Row& r, int64_t b, Vec* v) const { block_f32(r.w + b * 32, v); }
  float scale(const Row&, int64_t) const { return 1.f; }
  const char* addr(const Row& r, int64_t b) const { return reinterpret_cast<const char*>(r.w + b * 32); }
};

struct Q8 {
  struct Row { const int8_t* q; const float* s; };
  const int8_t* Q;
  const float* S;
  int64_t N;
  Row row(int64_t j) const { return {Q + j * N, S + j * (N / 32)}; }
  void block(const Row& r, int64_t b, Vec* v) const { block_q8(r.q + b * 32, v); }
  float scale(const Row& r, int64_t b) const { return r.s[b]; }
  const char* addr(const Row& r, int64_t b) const { return reinterpret_cast<const char*>(r.q + b * 32); }
};


// q4 in integers: out[n] = sum_j (a_j s_jg) c_jn + sum_j a_j m_jg. Per pass of 8 rows and block g the 8
// coefficients a_j s_jg are rounded to int8 with one scale (as the dense kernels round 32 activations), then
// two rows' codes, interleaved byte by byte, meet a (coef_j, coef_j+1) pattern in one maddubs: 64 weights
// per maddubs pair, summed in int16 over the 8 rows (at most 8 * 15 * 127 < 2^15), scaled to float once.
// About 3x the weights per instruction of dequantising to float.
constexpr int QROWS = 8;

inline __m256i codes32(const uint8_t* p) {  // 16 bytes -> 32 codes in output order (lane 0: 0-15, lane 1: 16-31)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

View q4_cols_int(const Alloc& alloc, const View& x, double tau, const uint8_t* Q, const float* S, const float* MN,
                          int64_t K, int64_t N) {
  ATTNLAB_CHECK(x.scalar_type() == attnlab::kFloat && x.is_contiguous() && x.numel() == K,
              "x must be a contiguous float32 vector of size ", K);
  const Active act(x.data_ptr<float>(), K, static_cast<float>(tau), true);
  auto out = alloc({N}, attnlab::kFloat, Alloc::ZEROED);
  float* O = out.data_ptr<float>();
  const int64_t nb = N / 32;
  auto run = [&](int64_t b0, int64_t b1) {
    const int64_t nl = b1 - b0;
    std::vector<int32_t> cp(QROWS / 2 * nl);  // per pair of rows and block: the two int8 coefficients as one int16
    std::vector<float> cd(nl), mins(nl, 0.f);
    for (int64_t j = 0; j < act.k; j += QROWS) {
      const int n = static_cast<int>(std::min<int64_t>(QROWS, act.k - j));
      const uint8_t* q[QROWS];
      const float *s[QROWS], *m[QROWS];
      float a[QROWS];
      for (int t = 0; t < QROWS; ++t) {  // a short last pass repeats its first row with coefficient 0
        const int64_t r = act.idx[j + (t < n ? t : 0)];
        q[t] = Q + r * N / 2, s[t] = S + r * nb + b0, m[t] = MN + r * nb + b0, a[t] = t < n ? act.a[j + t] : 0.f;
      }
      // the pass's coefficients a_t s_tg rounded to int8 per block g (8 blocks per step), and sum_t a_t m_tg
      int64_t g = 0;
      const __m256 sign = _mm256_set1_ps(-0.f);
      for (; g + 8 <= nl; g += 8) {
        __m256 c[QROWS], amax = _mm256_setzero_ps(), ms = _mm256_loadu_ps(mins.data() + g);
        for (int t = 0; t < QROWS; ++t) {
          const __m256 at = _mm256_set1_ps(a[t]);
          c[t] = _mm256_mul_ps(_mm256_loadu_ps(s[t] + g), at);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, c[t]));
          ms = _mm256_fmadd_ps(_mm256_loadu_ps(m[t] + g), at, ms);
        }
        _mm256_storeu_ps(mins.data() + g, ms);
        _mm256_storeu_ps(cd.data() + g, _mm256_mul_ps(amax, _mm256_set1_ps(1.f / 127.f)));
        const __m256 nz = _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ);
        const __m256 inv = _mm256_and_ps(nz, _mm256_div_ps(_mm256_set1_ps(127.f), amax));
        for (int t = 0; t < QROWS; t += 2) {
          const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(c[t], inv)), hi = _mm256_cvtps_epi32(_mm256_mul_ps(c[t + 1], inv));
          const __m256i pair = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFF)),
                                               _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(0xFF)), 8));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(cp.data() + t / 2 * nl + g), pair);
        }
      }
      for (; g < nl; ++g) {  // the blocks left over, one at a time (same rounding: to nearest even)
        float c[QROWS], amax = 0.f;
        for (int t = 0; t < QROWS; ++t) c[t] = a[t] * s[t][g], amax = std::max(amax, std::fabs(c[t])), mins[g] += a[t] * m[t][g];
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int t = 0; t < QROWS; t += 2)
          cp[t / 2 * nl + g] = (static_cast<int32_t>(std::nearbyint(c[t] * inv)) & 0xFF) |
                               ((static_cast<int32_t>(std::nearbyint(c[t + 1] * inv)) & 0xFF) << 8);
        cd[g] = amax * (1.f / 127.f);
      }
      if (j + QROWS < act.k)
        for (int t = 0; t < std::min<int64_t>(QROWS, act.k - j - QROWS); ++t)
          _mm_prefetch(reinterpret_cast<const char*>(Q + act.idx[j + QROWS + t] * N / 2 + b0 * 16), _MM_HINT_T0);
      for (int64_t g = 0; g < nl; ++g) {
        const int64_t b = b0 + g;
        __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
        for (int p = 0; p < QROWS; p += 2) {
          const __m256i A = codes32(q[p] + b * 16), B = codes32(q[p + 1] + b * 16);
          const __m256i coef = _mm256_set1_epi16(static_cast<int16_t>(cp[p / 2 * nl + g]));
          lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_unpacklo_epi8(A, B), coef));
          hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(_mm256_unpackhi_epi8(A, B), coef));
        }
        // lo: outputs 0-7 | 16-23, hi: 8-15 | 24-31 (unpack works within 128-bit lanes)
        const __m256 d = _mm256_set1_ps(cd[g]);
        const __m128i part[4] = {_mm256_castsi256_si128(lo), _mm256_castsi256_si128(hi), _mm256_extracti128_si256(lo, 1),
                                 _mm256_extracti128_si256(hi, 1)};
        float* o = O + b * 32;
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(part[i])), d,
                                                     _mm256_loadu_ps(o + 8 * i)));
      }
    }
    for (int64_t g = 0; g < nl; ++g)
      for (int i = 0; i < 32; ++i) O[(b0 + g) * 32 + i] += mins[g];
  };
  if (attnlab::num_threads() == 1 || act.k * N < (1 << 16)) run(0, nb); else attnlab::parallel_for(0, nb, 4, run);
  return out;
}

// q4 in the model's own int4 groups (lossless): ct [K, N/2] holds input channel j's codes c[n, j] for every
// output n (ggml's nibble layout per 32 outputs), st and mt [K/32, N] the scale and min of output n's group of
// 32 input channels. Per group g of 32 channels, its active values are rounded to int8 with one scale, exactly
// as the dense q4 kernel rounds x per 32 values (zeroed channels do not change the group's max), so
// out[n] = sum_g st[g, n] d_g (sum_j q_j c[n, j]) + mt[g, n] d_g sum_j q_j is the dense int4 product of the
// zeroed input up to summation order. Channels pair up in one maddubs as in q4_cols_int.
View q4g_cols(const Alloc& alloc, const View& x, double tau, const uint8_t* Q, const float* ST, const float* MT,
                       int64_t K, int64_t N) {
  ATTNLAB_CHECK(x.scalar_type() == attnlab::kFloat && x.is_contiguous() && x.numel() == K && K % 32 == 0,
              "x must be a contiguous float32 vector of size ", K, " (a multiple of 32)");
  const Active act(x.data_ptr<float>(), K, static_cast<float>(tau));
  // per group with active channels: its first channel in act, its count, d, the sum of its rounded values, and
  // per pair of channels the two int8 codes as one int16
  std::vector<int64_t> gid, gstart, gcount;
  std::vector<float> gd, gsum;
  std::vector<int32_t> pairs((act.k + 1) / 2 + K / 32);
  for (int64_t t = 0, pp = 0; t < act.k;) {
    const int64_t g = act.idx[t] / 32;
    int64_t e = t;
    float amax = 0.f;
    while (e < act.k && act.idx[e] / 32 == g) amax = std::max(amax, std::fabs(act.a[e])), ++e;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    gid.push_back(g), gstart.push_back(pp), gcount.push_back(e - t), gd.push_back(amax / 127.f);
    int32_t qsum = 0;  // the min term sums the rounded values, as the dense kernels do (kernels_simd.h)
    for (int64_t u = t; u < e; u += 2) {
      const int32_t q0 = _mm_cvtss_si32(_mm_set_ss(act.a[u] * inv));
      const int32_t q1 = u + 1 < e ? _mm_cvtss_si32(_mm_set_ss(act.a[u + 1] * inv)) : 0;
      pairs[pp++] = (q0 & 0xFF) | ((q1 & 0xFF) << 8);
      qsum += q0 + q1;
    }
    gsum.push_back(gd.back() * static_cast<float>(qsum));
    // rows of the pairs: stored beside, in act order (a lone last channel pairs with itself, coefficient 0)
    t = e;
  }
  auto out = alloc({N}, attnlab::kFloat, Alloc::ZEROED);
  float* O = out.data_ptr<float>();
  const int64_t nb = N / 32, ng = static_cast<int64_t>(gid.size());
  // the act position of each group's first channel (gstart counts pairs)
  std::vector<int64_t> gfirst(ng);
  for (int64_t i = 0, t = 0; i < ng; t += gcount[i], ++i) gfirst[i] = t;
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t i = 0; i < ng; ++i) {
      const int64_t g = gid[i], n = gcount[i], f = gfirst[i];
      const __m256 d = _mm256_set1_ps(gd[i]), A = _mm256_set1_ps(gsum[i]);
      const float* st = ST + g * N;
      const float* mt = MT + g * N;
      if (i + 1 < ng) _mm_prefetch(reinterpret_cast<const char*>(Q + act.idx[gfirst[i + 1]] * N / 2 + b0 * 16), _MM_HINT_T0);
      for (int64_t b = b0; b < b1; ++b) {
        __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
        __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
        int inpass = 0;
        for (int64_t u = 0; u < n; u += 2) {
          const uint8_t* r0 = Q + act.idx[f + u] * N / 2 + b * 16;
          const uint8_t* r1 = u + 1 < n ? Q + act.idx[f + u + 1] * N / 2 + b * 16 : r0;
          const __m256i coef = _mm256_set1_epi16(static_cast<int16_t>(pairs[gstart[i] + u / 2]));
          const __m256i C0 = codes32(r0), C1 = codes32(r1);
          lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_unpacklo_epi8(C0, C1), coef));
          hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(_mm256_unpackhi_epi8(C0, C1), coef));
          if (++inpass == 8 || u + 2 >= n) {  // 8 pairs: at most 16 * 15 * 127 < 2^15, then widen
            const __m128i part[4] = {_mm256_castsi256_si128(lo), _mm256_castsi256_si128(hi),
                                     _mm256_extracti128_si256(lo, 1), _mm256_extracti128_si256(hi, 1)};
            for (int k = 0; k < 4; ++k) acc[k] = _mm256_add_epi32(acc[k], _mm256_cvtepi16_epi32(part[k]));
            lo = hi = _mm256_setzero_si256(), inpass = 0;
          }
        }
        float* o = O + b * 32;
        for (int k = 0; k < 4; ++k) {  // acc: outputs 0-7, 8-15, 16-23, 24-31
          const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[k]), d);
          const __m256 w = _mm256_fmadd_ps(_mm256_loadu_ps(st + b * 32 + 8 * k), v, _mm256_loadu_ps(o + 8 * k));
          _mm256_storeu_ps(o + 8 * k, _mm256_fmadd_ps(_mm256_loadu_ps(mt + b * 32 + 8 * k), A, w));
        }
      }
    }
  };
  if (attnlab::num_threads() == 1 || act.k * N < (1 << 16)) run(0, nb); else attnlab::parallel_for(0, nb, 4, run);
  return out;
}

}  // namespace

// x [K] fp32, tau: drop |x_j| <= tau (negative: keep all); wt [K, N] fp32 -> [N] = wt^T (x masked)
View attnlab::f32_cols_mv(const Alloc& alloc, const View& x, double tau, const View& wt) {
  ATTNLAB_CHECK(wt.scalar_type() == attnlab::kFloat && wt.is_contiguous() && wt.dim() == 2, "wt must be contiguous float32 [K, N]");
  const int64_t K = wt.size(0), N = wt.size(1);
  return cols(alloc, x, tau, K, N, F32{wt.data_ptr<float>(), N});
}

// q [K, N] int8, scale [K, N/32] fp32
View attnlab::q8_cols_mv(const Alloc& alloc, const View& x, double tau, const View& q, const View& scale, int64_t group) {
  ATTNLAB_CHECK(q.scalar_type() == attnlab::kChar, "q must be int8 [K, N]");
  const int64_t K = q.size(0), N = q.size(1);
  check_scales(q, K, N, group, {scale});
  return cols(alloc, x, tau, K, N, Q8{q.data_ptr<int8_t>(), scale.data_ptr<float>(), N});
}

// qs [K, N/2] uint8, scale and min [K, N/32] fp32
View attnlab::q4_cols_mv(const Alloc& alloc, const View& x, double tau, const View& qs, const View& scale, const View& min,
                         int64_t group) {
  ATTNLAB_CHECK(qs.scalar_type() == attnlab::kByte, "qs must be uint8 [K, N/2]");
  const int64_t K = qs.size(0), N = qs.size(1) * 2;
  check_scales(qs, K, N, group, {scale, min});
  return q4_cols_int(alloc, x, tau, qs.data_ptr<uint8_t>(), scale.data_ptr<float>(), min.data_ptr<float>(), K, N);
}

// ct [K, N/2] uint8, st and mt [K/32, N] fp32: the model's int4 weight (groups of 32 inputs) by columns
View attnlab::q4g_cols_mv(const Alloc& alloc, const View& x, double tau, const View& ct, const View& st, const View& mt) {
  ATTNLAB_CHECK(ct.scalar_type() == attnlab::kByte && ct.is_contiguous() && ct.dim() == 2, "ct must be contiguous uint8 [K, N/2]");
  const int64_t K = ct.size(0), N = ct.size(1) * 2;
  ATTNLAB_CHECK(N % 32 == 0, "the output size must be a multiple of 32, got ", N);
  for (const View* p : {&st, &mt})
    ATTNLAB_CHECK(p->scalar_type() == attnlab::kFloat && p->is_contiguous() && p->numel() == (K / 32) * N,
                "st and mt must be contiguous float32 [K/32, N]");
  return q4g_cols(alloc, x, tau, ct.data_ptr<uint8_t>(), st.data_ptr<float>(), mt.data_ptr<float>(), K, N);
}
