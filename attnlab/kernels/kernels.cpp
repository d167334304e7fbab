// Fused dequantise-and-multiply kernels for batch-1 decoding (AVX2 + FMA).
//
// Decoding reads every weight once per token, so the weight is never expanded to
// float in memory: each block of codes is unpacked into registers and multiplied
// there. All three multiply in integers, as llama.cpp does: the activation row is
// rounded to int8 with one scale per 32 values (relative error <= 1/254 per value),
// then 32 products are summed by one maddubs + madd. lut4 (k-means codebooks, the
// 16 centroids rounded to int8 per group) looks 32 weights up with one byte shuffle.
//
// Block layout (ggml's Q4 layout, so GGUF Q4_0/Q4_1 blocks load by copy): a block
// of 32 weights of one row is 16 bytes; byte j holds weight j in its low nibble
// and weight j + 16 in its high nibble.
//   q4:   w = code * scale[g] + min[g]        (g = group of `group` weights, a multiple of 32)
//   lut4: w = lut[g][code] * lut_scale[g]     (k-means codebooks, rounded to int8)
//   q8:   w = int8 * scale[g]                 (g = group of `group` weights: a row, or 32 as Q8_0)
// q4 at group 32 multiplies two blocks per step against activations laid out to match their nibbles
// (dot_q4_pairs); other groups, one block per step (dot_q4). Rows are split across torch's intra-op threads.
//
// The *_rows ops serve Deja Vu's sparse MLP: only the rows idx of a weight are read, each once
// (no gathered copy); the dot products share their per-row code with the matrix ops.
#include <immintrin.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels_simd.h"
#include "ops.h"

using namespace attnlab_simd;
using attnlab::Alloc;
using attnlab::View;

namespace {

void check(const View& x, int64_t K) {
  ATTNLAB_CHECK(x.scalar_type() == attnlab::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == K,
              "x must be contiguous float32 [M, K]");
}

void check_rows(const View& v, int64_t n, const char* name) {
  ATTNLAB_CHECK(v.scalar_type() == attnlab::kFloat && v.is_contiguous() && v.dim() == 1 && v.size(0) == n,
              name, " must be a contiguous float32 vector of size ", n);
}

// x of a matrix op ([M, K]) or of a rows op (vec: a vector [K], one row), checked; its row count
inline int64_t check_x(const View& x, bool vec, int64_t K) {
  vec ? check_rows(x, K, "x") : check(x, K);
  return vec ? 1 : x.size(0);
}

// The activations as the integer kernels multiply them: x [M, K] rounded to int8 per 32 values
// (q, d), and for q4's min term the sums of the rounded values per weight group (g, [M, K/group]); for q4 at group 32
// also in dot_q4_pairs' layout (X, D; `pairs`). The buffers are per thread and reused: no heap
// allocation per call once they have grown.
struct QActs {
  const int8_t *q, *X = nullptr;
  const float *d, *g, *D = nullptr;
  bool pairs = false;
  QActs(const float* x, int64_t M, int64_t K, int64_t group = 0) {
    thread_local std::vector<int8_t> qb, xb;
    thread_local std::vector<float> db, sb, gb, pb;
    const int64_t nb = M * K / 32;
    if (static_cast<int64_t>(qb.size()) < M * K) qb.resize(M * K);
    if (static_cast<int64_t>(db.size()) < nb) db.resize(nb), sb.resize(nb);
    q = qb.data(), d = db.data(), g = nullptr;
    quantize_rows(x, nb, qb.data(), db.data(), group ? sb.data() : nullptr);
    if (group == 0) return;
    const int64_t per = group / 32;
    gb.assign(M * K / group, 0.f);
    for (int64_t i = 0; i < nb; ++i) gb[i / per] += sb[i];
    g = gb.data();
    pairs = per == 1 && K % 64 == 0;
    if (!pairs) return;
    if (static_cast<int64_t>(xb.size()) < M * K) xb.resize(M * K), pb.resize(M * K / 8);
    for (int64_t m = 0; m < M; ++m) pair_acts(q + m * K, d + m * K / 32, K / 32, xb.data() + m * K, pb.data() + m * K / 8);
    X = xb.data(), D = pb.data();
  }
};

// ---- the rows ops' shared checks and loops ----


const int64_t* check_idx(const View& idx, int64_t N) {
  ATTNLAB_CHECK(idx.scalar_type() == attnlab::kLong && idx.is_contiguous() && idx.dim() == 1,
              "idx must be a contiguous int64 vector");
  const int64_t* I = idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < idx.numel(); ++j)
    ATTNLAB_CHECK(I[j] >= 0 && I[j] < N, "idx ", I[j], " out of range for ", N, " rows");
  return I;
}

int64_t check_groups(const View& w, attnlab::DType t, int64_t K, int64_t group,
                     std::initializer_list<View> params) {
  ATTNLAB_CHECK(w.scalar_type() == t && w.is_contiguous() && w.dim() == 2, "weights must be contiguous ", t, " [N, *]");
  ATTNLAB_CHECK(K > 0 && K % 32 == 0 && group % 32 == 0 && group > 0 && K % group == 0,
              "K and group must be positive multiples of 32, group dividing K");
  for (const auto& p : params)
    ATTNLAB_CHECK(p.scalar_type() == attnlab::kFloat && p.is_contiguous() && p.numel() == w.size(0) * (K / group),
                "scales must be contiguous float32 [N, K/group]");
  return K / group;
}

// Where the selected rows live: the weight's bytes, the bytes of one row and of one 32-weight block.
// Rows are scattered, so the hardware prefetcher restarts at each; the loops ask for a row
// `ahead` selections before they read it.
struct Rows {
  const char* base;
  int64_t row, block;  // bytes
  static constexpr int64_t ahead = 4;
  Rows(const void* w, int64_t row_bytes, int64_t K)
      : base(static_cast<const char*>(w)), row(row_bytes), block(row_bytes * 32 / K) {}
  void prefetch(int64_t r, int64_t b0, int64_t b1) const {
    const char* p = base + r * row + b0 * block;
    for (int64_t o = 0; o < (b1 - b0) * block; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
  }
};

// dot(R, rows, j) for j0 <= j < j1 in passes of Rn rows (R a std::integral_constant: Rn, or 1 for the
// tail), rows[i] = row(j + i). Rows `ahead` on are prefetched: streaming several rows at once defeats
// the hardware prefetcher.
template <int Rn, class Row, class Dot>
inline void passes(int64_t j0, int64_t j1, const Rows& w, int64_t ahead, Row row, Dot dot) {
  for (int64_t j = j0, n; j < j1; j += n) {
    int64_t rows[Rn];
    n = j1 - j >= Rn ? Rn : 1;
    for (int i = 0; i < n; ++i) rows[i] = row(j + i);
    for (int64_t t = j + ahead; t < std::min(j1, j + ahead + n); ++t) w.prefetch(row(t), 0, w.row / w.block);
    n == Rn ? dot(std::integral_constant<int, Rn>(), rows, j) : dot(std::integral_constant<int, 1>(), rows, j);
  }
}

// Does a dot also take four activation rows at once (`four`, where `batched()`)?
template <class T, class = void>
struct Batched : std::false_type {};
template <class T>
struct Batched<T, std::void_t<decltype(&T::batched)>> : std::true_type {};

// out [M, N]: dot(R, rows, m, o) puts R weight rows times activation row m into o[0..R); passes of Rn
// rows split across threads (no parallel_for at 1 thread: it costs microseconds per call).
template <int Rn, class Dot>
View rows_mm(const Alloc& alloc, const View& x, const Rows& w, int64_t N, Dot dot) {
  const int64_t M = x.size(0), n = (N + Rn - 1) / Rn;
  auto out = alloc({M, N}, attnlab::kFloat);
  float* O = out.data_ptr<float>();
  auto run = [&](int64_t p0, int64_t p1) {
    passes<Rn>(Rn * p0, std::min(N, Rn * p1), w, 2 * Rows::ahead, [](int64_t j) { return j; },
               [&](auto R, const int64_t* rows, int64_t r) {
                 int64_t m = 0;
                 if constexpr (Batched<Dot>::value)  // four activation rows per weight read where dot can
                   for (; m + 4 <= M && dot.batched(); m += 4) dot.four(R, rows, m, O + m * N + r, N);
                 for (; m < M; ++m) dot(R, rows, m, O + m * N + r);
               });
  };
  if (attnlab::num_threads() == 1) run(0, n); else attnlab::parallel_for(0, n, 16 / Rn, run);
  return out;
}

// y[j] = row(idx[j]): the selected rows' dot products (dot(R, rows, o) as for rows_mm), split by j
template <int Rn, class Dot>
View rows_mv(const Alloc& alloc, const View& x, const Rows& w, const View& idx, int64_t N, int64_t K, Dot dot) {
  check_rows(x, K, "x");
  const int64_t* I = check_idx(idx, N);
  auto out = alloc({idx.numel()}, attnlab::kFloat);
  float* O = out.data_ptr<float>();
  attnlab::parallel_for(0, idx.numel(), 16, [&](int64_t j0, int64_t j1) {
    passes<Rn>(j0, j1, w, Rows::ahead, [&](int64_t j) { return I[j]; },
               [&](auto R, const int64_t* rows, int64_t j) { dot(R, rows, O + j); });
  });
  return out;
}

// out [K] = sum_j a[j] * row(idx[j]): each thread owns a slice of 32-column blocks and streams that
// slice of every selected row once, 4 rows per pass over its slice of out (kept in L1).
// block(r, b, g, a, v) puts block b (in group g) of row r into v as 32 floats and returns the
// factor it is multiplied by (a times the group's scale).
template <class Block>
View rows_axpy(const Alloc& alloc, const View& a, const Rows& w, const View& idx, int64_t N, int64_t K,
                        int64_t per, Block block) {
  check_rows(a, idx.numel(), "a");
  const int64_t* I = check_idx(idx, N);
  auto out = alloc({K}, attnlab::kFloat, Alloc::ZEROED);
  float* O = out.data_ptr<float>();
  const float* A = a.data_ptr<float>();
  const int64_t k = a.numel();
  attnlab::parallel_for(0, K / 32, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t j = 0; j < k; j += 4) {
      const int64_t n = std::min<int64_t>(4, k - j);
      for (int64_t t = j + Rows::ahead; t < std::min(k, j + Rows::ahead + 4); ++t) w.prefetch(I[t], b0, b1);
      int64_t g = b0 / per, in = b0 % per;  // the block's group, counted (a division per block is slow)
      for (int64_t b = b0; b < b1; ++b) {
        __m256 acc[4], v[4];
        for (int i = 0; i < 4; ++i) acc[i] = _mm256_loadu_ps(O + b * 32 + 8 * i);
        for (int64_t t = j; t < j + n; ++t) {
          const __m256 c = _mm256_set1_ps(block(I[t], b, g, A[t], v));
          for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(v[i], c, acc[i]);
        }
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(O + b * 32 + 8 * i, acc[i]);
        if (++in == per) in = 0, ++g;
      }
    }
  });
  return out;
}

// One q4 or q8 weight and its activations x [M, K] rounded: f(R, rows, m, o) as rows_mm calls it.
// q4's min term: sum_j (c_j s + m) xr_j = s sum c_j xr_j + m sum xr_j, xr the rounded activations.
struct Q4 {
  int64_t K, G, per, M;
  const uint8_t* Q;
  const float *S, *MN;
  QActs xa;
  Q4(const View& x, bool vec, const View& qs, const View& scale, const View& min,
     int64_t group)
      : K(qs.size(1) * 2), G(check_groups(qs, attnlab::kByte, K, group, {scale, min})), per(group / 32),
        M(check_x(x, vec, K)), Q(qs.data_ptr<uint8_t>()), S(scale.data_ptr<float>()), MN(min.data_ptr<float>()),
        xa(x.data_ptr<float>(), M, K, group) {}
  template <class R>
  void operator()(R, const int64_t* rows, int64_t m, float* o) const {
    if (xa.pairs) return dot_q4_pairs<R::value>(Q, S, MN, rows, G, xa.X + m * K, xa.D + m * K / 8, xa.g + m * G, o);
    const auto d = per == 1 ? dot_q4<R::value, 1> : dot_q4<R::value, 0>;  // group 32: per known, loops flatten
    d(Q, S, MN, rows, G, per, xa.q + m * K, xa.d + m * K / 32, xa.g + m * G, o);
  }
  // R weight rows times activation rows m .. m + 3 into o[a * ldo + i] (the pairs layout: group 32)
  bool batched() const { return xa.pairs; }
  template <class R>
  void four(R, const int64_t* rows, int64_t m, float* o, int64_t ldo) const {
    const int8_t* X[4];
    const float *D[4], *gs[4];
    for (int a = 0; a < 4; ++a) X[a] = xa.X + (m + a) * K, D[a] = xa.D + (m + a) * K / 8, gs[a] = xa.g + (m + a) * G;
    for (int i = 0; i < R::value; ++i)
      dot_q4_pairs_x4(Q + rows[i] * G * 16, S + rows[i] * G, MN + rows[i] * G, G, X, D, gs, o + i, ldo);
  }
  Rows rows() const { return Rows(Q, K / 2, K); }
};

struct Q8 {
  int64_t K, G, per, M;
  const int8_t* Q;
  const float* S;
  QActs xa;
  Q8(const View& x, bool vec, const View& q, const View& scale, int64_t group)
      : K(q.size(1)), G(check_groups(q, attnlab::kChar, K, group, {scale})), per(group / 32), M(check_x(x, vec, K)),
        Q(q.data_ptr<int8_t>()), S(scale.data_ptr<float>()), xa(x.data_ptr<float>(), M, K) {}
  template <class R>
  void operator()(R, const int64_t* rows, int64_t m, float* o) const {
    const auto d = per == 1 ? dot_q8<R::value, 1> : dot_q8<R::value, 0>;
    d(Q, S, rows, G, per, xa.q + m * K, xa.d + m * K / 32, o);
  }
  // R weight rows times activation rows m .. m + 3 into o[a * ldo + i] (group 32)
  bool batched() const { return per == 1; }
  template <class R>
  void four(R, const int64_t* rows, int64_t m, float* o, int64_t ldo) const {
    const int8_t* X[4];
    const float* D[4];
    for (int a = 0; a < 4; ++a) X[a] = xa.q + (m + a) * K, D[a] = xa.d + (m + a) * K / 32;
    for (int i = 0; i < R::value; ++i) dot_q8_x4(Q + rows[i] * K, S + rows[i] * G, G, X, D, o + i, ldo);
  }
  Rows rows() const { return Rows(Q, K, K); }
};

}  // namespace

namespace attnlab {

// x [M, K] fp32; qs [N, K/2] uint8; scale, min [N, K/group] fp32 -> [M, N]
View q4_mm(const Alloc& alloc, const View& x, const View& qs, const View& scale, const View& min, int64_t group) {
  const Q4 f(x, false, qs, scale, min, group);
  // four rows per pass on short rows (K <= 768: w13, wqkv, wo); long rows (w2's K = 1536) ran slower
  // in fours than one at a time (four interleaved streams from memory), as did scattered rows
  return f.K <= 768 ? rows_mm<4>(alloc, x, f.rows(), qs.size(0), f) : rows_mm<1>(alloc, x, f.rows(), qs.size(0), f);
}

// x [M, K] fp32; qs [N, K/2] uint8; lut [N, K/group, 16] int8 (codebooks rounded to int8);
// lut_scale [N, K/group] fp32 -> [M, N]
View lut4_mm(const Alloc& alloc, const View& x, const View& qs, const View& lut, const View& lut_scale, int64_t group) {
  const int64_t K = qs.size(1) * 2, G = check_groups(qs, attnlab::kByte, K, group, {lut_scale}), per = group / 32;
  check(x, K);
  ATTNLAB_CHECK(lut.scalar_type() == attnlab::kChar && lut.is_contiguous() && lut.numel() == qs.size(0) * G * 16,
              "lut must be contiguous int8 [N, K/group, 16]");
  const QActs xa(x.data_ptr<float>(), x.size(0), K);
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  const int8_t* L = lut.data_ptr<int8_t>();
  const float* LS = lut_scale.data_ptr<float>();
  return rows_mm<4>(alloc, x, Rows(Q, K / 2, K), qs.size(0), [&](auto R, const int64_t* rows, int64_t m, float* o) {
    (per == 1 ? dot_lut4<R, 1> : dot_lut4<R, 0>)(Q, L, LS, rows, G, per, xa.q + m * K, xa.d + m * K / 32, o);
  });
}

// x [M, K] fp32; q [N, K] int8; scale [N, K/group] fp32 -> [M, N]
View q8_mm(const Alloc& alloc, const View& x, const View& q, const View& scale, int64_t group) {
  const Q8 f(x, false, q, scale, group);
  return rows_mm<Q8_ROWS>(alloc, x, f.rows(), q.size(0), f);
}

// Row-sparse ops (Deja Vu's sparse MLP at batch 1): only rows idx [k] of w [N, K] are read, each once, no copy.
// *_rows_mv(x [K], ..., idx) -> [k] equals *_mm(x[None], ...)[0, idx] bit for bit;
// *_rows_axpy(a [k], ..., idx) -> [K] = sum_j a_j w[idx_j] (duplicates add up), dequantised in registers.

View f32_rows_mv(const Alloc& alloc, const View& x, const View& w, const View& idx) {
  const int64_t K = w.size(1);
  check_groups(w, attnlab::kFloat, K, K, {});
  const float* W = w.data_ptr<float>();
  const float* X = x.data_ptr<float>();
  return rows_mv<1>(alloc, x, Rows(W, K * 4, K), idx, w.size(0), K,
                    [&](auto, const int64_t* rows, float* o) { o[0] = dot_f32(W + rows[0] * K, X, K); });
}

View q8_rows_mv(const Alloc& alloc, const View& x, const View& q, const View& scale, int64_t group, const View& idx) {
  const Q8 f(x, true, q, scale, group);
  return rows_mv<Q8_ROWS>(alloc, x, f.rows(), idx, q.size(0), f.K, [&](auto R, const int64_t* rows, float* o) { f(R, rows, 0, o); });
}

View q4_rows_mv(const Alloc& alloc, const View& x, const View& qs, const View& scale, const View& min, int64_t group,
                         const View& idx) {
  const Q4 f(x, true, qs, scale, min, group);
  return rows_mv<1>(alloc, x, f.rows(), idx, qs.size(0), f.K, [&](auto R, const int64_t* rows, float* o) { f(R, rows, 0, o); });
}

View f32_rows_axpy(const Alloc& alloc, const View& a, const View& w, const View& idx) {
  const int64_t K = w.size(1);
  check_groups(w, attnlab::kFloat, K, K, {});
  const float* W = w.data_ptr<float>();
  return rows_axpy(alloc, a, Rows(W, K * 4, K), idx, w.size(0), K, 1, [&](int64_t r, int64_t b, int64_t, float aj,
                                                                     __m256* v) {
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(W + r * K + b * 32 + 8 * i);
    return aj;
  });
}

View q8_rows_axpy(const Alloc& alloc, const View& a, const View& q, const View& scale, int64_t group, const View& idx) {
  const int64_t K = q.size(1), G = check_groups(q, attnlab::kChar, K, group, {scale}), per = group / 32;
  const int8_t* Q = q.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  return rows_axpy(alloc, a, Rows(Q, K, K), idx, q.size(0), K, per, [&](int64_t r, int64_t b, int64_t g, float aj,
                                                                   __m256* v) {
    const int8_t* row = Q + r * K + b * 32;
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * i))));
    return aj * S[r * G + g];
  });
}

// w = code * s + m: the codes' part goes through the block, the min's part a_j m is one float per
// block (a group's blocks share it), added to the block's 32 columns at the end.
View q4_rows_axpy(const Alloc& alloc, const View& a, const View& qs, const View& scale, const View& min, int64_t group,
                           const View& idx) {
  const int64_t K = qs.size(1) * 2, G = check_groups(qs, attnlab::kByte, K, group, {scale, min}), per = group / 32;
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  const float* S = scale.data_ptr<float>();
  const float* MN = min.data_ptr<float>();
  std::vector<float> mins(K / 32, 0.f);  // per block; threads own disjoint blocks
  auto out = rows_axpy(alloc, a, Rows(Q, K / 2, K), idx, qs.size(0), K, per, [&](int64_t r, int64_t b, int64_t g, float aj,
                                                                          __m256* v) {
    const __m256i c = unpack32(Q + r * K / 2 + b * 16);
    const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
    const __m128i h[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};  // 8 codes each, in order
    for (int i = 0; i < 4; ++i) v[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h[i]));
    mins[b] += aj * MN[r * G + g];
    return aj * S[r * G + g];
  });
  float* O = out.data_ptr<float>();
  for (int64_t b = 0; b < K / 32; ++b)
    for (int i = 0; i < 32; ++i) O[b * 32 + i] += mins[b];
  return out;
}

}  // namespace attnlab
