// The SIMD arithmetic of kernels.cpp (AVX2 + FMA), free of torch so it can be timed and read alone:
// activation rounding and the per-row dot products. See kernels.cpp for the block layouts.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#ifdef __AMX_TILE__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attnlab_simd {

#ifdef __AMX_TILE__
inline bool amx_granted() {  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}
#endif

template <class Op>  // op(a, b) = _mm_add_ps or _mm_max_ps over the 8 lanes of v
inline float reduce(__m256 v, Op op) {
  __m128 s = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = op(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(op(s, _mm_movehdup_ps(s)));  // lane 0 is all that is read: same as the _ss form
}
inline float hsum(__m256 v) { return reduce(v, [](__m128 a, __m128 b) { return _mm_add_ps(a, b); }); }
inline float hmax(__m256 v) { return reduce(v, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); }); }

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

// The largest |x| of 32 values held in v[0..4).
inline float absmax32(const __m256 v[4]) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  return hmax(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
}

// 32 int32 codes c[0..4) (in range) -> 32 int8 at q, in value order (packs interleaves the lanes).
inline void store32(int8_t* q, const __m256i c[4]) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// x [nb * 32] -> int8 codes, one scale per 32 values and (if sums) the sums of the rounded values, d * sum q;
// q = lrint(x * 127 / amax), vectorised as ggml's quantize_row_q8_0 (cvtps rounds to nearest even, as lrintf).
// Why sums of the rounded values (llama.cpp's Q8_1 `s`) and not of x: with them a min term makes the kernel
// exactly (rounded x) . (c s + m); float sums of x leave the rounding error weighted by c s (0..15 s) instead
// of by the weight (about -8 s..7 s), which on SmolLM2's Q4_1 file made the decode path's KL 4-5x llama.cpp's.
inline void quantize_rows(const float* x, int64_t nb, int8_t* q, float* d, float* sums) {
  for (int64_t b = 0; b < nb; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + b * 32 + 8 * i);
    const float amax = absmax32(v);
    d[b] = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    store32(q + b * 32, c);
    if (sums) {
      int32_t s = 0;
      for (int i = 0; i < 32; ++i) s += q[b * 32 + i];
      sums[b] = d[b] * static_cast<float>(s);
    }
  }
}

// The dot helpers compute R weight rows (row numbers rows[0..R)) times one rounded activation row
// (xr, dr) into out[0..R): the rows share each activation block load and their sums form R
// independent chains (one chain is bound by the FMA latency). Each row's arithmetic and order is
// the same for any R, so results do not depend on R.
// q4: sum over groups of s * (codes . xq) * d + m * sum(xq * d).
template <int R, int P = 0>  // P: `per` known at compile time (1 for group 32), 0 if not
inline void dot_q4(const uint8_t* Q, const float* S, const float* MN, const int64_t* rows, int64_t G, int64_t per_,
                   const int8_t* xr, const float* dr, const float* gs, float* out) {
  const int64_t per = P ? P : per_;
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

// q4 at group 32, two blocks per step: 32 code bytes (blocks 2p and 2p+1) split into low and high
// nibbles meet activations laid out to match (pair_acts), so one and/shift, two maddubs and one madd
// serve 64 weights; lanes 0-3 hold block 2p's sums, lanes 4-7 block 2p+1's, scaled by one vector. About
// 1.5x the blocks per second of dot_q4 from L2, which leaves q4 matmuls nearer the memory bound.
// pair_acts: X[64p ..] = (x_2p[0:16], x_2p+1[0:16]), X[64p + 32 ..] = (x_2p[16:32], x_2p+1[16:32]),
// D[8p ..] = (d_2p x4, d_2p+1 x4), for the nb (even) blocks of one rounded activation row.
inline void pair_acts(const int8_t* xq, const float* xd, int64_t nb, int8_t* X, float* D) {
  for (int64_t p = 0; p < nb / 2; ++p) {
    const auto half = [&](int64_t o) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 64 * p + o)); };
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(X + 64 * p), _mm256_set_m128i(half(32), half(0)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(X + 64 * p + 32), _mm256_set_m128i(half(48), half(16)));
    _mm256_storeu_ps(D + 8 * p, _mm256_set_m128(_mm_set1_ps(xd[2 * p + 1]), _mm_set1_ps(xd[2 * p])));
  }
}

// sum over blocks of s * (codes . xq) * d + sum over groups of m * sum(xq * d), for G (even) groups of 32
template <int R>
inline void dot_q4_pairs(const uint8_t* Q, const float* S, const float* MN, const int64_t* rows, int64_t G,
                         const int8_t* X, const float* D, const float* gs, float* out) {
  const uint8_t* q[R];
  const float *sr[R], *mr[R];
  __m256 acc[R], mins[R];
  for (int i = 0; i < R; ++i)
    q[i] = Q + rows[i] * G * 16, sr[i] = S + rows[i] * G, mr[i] = MN + rows[i] * G, acc[i] = _mm256_setzero_ps(),
    mins[i] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  int64_t p = 0;
  do {  // G >= 2; a for loop here can make GCC keep the accumulators on the stack (see attend.cpp)
    const __m256i xl = load32(X + 64 * p), xh = load32(X + 64 * p + 32);
    const __m256 d = _mm256_loadu_ps(D + 8 * p);
    for (int i = 0; i < R; ++i) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[i] + 32 * p));
      const __m256i lo = _mm256_and_si256(c, low), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
      // int16 lanes hold 4 products of at most 15 * 127: no saturation
      const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
      const __m256 sc = _mm256_set_m128(_mm_broadcast_ss(sr[i] + 2 * p + 1), _mm_broadcast_ss(sr[i] + 2 * p));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)), _mm256_mul_ps(sc, d), acc[i]);
    }
  } while (++p < G / 2);
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    for (int i = 0; i < R; ++i) mins[i] = _mm256_fmadd_ps(_mm256_loadu_ps(mr[i] + g), _mm256_loadu_ps(gs + g), mins[i]);
  for (int i = 0; i < R; ++i) {
    float m = hsum(mins[i]);
    for (int64_t h = g; h < G; ++h) m = std::fma(mr[i][h], gs[h], m);
    out[i] = hsum(acc[i]) + m;
  }
}

// dot_q4_pairs<1> of one weight row against 4 activation rows (X[a], D[a], gs[a]) into out[a * ldo]: each code
// pair is loaded and split into nibbles once for the four. Per activation row the same operations in the same
// order as dot_q4_pairs, so each output has the same bits (a batched decode step equals four single steps).
inline void dot_q4_pairs_x4(const uint8_t* q, const float* sr, const float* mr, int64_t G, const int8_t* const* X,
                            const float* const* D, const float* const* gs, float* out, int64_t ldo) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  int64_t p = 0;
  do {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * p));
    const __m256i lo = _mm256_and_si256(c, low), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
    const __m256 sc = _mm256_set_m128(_mm_broadcast_ss(sr + 2 * p + 1), _mm_broadcast_ss(sr + 2 * p));
    for (int a = 0; a < 4; ++a) {
      const __m256i xl = load32(X[a] + 64 * p), xh = load32(X[a] + 64 * p + 32);
      const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
      acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)),
                               _mm256_mul_ps(sc, _mm256_loadu_ps(D[a] + 8 * p)), acc[a]);
    }
  } while (++p < G / 2);
  for (int a = 0; a < 4; ++a) {
    __m256 mins = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) mins = _mm256_fmadd_ps(_mm256_loadu_ps(mr + g), _mm256_loadu_ps(gs[a] + g), mins);
    float m = hsum(mins);
    for (int64_t h = g; h < G; ++h) m = std::fma(mr[h], gs[a][h], m);
    out[a * ldo] = hsum(acc[a]) + m;
  }
}

// q8: |w| (unsigned) times x carrying w's sign (maddubs needs one unsigned operand). One row per
// pass: with its cheaper arithmetic, q8 from memory ran faster streaming one row than 2 or 4.
constexpr int Q8_ROWS = 1;
template <int R, int P = 0>  // P: `per` known at compile time (1 for group 32), 0 if not
inline void dot_q8(const int8_t* Q, const float* S, const int64_t* rows, int64_t G, int64_t per_, const int8_t* xr,
                   const float* dr, float* out) {
  const int64_t per = P ? P : per_;
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

// dot_q8<1, 1> of one weight row (group 32) against 4 activation rows (X[a], D[a]) into out[a * ldo]: each block's
// |w| is made once for the four. Per activation row the same operations in the same order as dot_q8, so each
// output has the same bits (a batched decode step equals four single steps); about 1.3x the rows per second.
inline void dot_q8_x4(const int8_t* w, const float* sr, int64_t G, const int8_t* const* X, const float* const* D,
                      float* out, int64_t ldo) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < G; ++b) {
    const __m256i wv = load32(w + b * 32), u = _mm256_sign_epi8(wv, wv);
    for (int a = 0; a < 4; ++a) {
      const __m256 p = dot_u8i8(u, _mm256_sign_epi8(load32(X[a] + b * 32), wv));
      acc[a] = _mm256_fmadd_ps(p, _mm256_set1_ps(D[a][b] * sr[b]), acc[a]);
    }
  }
  for (int a = 0; a < 4; ++a) out[a * ldo] = hsum(acc[a]);
}

// lut4: one byte shuffle turns 32 codes into their int8 centroids, then q8's integer dot.
template <int R, int P = 0>  // P: `per` known at compile time (1 for group 32), 0 if not
inline void dot_lut4(const uint8_t* Q, const int8_t* L, const float* LS, const int64_t* rows, int64_t G, int64_t per_,
                     const int8_t* xr, const float* dr, float* out) {
  const int64_t per = P ? P : per_;
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

// e^x for x <= 0 (softmax after the max is subtracted; SiLU on -|x|): 2^(x log2 e) = 2^n * 2^f, |f| <= 1/2,
// 2^f by a degree-6 polynomial (relative error ~2e-7); below -87 the result flushes to 0.
constexpr float kExp2[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                            5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// SiLU(g) * u, 8 at a time: g * sigmoid(g) with e = e^-|g| (exp_neg's range): sigmoid = 1 / (1 + e) for
// g >= 0, e / (1 + e) below.
inline __m256 silu_mul(__m256 g, __m256 u) {
  const __m256 e = exp_neg(_mm256_or_ps(g, _mm256_set1_ps(-0.f)));  // -|g|: the sign bit set
  const __m256 r = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), e));
  const __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), g);  // sign bit of g picks e / (1 + e)
  return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}

// out[i] = x[i] / rms(x) * w[i] over n values: the sum of squares in double (two 4-lane accumulators).
inline void rms_norm(const float* x, const float* w, float* out, int64_t n, double eps) {
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    s0 = _mm256_fmadd_pd(a, a, s0), s1 = _mm256_fmadd_pd(b, b, s1);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(s0, s1));
  double ss = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  const __m256 rv = _mm256_set1_ps(r);
  for (i = 0; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
  for (; i < n; ++i) out[i] = x[i] * r * w[i];
}

// a[i] = silu(g[i]) * g[H + i] for i in [i0, i1): gate at g, up H values later; 8 at a time where 8 remain.
inline void silu_mul_row(const float* g, float* a, int64_t i0, int64_t i1, int64_t H) {
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8)
    _mm256_storeu_ps(a + i, silu_mul(_mm256_loadu_ps(g + i), _mm256_loadu_ps(g + H + i)));
  for (; i < i1; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * g[H + i];
}

}  // namespace attnlab_simd
