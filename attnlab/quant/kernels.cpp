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
// Rows are split across torch's intra-op threads.
//
// The *_rows ops serve Deja Vu's sparse MLP: only the rows idx of a weight are read, each once
// (no gathered copy); the dot products share their per-row code with the matrix ops.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i unpack32(const uint8_t* qs) {  // 16 bytes -> 32 codes, in weight order (ggml's bytes_from_nibbles_32)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

inline __m256 dot_u8i8(__m256i u, __m256i s) {  // 32 u8 x 32 i8 -> 8 float partial sums
  __m256i p = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// x [nb * 32] -> int8 codes, one scale per 32 values and (if sums) their float sums; q = lrint(x * 127 / amax),
// vectorised as ggml's quantize_row_q8_0 (cvtps rounds to nearest even, as lrintf does).
void quantize_rows(const float* x, int64_t nb, int8_t* q, float* d, float* sums) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < nb; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + b * 32 + 8 * i);
    const float amax = hmax(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                          _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
    if (sums) sums[b] = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    d[b] = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), _mm256_permutevar8x32_epi32(p, order));
  }
}

void check(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == K,
              "x must be contiguous float32 [M, K]");
}

// The activations as the integer kernels multiply them: x [M, K] rounded to int8 per 32 values
// (q, d), and for q4's min term the float sums per weight group (g, [M, K/group]). The buffers are
// per thread and reused: no heap allocation per call once they have grown.
struct QActs {
  const int8_t* q;
  const float *d, *g;
  QActs(const float* x, int64_t M, int64_t K, int64_t group = 0) {
    thread_local std::vector<int8_t> qb;
    thread_local std::vector<float> db, sb, gb;
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
  }
};

// The dot helpers compute R weight rows (row numbers rows[0..R)) times one rounded activation row
// (xr, dr) into out[0..R): the rows share each activation block load and their sums form R
// independent chains (one chain is bound by the FMA latency). Each row's arithmetic and order is
// the same for any R, so results do not depend on R.
// q4: sum over groups of s * (codes . xq) * d + m * sum(x).
template <int R>
inline void dot_q4(const uint8_t* Q, const float* S, const float* MN, const int64_t* rows, int64_t G, int64_t per,
                   const int8_t* xr, const float* dr, const float* gs, float* out) {
  const int64_t K = G * per * 32;
  const uint8_t* q[R];
  const float *sr[R], *mr[R];
  __m256 acc[R];
  float mins[R];
  for (int i = 0; i < R; ++i)
    q[i] = Q + rows[i] * K / 2, sr[i] = S + rows[i] * G, mr[i] = MN + rows[i] * G, acc[i] = _mm256_setzero_ps(),
    mins[i] = 0.f;
  for (int64_t g = 0, b = 0; g < G; ++g) {
    for (const int64_t e = b + per; b < e; ++b) {
      const __m256i xv = load32(xr + b * 32);
      const float d = dr[b];
      for (int i = 0; i < R; ++i)
        acc[i] = _mm256_fmadd_ps(dot_u8i8(unpack32(q[i] + b * 16), xv), _mm256_set1_ps(sr[i][g] * d), acc[i]);
    }
    for (int i = 0; i < R; ++i) mins[i] = std::fma(mr[i][g], gs[g], mins[i]);  // explicit: same bits for any R
  }
  for (int i = 0; i < R; ++i) out[i] = hsum(acc[i]) + mins[i];
}

// q8: |w| (unsigned) times x carrying w's sign (maddubs needs one unsigned operand). One row per
// pass: with its cheaper arithmetic, q8 from memory ran faster streaming one row than 2 or 4.
constexpr int Q8_ROWS = 1;
template <int R>
inline void dot_q8(const int8_t* Q, const float* S, const int64_t* rows, int64_t G, int64_t per, const int8_t* xr,
                   const float* dr, float* out) {
  const int64_t K = G * per * 32;
  const int8_t* w[R];
  const float* sr[R];
  __m256 acc[R];
  for (int i = 0; i < R; ++i) w[i] = Q + rows[i] * K, sr[i] = S + rows[i] * G, acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0, b = 0; g < G; ++g) {
    for (const int64_t e = b + per; b < e; ++b) {
      const __m256i xv = load32(xr + b * 32);
      const float d = dr[b];
      for (int i = 0; i < R; ++i) {
        const __m256i wv = load32(w[i] + b * 32);
        const __m256 p = dot_u8i8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
        acc[i] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * sr[i][g]), acc[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) out[i] = hsum(acc[i]);
}

// lut4: one byte shuffle turns 32 codes into their int8 centroids, then q8's integer dot.
template <int R>
inline void dot_lut4(const uint8_t* Q, const int8_t* L, const float* LS, const int64_t* rows, int64_t G, int64_t per,
                     const int8_t* xr, const float* dr, float* out) {
  const int64_t K = G * per * 32;
  const uint8_t* q[R];
  __m256 acc[R];
  for (int i = 0; i < R; ++i) q[i] = Q + rows[i] * K / 2, acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0, b = 0; g < G; ++g) {
    __m256i table[R];
    for (int i = 0; i < R; ++i)
      table[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(L + (rows[i] * G + g) * 16)));
    for (const int64_t e = b + per; b < e; ++b) {
      const __m256i xv = load32(xr + b * 32);
      const float d = dr[b];
      for (int i = 0; i < R; ++i) {
        const __m256i wv = _mm256_shuffle_epi8(table[i], unpack32(q[i] + b * 16));
        const __m256 p = dot_u8i8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
        acc[i] = _mm256_fmadd_ps(p, _mm256_set1_ps(LS[rows[i] * G + g] * d), acc[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) out[i] = hsum(acc[i]);
}

inline float dot_f32(const float* w, const float* x, int64_t K) {  // K a multiple of 32
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t c = 0; c < K; c += 32)
    for (int i = 0; i < 4; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 8 * i), _mm256_loadu_ps(x + c + 8 * i), acc[i]);
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// ---- the rows ops' shared checks and loops ----

void check_rows(const torch::Tensor& v, int64_t n, const char* name) {
  TORCH_CHECK(v.scalar_type() == torch::kFloat && v.is_contiguous() && v.dim() == 1 && v.size(0) == n,
              name, " must be a contiguous float32 vector of size ", n);
}

const int64_t* check_idx(const torch::Tensor& idx, int64_t N) {
  TORCH_CHECK(idx.scalar_type() == torch::kLong && idx.is_contiguous() && idx.dim() == 1,
              "idx must be a contiguous int64 vector");
  const int64_t* I = idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < idx.numel(); ++j)
    TORCH_CHECK(I[j] >= 0 && I[j] < N, "idx ", I[j], " out of range for ", N, " rows");
  return I;
}

int64_t check_groups(const torch::Tensor& w, torch::ScalarType t, int64_t K, int64_t group,
                     std::initializer_list<torch::Tensor> params) {
  TORCH_CHECK(w.scalar_type() == t && w.is_contiguous() && w.dim() == 2, "weights must be contiguous ", t, " [N, *]");
  TORCH_CHECK(K % 32 == 0 && group % 32 == 0 && group > 0 && K % group == 0,
              "K and group must be multiples of 32, group dividing K");
  for (const auto& p : params)
    TORCH_CHECK(p.scalar_type() == torch::kFloat && p.is_contiguous() && p.numel() == w.size(0) * (K / group),
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

// out [M, N]: dot(R, rows, m, o) puts R weight rows (R a std::integral_constant: `Rn` in a pass, 1 for
// the tail) times activation row m into o[0..R). Rows `ahead` rows on are prefetched: streaming
// several rows at once defeats the hardware prefetcher. No parallel_for at 1 thread (microseconds).
template <int Rn, class Dot>
torch::Tensor rows_mm(const torch::Tensor& x, const Rows& w, int64_t N, int64_t K, Dot dot) {
  const int64_t M = x.size(0), passes = (N + Rn - 1) / Rn;
  auto out = torch::empty({M, N}, x.options());
  float* O = out.data_ptr<float>();
  auto run = [&](int64_t p0, int64_t p1) {
    for (int64_t r = Rn * p0; r < std::min(N, Rn * p1);) {
      int64_t rows[Rn];
      for (int i = 0; i < Rn; ++i) rows[i] = r + i;
      const int64_t n = N - r >= Rn ? Rn : 1;
      for (int64_t t = r + 2 * Rows::ahead; t < std::min(N, r + 2 * Rows::ahead + n); ++t) w.prefetch(t, 0, K / 32);
      for (int64_t m = 0; m < M; ++m)
        n == Rn ? dot(std::integral_constant<int, Rn>(), rows, m, O + m * N + r)
                : dot(std::integral_constant<int, 1>(), rows, m, O + m * N + r);
      r += n;
    }
  };
  if (at::get_num_threads() == 1) run(0, passes); else at::parallel_for(0, passes, 16 / Rn, run);
  return out;
}

// y[j] = row(idx[j]): the selected rows' dot products, Rn rows at a time, split across threads by j;
// dot(R, rows, o) as for rows_mm.
template <int Rn, class Dot>
torch::Tensor rows_mv(const torch::Tensor& x, const Rows& w, const torch::Tensor& idx, int64_t N, int64_t K, Dot dot) {
  check_rows(x, K, "x");
  const int64_t* I = check_idx(idx, N);
  const int64_t k = idx.numel();
  auto out = torch::empty({k}, x.options());
  float* O = out.data_ptr<float>();
  at::parallel_for(0, k, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0, n; j < j1; j += n) {
      n = j1 - j >= Rn ? Rn : 1;
      for (int64_t t = j + Rows::ahead; t < std::min(j1, j + Rows::ahead + n); ++t) w.prefetch(I[t], 0, K / 32);
      n == Rn ? dot(std::integral_constant<int, Rn>(), I + j, O + j) : dot(std::integral_constant<int, 1>(), I + j, O + j);
    }
  });
  return out;
}

// out [K] = sum_j a[j] * row(idx[j]): each thread owns a slice of 32-column blocks and streams that
// slice of every selected row once, 4 rows per pass over its slice of out (kept in L1).
// block(r, b, g, a, v) puts block b (in group g) of row r into v as 32 floats and returns the
// factor it is multiplied by (a times the group's scale).
template <class Block>
torch::Tensor rows_axpy(const torch::Tensor& a, const Rows& w, const torch::Tensor& idx, int64_t N, int64_t K,
                        int64_t per, Block block) {
  check_rows(a, idx.numel(), "a");
  const int64_t* I = check_idx(idx, N);
  auto out = torch::zeros({K}, a.options());
  float* O = out.data_ptr<float>();
  const float* A = a.data_ptr<float>();
  const int64_t k = a.numel();
  at::parallel_for(0, K / 32, 4, [&](int64_t b0, int64_t b1) {
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

}  // namespace

// x [M, K] fp32; qs [N, K/2] uint8; scale, min [N, K/group] fp32 -> [M, N]
torch::Tensor q4_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor scale, torch::Tensor min, int64_t group) {
  const int64_t K = qs.size(1) * 2, G = check_groups(qs, torch::kByte, K, group, {scale, min}), per = group / 32;
  check(x, K);
  // the min term: sum_j (c_j s + m) x_j = s sum c_j x_j + m sum x_j, with exact float sums of x
  const QActs xa(x.data_ptr<float>(), x.size(0), K, group);
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  const float* S = scale.data_ptr<float>();
  const float* MN = min.data_ptr<float>();
  return rows_mm<4>(x, Rows(Q, K / 2, K), qs.size(0), K, [&](auto R, const int64_t* rows, int64_t m, float* o) {
    dot_q4<R>(Q, S, MN, rows, G, per, xa.q + m * K, xa.d + m * K / 32, xa.g + m * G, o);
  });
}

// x [M, K] fp32; qs [N, K/2] uint8; lut [N, K/group, 16] int8 (codebooks rounded to int8);
// lut_scale [N, K/group] fp32 -> [M, N]
torch::Tensor lut4_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor lut, torch::Tensor lut_scale, int64_t group) {
  const int64_t K = qs.size(1) * 2, G = check_groups(qs, torch::kByte, K, group, {lut_scale}), per = group / 32;
  check(x, K);
  TORCH_CHECK(lut.scalar_type() == torch::kChar && lut.is_contiguous() && lut.numel() == qs.size(0) * G * 16,
              "lut must be contiguous int8 [N, K/group, 16]");
  const QActs xa(x.data_ptr<float>(), x.size(0), K);
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  const int8_t* L = lut.data_ptr<int8_t>();
  const float* LS = lut_scale.data_ptr<float>();
  return rows_mm<4>(x, Rows(Q, K / 2, K), qs.size(0), K, [&](auto R, const int64_t* rows, int64_t m, float* o) {
    dot_lut4<R>(Q, L, LS, rows, G, per, xa.q + m * K, xa.d + m * K / 32, o);
  });
}

// x [M, K] fp32; q [N, K] int8; scale [N, K/group] fp32 -> [M, N]
torch::Tensor q8_mm(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t group) {
  const int64_t K = q.size(1), G = check_groups(q, torch::kChar, K, group, {scale}), per = group / 32;
  check(x, K);
  const QActs xa(x.data_ptr<float>(), x.size(0), K);
  const int8_t* Q = q.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  return rows_mm<Q8_ROWS>(x, Rows(Q, K, K), q.size(0), K, [&](auto R, const int64_t* rows, int64_t m, float* o) {
    dot_q8<R>(Q, S, rows, G, per, xa.q + m * K, xa.d + m * K / 32, o);
  });
}

// Row-sparse ops (Deja Vu's sparse MLP at batch 1): only rows idx [k] of w [N, K] are read, each once, no copy.
// *_rows_mv(x [K], ..., idx) -> [k] equals *_mm(x[None], ...)[0, idx] bit for bit;
// *_rows_axpy(a [k], ..., idx) -> [K] = sum_j a_j w[idx_j] (duplicates add up), dequantised in registers.

torch::Tensor f32_rows_mv(torch::Tensor x, torch::Tensor w, torch::Tensor idx) {
  const int64_t K = w.size(1);
  check_groups(w, torch::kFloat, K, K, {});
  const float* W = w.data_ptr<float>();
  const float* X = x.data_ptr<float>();
  return rows_mv<1>(x, Rows(W, K * 4, K), idx, w.size(0), K,
                    [&](auto, const int64_t* rows, float* o) { o[0] = dot_f32(W + rows[0] * K, X, K); });
}

torch::Tensor q8_rows_mv(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t group, torch::Tensor idx) {
  const int64_t K = q.size(1), G = check_groups(q, torch::kChar, K, group, {scale}), per = group / 32;
  check_rows(x, K, "x");
  const QActs xa(x.data_ptr<float>(), 1, K);
  const int8_t* Q = q.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  return rows_mv<Q8_ROWS>(x, Rows(Q, K, K), idx, q.size(0), K,
                          [&](auto R, const int64_t* rows, float* o) { dot_q8<R>(Q, S, rows, G, per, xa.q, xa.d, o); });
}

torch::Tensor q4_rows_mv(torch::Tensor x, torch::Tensor qs, torch::Tensor scale, torch::Tensor min, int64_t group,
                         torch::Tensor idx) {
  const int64_t K = qs.size(1) * 2, G = check_groups(qs, torch::kByte, K, group, {scale, min}), per = group / 32;
  check_rows(x, K, "x");
  const QActs xa(x.data_ptr<float>(), 1, K, group);
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  const float* S = scale.data_ptr<float>();
  const float* MN = min.data_ptr<float>();
  return rows_mv<4>(x, Rows(Q, K / 2, K), idx, qs.size(0), K, [&](auto R, const int64_t* rows, float* o) {
    dot_q4<R>(Q, S, MN, rows, G, per, xa.q, xa.d, xa.g, o);
  });
}

torch::Tensor f32_rows_axpy(torch::Tensor a, torch::Tensor w, torch::Tensor idx) {
  const int64_t K = w.size(1);
  check_groups(w, torch::kFloat, K, K, {});
  const float* W = w.data_ptr<float>();
  return rows_axpy(a, Rows(W, K * 4, K), idx, w.size(0), K, 1, [&](int64_t r, int64_t b, int64_t, float aj,
                                                                     __m256* v) {
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(W + r * K + b * 32 + 8 * i);
    return aj;
  });
}

torch::Tensor q8_rows_axpy(torch::Tensor a, torch::Tensor q, torch::Tensor scale, int64_t group, torch::Tensor idx) {
  const int64_t K = q.size(1), G = check_groups(q, torch::kChar, K, group, {scale}), per = group / 32;
  const int8_t* Q = q.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  return rows_axpy(a, Rows(Q, K, K), idx, q.size(0), K, per, [&](int64_t r, int64_t b, int64_t g, float aj,
                                                                   __m256* v) {
    const int8_t* row = Q + r * K + b * 32;
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * i))));
    return aj * S[r * G + g];
  });
}

// w = code * s + m: the codes' part goes through the block, the min's part a_j m is one float per
// block (a group's blocks share it), added to the block's 32 columns at the end.
torch::Tensor q4_rows_axpy(torch::Tensor a, torch::Tensor qs, torch::Tensor scale, torch::Tensor min, int64_t group,
                           torch::Tensor idx) {
  const int64_t K = qs.size(1) * 2, G = check_groups(qs, torch::kByte, K, group, {scale, min}), per = group / 32;
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  const float* S = scale.data_ptr<float>();
  const float* MN = min.data_ptr<float>();
  std::vector<float> mins(K / 32, 0.f);  // per block; threads own disjoint blocks
  auto out = rows_axpy(a, Rows(Q, K / 2, K), idx, qs.size(0), K, per, [&](int64_t r, int64_t b, int64_t g, float aj,
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

TORCH_LIBRARY(attnlab, m) {
  m.def("q4_mm(Tensor x, Tensor qs, Tensor scale, Tensor min, int group) -> Tensor");
  m.def("lut4_mm(Tensor x, Tensor qs, Tensor lut, Tensor lut_scale, int group) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor q, Tensor scale, int group) -> Tensor");
  m.def("f32_rows_mv(Tensor x, Tensor w, Tensor idx) -> Tensor");
  m.def("q8_rows_mv(Tensor x, Tensor q, Tensor scale, int group, Tensor idx) -> Tensor");
  m.def("q4_rows_mv(Tensor x, Tensor qs, Tensor scale, Tensor min, int group, Tensor idx) -> Tensor");
  m.def("f32_rows_axpy(Tensor a, Tensor w, Tensor idx) -> Tensor");
  m.def("q8_rows_axpy(Tensor a, Tensor q, Tensor scale, int group, Tensor idx) -> Tensor");
  m.def("q4_rows_axpy(Tensor a, Tensor qs, Tensor scale, Tensor min, int group, Tensor idx) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("q4_mm", &q4_mm);
  m.impl("lut4_mm", &lut4_mm);
  m.impl("q8_mm", &q8_mm);
  m.impl("f32_rows_mv", &f32_rows_mv);
  m.impl("q8_rows_mv", &q8_rows_mv);
  m.impl("q4_rows_mv", &q4_rows_mv);
  m.impl("f32_rows_axpy", &f32_rows_axpy);
  m.impl("q8_rows_axpy", &q8_rows_axpy);
  m.impl("q4_rows_axpy", &q4_rows_axpy);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
