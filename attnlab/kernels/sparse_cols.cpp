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
#include <algorithm>
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

// TEAL's columns in the weight's own groups (qc_cols_mv): W [N, K] by input channel, so a dropped channel's row is
// never read, with the codes and per-(group, output) scales the file had (lossless). Row j holds channel j's codes
// for every output, permuted within blocks (`reference.pack_cols`) so that four channels' blocks, byte-interleaved by
// two rounds of unpack, meet VNNI's dot product (vpdpbusd: four u8 codes x four s8 activations into one int32 per
// output) in output order: 4-bit blocks of 128 outputs in 64 bytes (a last block of 64 outputs in 32 bytes), 8-bit
// blocks of 64 outputs in 64 bytes (code + 128). scale, min [K / group, N] float32 or float16 (min: none or
// as many): w[n, j] = s[j / group, n] c[n, j] + m[j / group, n]. The active channels of each block of 32 are rounded
// to int8 with one scale, as the dense kernels round x (dropped channels are the smallest, so the block's max, and
// the rounding of the rest, do not change), grouped per weight group and padded to fours (coefficient 0), so
// y[n] = sum_g s[g, n] d_g (sum_j q_j c[n, j]) + m[g, n] d_g sum_j q_j is the dense integer product of the zeroed
// input up to summation order. Groups outer, blocks inner: each active row streams once, in order, and y stays in L1.
struct ColWeight {
  const uint8_t* codes;
  int64_t stride;     // bytes from one channel's row to the next
  const void* scale;  // [K / group, sstride]
  const void* min;    // null: none
  int64_t sstride;
  int64_t K, N, group;
  int bits;
  bool half;
};

// The active channels of x, per unit (a block of 32 inputs, or a weight group of 16 in it): its scale row, d, the sum
// of its rounded values, and its quads (four int8 coefficients as one int32, four channel rows).
struct Quads {
  std::vector<int64_t> srow, first, row;
  std::vector<float> d;
  std::vector<int32_t> qsum, coef;

  Quads(const float* x, int64_t K, int64_t group, float tau) {
    const int64_t unit = std::min<int64_t>(group, 32);
    for (int64_t b = 0; b < K; b += 32) {
      float amax = 0.f;
      for (int64_t j = b; j < b + 32; ++j)
        if (std::fabs(x[j]) > tau) amax = std::max(amax, std::fabs(x[j]));
      if (amax == 0.f) continue;
      const float inv = 127.f / amax;
      for (int64_t u = b; u < b + 32; u += unit) {
        const size_t start = coef.size();
        int32_t sum = 0;
        int n = 0;
        int8_t q4[4] = {0, 0, 0, 0};
        int64_t r4[4] = {0, 0, 0, 0};
        auto flush = [&] {
          for (int t = n; t < 4; ++t) q4[t] = 0, r4[t] = r4[0];  // padding: the first row again, coefficient 0
          uint32_t c;
          std::memcpy(&c, q4, 4);
          coef.push_back(static_cast<int32_t>(c));
          row.insert(row.end(), r4, r4 + 4);
          n = 0;
        };
        for (int64_t j = u; j < u + unit; ++j) {
          if (!(std::fabs(x[j]) > tau)) continue;
          const int32_t q = static_cast<int32_t>(std::nearbyint(x[j] * inv));
          if (!q) continue;  // rounds to nothing: its row need not be read either
          q4[n] = static_cast<int8_t>(q), r4[n] = j, sum += q;
          if (++n == 4) flush();
        }
        if (n) flush();
        if (coef.size() > start)
          srow.push_back(u / group), first.push_back(static_cast<int64_t>(start)), d.push_back(amax / 127.f),
              qsum.push_back(sum);
      }
    }
    first.push_back(static_cast<int64_t>(coef.size()));
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
inline __m512 load16(const void* p, int64_t i, bool half) {
  return half ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)))
              : _mm512_loadu_ps(static_cast<const float*>(p) + i);
}
inline __m256 load8(const void* p, int64_t i, bool half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)))
              : _mm256_loadu_ps(static_cast<const float*>(p) + i);
}
inline __m512i load_block(const uint8_t* p, bool half_block) {
  return half_block ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
                    : _mm512_loadu_si512(p);
}

// acc[8] (4-bit) or acc[4] (8-bit): sum over the unit's quads of coef . codes, block c of 64 bytes (or a 32-byte tail)
template <int BITS>
inline void unit_block(const ColWeight& w, const Quads& a, int64_t q0, int64_t q1, int64_t c, bool tail, __m512i* acc) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* base = w.codes + c * 64;
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t* r = &a.row[4 * q];
    const __m512i A = load_block(base + r[0] * w.stride, tail), B = load_block(base + r[1] * w.stride, tail);
    const __m512i C = load_block(base + r[2] * w.stride, tail), D = load_block(base + r[3] * w.stride, tail);
    const __m512i abl = _mm512_unpacklo_epi8(A, B), abh = _mm512_unpackhi_epi8(A, B);
    const __m512i cdl = _mm512_unpacklo_epi8(C, D), cdh = _mm512_unpackhi_epi8(C, D);
    const __m512i v[4] = {_mm512_unpacklo_epi16(abl, cdl), _mm512_unpackhi_epi16(abl, cdl),
                          _mm512_unpacklo_epi16(abh, cdh), _mm512_unpackhi_epi16(abh, cdh)};
    const __m512i cf = _mm512_set1_epi32(a.coef[q]);
    for (int k = 0; k < 4; ++k) {
      if (BITS == 8) {
        acc[k] = _mm512_dpbusd_epi32(acc[k], v[k], cf);
      } else {
        acc[k] = _mm512_dpbusd_epi32(acc[k], _mm512_and_si512(v[k], low), cf);
        acc[4 + k] = _mm512_dpbusd_epi32(acc[4 + k], _mm512_and_si512(_mm512_srli_epi16(v[k], 4), low), cf);
      }
    }
  }
}

template <int BITS>
void qc_rows(const ColWeight& w, const Quads& a, float* y) {
  constexpr int64_t CH = BITS == 4 ? 128 : 64;  // outputs per 64-byte block
  constexpr int NACC = BITS == 4 ? 8 : 4;
  for (size_t u = 0; u + 1 < a.first.size(); ++u) {
    const int64_t g = a.srow[u];
    const float dq = a.d[u] * static_cast<float>(a.qsum[u]);
    const __m512i off = _mm512_set1_epi32(BITS == 8 ? 128 * a.qsum[u] : 0);  // codes + 128: take 128 sum q back
    for (int64_t c = 0; c * CH < w.N; ++c) {
      const bool tail = (c + 1) * CH > w.N;  // 4-bit: a last block of 64 outputs, accumulators' low halves
      __m512i acc[NACC];
      for (auto& v : acc) v = _mm512_setzero_si512();
      unit_block<BITS>(w, a, a.first[u], a.first[u + 1], c, tail, acc);
      const void* sr = w.half ? static_cast<const void*>(static_cast<const uint16_t*>(w.scale) + g * w.sstride)
                              : static_cast<const void*>(static_cast<const float*>(w.scale) + g * w.sstride);
      const void* mr = !w.min ? nullptr : w.half ? static_cast<const void*>(static_cast<const uint16_t*>(w.min) + g * w.sstride)
                                                 : static_cast<const void*>(static_cast<const float*>(w.min) + g * w.sstride);
      for (int k = 0; k < NACC; ++k) {
        const __m512i s = _mm512_sub_epi32(acc[k], off);
        if (!tail) {
          const int64_t n = c * CH + 16 * k;
          __m512 o = _mm512_fmadd_ps(_mm512_mul_ps(load16(sr, n, w.half), _mm512_set1_ps(a.d[u])), _mm512_cvtepi32_ps(s),
                                     _mm512_loadu_ps(y + n));
          if (mr) o = _mm512_fmadd_ps(load16(mr, n, w.half), _mm512_set1_ps(dq), o);
          _mm512_storeu_ps(y + n, o);
        } else {
          const int64_t n = c * CH + 8 * k;
          __m256 o = _mm256_fmadd_ps(_mm256_mul_ps(load8(sr, n, w.half), _mm256_set1_ps(a.d[u])),
                                     _mm256_cvtepi32_ps(_mm512_castsi512_si256(s)), _mm256_loadu_ps(y + n));
          if (mr) o = _mm256_fmadd_ps(load8(mr, n, w.half), _mm256_set1_ps(dq), o);
          _mm256_storeu_ps(y + n, o);
        }
      }
    }
  }
}
#else
// Without AVX-512 VNNI: the same layout read one code at a time (correct, not fast; the VNNI builds are the fast path).
template <int BITS>
void qc_rows(const ColWeight& w, const Quads& a, float* y) {
  std::vector<int32_t> acc(w.N);
  auto scale = [&](const void* p, int64_t i) {
    return w.half ? static_cast<float>(_cvtsh_ss(static_cast<const uint16_t*>(p)[i]))
                  : static_cast<const float*>(p)[i];
  };
  for (size_t u = 0; u + 1 < a.first.size(); ++u) {
    std::fill(acc.begin(), acc.end(), 0);
    for (int64_t q = a.first[u]; q < a.first[u + 1]; ++q)
      for (int t = 0; t < 4; ++t) {
        const int32_t cf = static_cast<int8_t>(static_cast<uint32_t>(a.coef[q]) >> (8 * t));
        const uint8_t* r = w.codes + a.row[4 * q + t] * w.stride;
        for (int64_t p = 0; p < w.N * BITS / 8; ++p) {
          const int64_t blk = BITS == 4 ? p / 64 * 128 : p / 64 * 64, i = p % 64;
          const bool tail = BITS == 4 && blk + 128 > w.N;
          const int64_t o = tail ? 8 * (i % 16 / 4) + 4 * (i / 16) + i % 4 : 16 * (i % 16 / 4) + 4 * (i / 16) + i % 4;
          if (BITS == 8) {
            acc[blk + o] += cf * (static_cast<int32_t>(r[p]) - 128);
          } else {
            acc[blk + o] += cf * (r[p] & 15);
            acc[blk + o + (tail ? 32 : 64)] += cf * (r[p] >> 4);
          }
        }
      }
    const int64_t g = a.srow[u];
    for (int64_t n = 0; n < w.N; ++n)
      y[n] += scale(w.scale, g * w.sstride + n) * a.d[u] * static_cast<float>(acc[n]) +
              (w.min ? scale(w.min, g * w.sstride + n) * a.d[u] * static_cast<float>(a.qsum[u]) : 0.f);
  }
}
#endif

// y [N] = W (x thresholded at tau) for one row x [K]; y zeroed by the caller
void qc_mv(const float* x, float tau, const ColWeight& w, float* y) {
  const Quads a(x, w.K, w.group, tau);
  if (w.bits == 4) qc_rows<4>(w, a, y); else qc_rows<8>(w, a, y);
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

// x [B, K] (or [K]) fp32 -> [B, N] (or [N]), each row thresholded on its own; codes [K, N * bits / 8] uint8 rows
// (a slice of outputs: rows `stride` bytes apart), scale and min [K / group, N] float32 or float16 (min empty: none)
View attnlab::qc_cols_mv(const Alloc& alloc, const View& x, double tau, const View& codes, const View& scale,
                         const View& min, int64_t bits, int64_t group) {
  ATTNLAB_CHECK(bits == 4 || bits == 8, "qc_cols_mv: bits must be 4 or 8, got ", bits);
  ATTNLAB_CHECK(codes.scalar_type() == attnlab::kByte && codes.dim() == 2 && codes.stride(1) == 1,
                "codes must be uint8 [K, N * bits / 8] with unit stride along the outputs");
  const int64_t K = codes.size(0), N = codes.size(1) * 8 / bits;
  ATTNLAB_CHECK(K % 32 == 0 && N % 64 == 0 && (group % 32 == 0 || group == 16) && K % group == 0,
                "qc_cols_mv: K a multiple of 32, N of 64, group 16 or a multiple of 32 dividing K; got K ", K, ", N ",
                N, ", group ", group);
  ATTNLAB_CHECK(x.scalar_type() == attnlab::kFloat && x.is_contiguous() && x.numel() % K == 0 && x.numel() > 0,
                "x must be contiguous float32 [B, ", K, "]");
  const bool half = scale.scalar_type() == attnlab::kHalf;
  for (const View* t : {&scale, &min})
    ATTNLAB_CHECK(t == &min && !t->numel() ||
                      (t->scalar_type() == scale.scalar_type() && (half || t->scalar_type() == attnlab::kFloat) &&
                       t->dim() == 2 && t->size(0) == K / group && t->size(1) == N && t->stride(1) == 1 &&
                       t->stride(0) == scale.stride(0)),
                  "scale and min must be float32 or float16 [K / group, N], alike (min may be empty)");
  const ColWeight w{codes.data_ptr<uint8_t>(), codes.stride(0), scale.data_ptr(), min.numel() ? min.data_ptr() : nullptr,
                    scale.stride(0), K, N, group, static_cast<int>(bits), half};
  const int64_t B = x.numel() / K;
  auto out = x.dim() == 1 ? alloc({N}, attnlab::kFloat, Alloc::ZEROED) : alloc({B, N}, attnlab::kFloat, Alloc::ZEROED);
  for (int64_t r = 0; r < B; ++r) qc_mv(x.data_ptr<float>() + r * K, static_cast<float>(tau), w, out.data_ptr<float>() + r * N);
  return out;
}
