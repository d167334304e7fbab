// Single-query attention over a KV cache (batch-1 decoding), AVX2 + FMA + F16C.
//
// At one query token attention is a pass over the cache: every key and value is read once,
// so its speed is the cache's bytes over the memory bandwidth. torch's SDPA reaches about a
// third of that on this path (a small-matrix GEMM per head, then softmax, then another); here
// the G query heads of a KV group share each key and value load, the softmax exponentials are
// vectorised, and the cache may be stored in float16 (half the bytes, as llama.cpp's default
// KV cache) or int8 with a float32 scale per 32 dimensions (llama.cpp's q8_0 cache, 1.125 bytes),
// widened in registers. The cache goes by in blocks of rows: a block's scores, their softmax against
// the running maximum (flash attention's online softmax; the scores stay in L1), then its values, all
// dimensions of a block before the next, so keys and values are read once each, in order. With more
// than one thread a head's rows are cut into stretches whose softmaxes merge by their maxima and sums
// (flash-decoding's split), so 3 KV heads share out evenly over 2 threads.
//
// q [B, Hq, 1, D] float32; k, v [B, Hkv, n, D] float32, float16 or int8 (then k_scale, v_scale
// [B, Hkv, n, D/32] float32), innermost dimension contiguous (slices of the cache's preallocated
// buffers); out [B, Hq, 1, D] float32.
// Query head h reads KV head h / (Hq / Hkv), as in grouped-query attention.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attend.h"
#include "kernels_simd.h"
#include "ops.h"

using namespace attnlab_simd;
using attnlab::Alloc;
using attnlab::Opt;
using attnlab::View;

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const attnlab::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The scales of an int8 cache's rows (one per 32 dimensions, `stride` floats apart); unused otherwise.
struct Scales {
  const float* p = nullptr;
  int64_t stride = 0;
  Scales from(int64_t row, int64_t col = 0) const { return {p ? p + row * stride + col : nullptr, stride}; }
  float at(int64_t row, int64_t col = 0) const { return p[row * stride + col]; }
};
template <class T>
constexpr bool kInt8 = std::is_same_v<T, int8_t>;

// The hardware prefetcher alone leaves a single-query pass at about half the bandwidth: ask for
// the key row kAhead ahead and the value rows a block ahead (reading past the end of the slice is
// harmless: a prefetch never faults).
constexpr int64_t kAhead = 24;
constexpr int64_t kMinStretch = 256;  // rows: below this, splitting a head costs more than it shares
constexpr int64_t kBlock = 64;  // rows per block: 8 KB of float16 values at D = 64, well inside L1
template <class T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// A[g * D + 8j ...] += sum_t P[g * ldp + t] V[t][8j ...] over the rows t < n, for J (compile-time, so the
// G x J accumulators stay in registers) chunks of 8 dimensions.
// An int8 V: the J chunks lie in one block of 32 (V starts at a multiple of 32), so its scale folds into P.
template <int G, int J, class T>
inline void pv(const float* P, int64_t ldp, const T* V, int64_t sv, Scales vs, int64_t n, float* A, int64_t D) {
  __m256 acc[G][J];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < J; ++j) acc[g][j] = _mm256_loadu_ps(A + g * D + 8 * j);
  int64_t t = 0;
  do {  // n >= 1; a for loop here makes GCC 12 store every accumulator to the stack on each row
    const T* v = V + t * sv;
    __m256 p[G];
    for (int g = 0; g < G; ++g) p[g] = _mm256_broadcast_ss(P + g * ldp + t);
    if constexpr (kInt8<T>)
      for (int g = 0; g < G; ++g) p[g] = _mm256_mul_ps(p[g], _mm256_set1_ps(vs.at(t)));
    for (int j = 0; j < J; ++j) {
      const __m256 vv = load8(v + 8 * j);
      for (int g = 0; g < G; ++g) acc[g][j] = _mm256_fmadd_ps(p[g], vv, acc[g][j]);
    }
  } while (++t < n);
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < J; ++j) _mm256_storeu_ps(A + g * D + 8 * j, acc[g][j]);
}

// One block of scores s[0..n) against the running softmax (max *m, sum *l, output rows o[D]): a new
// maximum rescales the running sum and output, then s[t] <- e^(s[t] - *m) in place and *l grows by their sum.
inline void softmax_block(float* s, int64_t n, float* m, float* l, float* o, int64_t D) {
  __m256 m8 = _mm256_set1_ps(s[0]);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + t));
  float mx = hmax(m8);
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  if (mx > *m) {
    if (*l > 0.f) {  // earlier blocks were weighed against a smaller maximum
      const float c = std::exp(*m - mx);
      *l *= c;
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), _mm256_set1_ps(c)));
    }
    *m = mx;
  }
  const __m256 mm = _mm256_set1_ps(*m);
  __m256 sum = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + t), mm));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum(sum);
  for (; t < n; ++t) {
    s[t] = _mm_cvtss_f32(_mm256_castps256_ps128(exp_neg(_mm256_set1_ps(s[t] - *m))));
    total += s[t];
  }
  *l += total;
}

// the four sums of a[0..3]'s lanes, in one transposed pass (4 horizontal sums would take twice the shuffles)
inline __m128 hsum4(const __m256* a) {
  const __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));
  const __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, 0x44), _mm256_shuffle_ps(s01, s23, 0xEE));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// S[g * n + r] = scale * Q[g] . K[r] for the R rows K[r * sk ...]; Ahead: ask for the key rows kAhead further on
template <int G, int R, class T, bool Ahead = true>
inline void scores(const float* Q, const T* K, int64_t sk, Scales ks, int64_t D, float scale, float* S, int64_t n) {
  __m256 acc[G][R];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = _mm256_setzero_ps();
  if constexpr (Ahead)
    for (int r = 0; r < R; ++r) prefetch_row(K + (kAhead + r) * sk, D);
  int64_t d = 0;
  do {  // D >= 8 (see pv on the loop's form)
    for (int r = 0; r < R; ++r) {
      __m256 kv = load8(K + r * sk + d);
      if constexpr (kInt8<T>) kv = _mm256_mul_ps(kv, _mm256_set1_ps(ks.at(r, d / 32)));
      for (int g = 0; g < G; ++g) acc[g][r] = _mm256_fmadd_ps(_mm256_loadu_ps(Q + g * D + d), kv, acc[g][r]);
    }
  } while ((d += 8) < D);
  if constexpr (R == 4) {
    for (int g = 0; g < G; ++g) _mm_storeu_ps(S + g * n, _mm_mul_ps(hsum4(acc[g]), _mm_set1_ps(scale)));
  } else {
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) S[g * n + r] = hsum(acc[g][r]) * scale;
  }
}

// One KV head and the G (<= 3 per call) query heads Q[g * D ...] that read it, over the n rows of a
// stretch of the cache: the softmax's maximum M[g] and sum L[g] and its unnormalised output
// O[g * D ...] = sum_t e^(S[g][t] - M[g]) V[t] (stretches combine by these). Blocks of kBlock rows go
// through scores, softmax and P.V in turn (flash attention's online softmax): the scores stay in L1
// and the key and value streams alternate.
// Keys per scores call and 8-dimension chunks per P.V pass for G query heads: as many as keep the G x R and
// G x J accumulators in registers (32 vector registers with AVX-512VL, 16 without).
#if defined(__AVX512VL__)
constexpr int kRegs = 32;
#else
constexpr int kRegs = 16;
#endif
template <int G>
constexpr int kKeys = G * 4 + 2 <= kRegs ? 4 : 2;
template <int G>
constexpr int kChunks = G * 4 + G + 1 <= kRegs ? 4 : 2;

// The online softmax (M, L, O as head leaves them) continued over n more rows: what head does after its start,
// and what a pass over several runs of rows (Quest's pages, `runs`) does per run. Ahead: prefetch past the rows
// (a dense stretch); a short run asks for the next run instead.
template <int G, class T, bool Ahead>
void blocks(const float* Q, const T* K, const T* V, int64_t sk, int64_t sv, Scales ks, Scales vs, int64_t n, int64_t D,
            float scale, float* O, float* M, float* L) {
  constexpr int R = kKeys<G>, J = kChunks<G>;
  alignas(32) float S[G][kBlock];
  for (int64_t t0 = 0; t0 < n; t0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - t0);
    // scores, R keys at a time: G x R independent FMA chains (one chain per score would leave the loop
    // bound by the FMA latency), and each key row read once for the G queries
    int64_t t = 0;
    for (; t + R <= nb; t += R) {
      // the next block's values, asked for beside these keys: they arrive during this block's arithmetic
      // (asked for during P.V, a block ahead, they came 1.1-1.3x slower from memory for a float16 cache)
      if constexpr (Ahead)
        for (int r = 0; r < R; ++r) prefetch_row(V + (t0 + kBlock + t + r) * sv, D);
      scores<G, R, T, Ahead>(Q, K + (t0 + t) * sk, sk, ks.from(t0 + t), D, scale, S[0] + t, kBlock);
    }
    for (; t < nb; ++t) scores<G, 1, T, Ahead>(Q, K + (t0 + t) * sk, sk, ks.from(t0 + t), D, scale, S[0] + t, kBlock);
    for (int g = 0; g < G; ++g) softmax_block(S[g], nb, M + g, L + g, O + g * D, D);
    // P.V, all D dimensions of the block (8 J at a time: G x J accumulators), each row fetched from memory once
    for (int64_t d0 = 0; d0 < D; d0 += 8 * J) {
      const T* v = V + t0 * sv + d0;
      const Scales vsb = vs.from(t0, d0 / 32);
      switch (std::min<int64_t>(J, (D - d0) / 8)) {
        case 4: pv<G, 4>(S[0], kBlock, v, sv, vsb, nb, O + d0, D); break;
        case 3: pv<G, 3>(S[0], kBlock, v, sv, vsb, nb, O + d0, D); break;
        case 2: pv<G, 2>(S[0], kBlock, v, sv, vsb, nb, O + d0, D); break;
        default: pv<G, 1>(S[0], kBlock, v, sv, vsb, nb, O + d0, D);
      }
    }
  }
}

template <int G, class T>
void head(const float* Q, const T* K, const T* V, int64_t sk, int64_t sv, Scales ks, Scales vs, int64_t n, int64_t D,
          float scale, float* O, float* M, float* L) {
  for (int g = 0; g < G; ++g) M[g] = -INFINITY, L[g] = 0.f;
  std::fill(O, O + G * D, 0.f);
  blocks<G, T, true>(Q, K, V, sk, sv, ks, vs, n, D, scale, O, M, L);
}

// The G query heads of one KV head, over one stretch of the cache (see head).
template <class T>
void heads(const float* Q, const T* K, const T* V, int64_t sk, int64_t sv, Scales ks, Scales vs, int64_t n, int64_t D,
           int64_t G, float scale, float* O, float* M, float* L) {
  // query heads of the group in fours (G = 4, 8: Llama-3's 32/8) or threes (SmolLM2's 9/3): each pass reads the
  // stretch's keys and values once, so a 4-head group split 3 + 1 read them twice (1.5x the time at depth 4096)
  const int64_t step = G % 4 == 0 ? 4 : 3;
  for (int64_t g = 0; g < G; g += step) {
    const int64_t r = std::min<int64_t>(step, G - g);
    const float* q = Q + g * D;
    float *o = O + g * D, *m = M + g, *l = L + g;
    if (r == 4) head<4>(q, K, V, sk, sv, ks, vs, n, D, scale, o, m, l);
    else if (r == 3) head<3>(q, K, V, sk, sv, ks, vs, n, D, scale, o, m, l);
    else if (r == 2) head<2>(q, K, V, sk, sv, ks, vs, n, D, scale, o, m, l);
    else head<1>(q, K, V, sk, sv, ks, vs, n, D, scale, o, m, l);
  }
}

inline void scale_row(float* o, int64_t D, float c) {  // D a multiple of 8
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), _mm256_set1_ps(c)));
}

template <class T>
Scales scales_of(const Opt& s, int64_t b, int64_t h) {
  if constexpr (!kInt8<T>) return {};
  else return {s->data_ptr<float>() + b * s->stride(0) + h * s->stride(1), s->stride(2)};
}

// out [B, Hq, 1, D] and, where lse is given, each query head's log-sum-exp of its scores [B, Hq]: what a
// caller that splits the cache into stretches (the native step's threads) needs to merge their outputs.
// Inside a parallel region (such a caller's thread) it runs on the calling thread alone.
View attend(const Alloc& alloc, const View& q, const View& k, const View& v, double scale, const Opt& k_scale,
            const Opt& v_scale, bool with_lse) {
  ATTNLAB_CHECK(q.scalar_type() == attnlab::kFloat && q.dim() == 4 && q.size(2) == 1, "q must be float32 [B, Hq, 1, D]");
  ATTNLAB_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.scalar_type() == v.scalar_type(),
              "k and v must have one shape [B, Hkv, n, D] and one dtype");
  const auto dtype = k.scalar_type();
  ATTNLAB_CHECK(dtype == attnlab::kFloat || dtype == attnlab::kHalf || dtype == attnlab::kChar,
              "k, v must be float32, float16 or int8");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), Hkv = k.size(1), n = k.size(2);
  ATTNLAB_CHECK(k.size(0) == B && k.size(3) == D && Hkv > 0 && Hq % Hkv == 0 && D > 0 && D % 8 == 0 && n > 0,
              "shapes do not match: q ", q.sizes(), ", k ", k.sizes());
  ATTNLAB_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k and v must be contiguous in their last dimension");
  ATTNLAB_CHECK((dtype == attnlab::kChar) == (k_scale.has_value() && v_scale.has_value()),
              "k_scale and v_scale come with an int8 cache, and only with one");
  if (dtype == attnlab::kChar) {
    ATTNLAB_CHECK(D % 32 == 0, "an int8 cache needs D a multiple of 32");
    for (const auto* s : {&*k_scale, &*v_scale})
      ATTNLAB_CHECK(s->scalar_type() == attnlab::kFloat && s->dim() == 4 && s->size(0) == B && s->size(1) == Hkv &&
                      s->size(2) == n && s->size(3) == D / 32 && s->stride(3) == 1,
                  "scales must be float32 [B, Hkv, n, D/32], contiguous in their last dimension");
  }
  auto out = alloc(q.sizes().vec(), attnlab::kFloat);  // q: contiguous (Contig)
  float* lse = with_lse ? alloc({B, Hq}, attnlab::kFloat).data_ptr<float>() : nullptr;
  const int64_t G = Hq / Hkv;
  // Work items are stretches of one KV head's rows. One stretch per head at one thread; with more, heads
  // are cut so the items share out evenly (3 KV heads on 2 threads: 6 stretches, not 2 heads and 1), each
  // at least kMinStretch rows, and the stretches' softmaxes are merged below by their maxima and sums.
  const int64_t threads = attnlab::in_parallel_region() ? 1 : attnlab::num_threads(), heads_n = B * Hkv;
  const int64_t cuts =
      threads == 1 ? 1 : std::max<int64_t>(1, std::min(threads / std::gcd(heads_n, threads), n / kMinStretch));
  const int64_t len = (n + cuts - 1) / cuts, items = heads_n * cuts;  // no stretch is empty: len >= kMinStretch
  float* O = out.data_ptr<float>();
  std::vector<float> ml(items * 2 * G);                       // per item: softmax maxima [G], sums [G]
  std::vector<float> partial(cuts > 1 ? items * G * D : 0);  // per item: unnormalised outputs [G, D]
  const float* Q = q.data_ptr<float>();
  auto run_as = [&](auto tag, int64_t i0, int64_t i1) {
    using T = decltype(tag);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bh = i / cuts, b = bh / Hkv, h = bh % Hkv, t0 = i % cuts * len, m = std::min(len, n - t0);
      float *o = cuts == 1 ? O + bh * G * D : partial.data() + i * G * D, *mx = ml.data() + i * 2 * G;
      const T* kp = k.data_ptr<T>() + b * k.stride(0) + h * k.stride(1) + t0 * k.stride(2);
      const T* vp = v.data_ptr<T>() + b * v.stride(0) + h * v.stride(1) + t0 * v.stride(2);
      heads(Q + bh * G * D, kp, vp, k.stride(2), v.stride(2), scales_of<T>(k_scale, b, h).from(t0),
            scales_of<T>(v_scale, b, h).from(t0), m, D, G, static_cast<float>(scale), o, mx, mx + G);
      if (cuts == 1)
        for (int64_t g = 0; g < G; ++g) {
          scale_row(o + g * D, D, 1.f / mx[G + g]);
          if (lse) lse[bh * G + g] = mx[g] + std::log(mx[G + g]);
        }
    }
  };
  auto run = [&](int64_t i0, int64_t i1) {
    if (dtype == attnlab::kFloat) run_as(float{}, i0, i1);
    else if (dtype == attnlab::kHalf) run_as(attnlab::Half{}, i0, i1);
    else run_as(int8_t{}, i0, i1);
  };
  if (threads == 1) run(0, items); else attnlab::parallel_for(0, items, 1, run);
  if (cuts > 1)  // merge the stretches of each query head: weights e^(M_c - max M) on outputs and sums
    for (int64_t bh = 0; bh < heads_n; ++bh)
      for (int64_t g = 0; g < G; ++g) {
        float top = -INFINITY, total = 0.f;
        for (int64_t c = 0; c < cuts; ++c) top = std::max(top, ml[(bh * cuts + c) * 2 * G + g]);
        float* o = O + (bh * G + g) * D;
        std::fill(o, o + D, 0.f);
        for (int64_t c = 0; c < cuts; ++c) {
          const float* mx = ml.data() + (bh * cuts + c) * 2 * G;
          const float w = std::exp(mx[g] - top);
          total += w * mx[G + g];
          const float* p = partial.data() + (bh * cuts + c) * G * D + g * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * p[d];
        }
        scale_row(o, D, 1.f / total);
        if (lse) lse[bh * G + g] = top + std::log(total);
      }
  return out;
}

// Keys or values rounded for an int8 cache: x [..., D] float32 -> codes [..., D] int8 and scales
// [..., D/32] float32 by the rule of attnlab.quant.formats.int8_blocks, bit for bit (scale =
// max(amax, 1e-12) / 127, code = x / scale rounded half to even, clamped to +-127). One call where the
// torch form is eight per tensor, and opaque to inductor, which compiles that form slowly.
}  // namespace

void attnlab_attend::quantize(const float* X, int64_t nb, int8_t* Q, float* S) {
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (int64_t b = 0; b < nb; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(X + b * 32 + 8 * i);
    const float d = std::max(absmax32(v), 1e-12f) / 127.f;
    S[b] = d;
    __m256i c[4];
    for (int i = 0; i < 4; ++i)  // cvtps rounds half to even (the default MXCSR mode), as torch.round
      c[i] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_div_ps(v[i], _mm256_set1_ps(d)))));
    store32(Q + b * 32, c);
  }
}

void attnlab_attend::stretch(const float* q, const Cache& c, int64_t Hkv, int64_t G, int64_t D, int64_t s0, int64_t s1,
                             float scale, float* out, float* lse) {
  thread_local std::vector<float> ml;  // maxima [G], sums [G]: per thread, not an allocation per layer and step
  ml.resize(2 * G);
  auto run_as = [&](auto tag) {
    using T = decltype(tag);
    for (int64_t h = 0; h < Hkv; ++h) {
      const T* K = static_cast<const T*>(c.k) + h * c.head + s0 * c.row;
      const T* V = static_cast<const T*>(c.v) + h * c.head + s0 * c.row;
      const Scales ks = kInt8<T> ? Scales{c.ks + h * c.shead, c.srow}.from(s0) : Scales{};
      const Scales vs = kInt8<T> ? Scales{c.vs + h * c.shead, c.srow}.from(s0) : Scales{};
      float* o = out + h * G * D;
      heads(q + h * G * D, K, V, c.row, c.row, ks, vs, s1 - s0, D, G, scale, o, ml.data(), ml.data() + G);
      for (int64_t g = 0; g < G; ++g) {  // as attend() with one stretch
        scale_row(o + g * D, D, 1.f / ml[G + g]);
        lse[h * G + g] = ml[g] + std::log(ml[G + g]);
      }
    }
  };
  if (c.dtype == 0) run_as(float{});
  else if (c.dtype == 1) run_as(attnlab::Half{});
  else run_as(int8_t{});
}

void attnlab_attend::runs(const float* q, const Cache& c, int64_t G, int64_t D, const int64_t* bounds, int64_t n,
                          float scale, float* out, float* lse) {
  constexpr int64_t kLong = 4 * kBlock;  // rows: a run this long prefetches as a dense stretch does
  thread_local std::vector<float> ml;
  ml.resize(2 * G);
  float *M = ml.data(), *L = ml.data() + G;
  auto run_as = [&](auto tag) {
    using T = decltype(tag);
    const T *K = static_cast<const T*>(c.k), *V = static_cast<const T*>(c.v);
    const Scales ks = kInt8<T> ? Scales{c.ks, c.srow} : Scales{}, vs = kInt8<T> ? Scales{c.vs, c.srow} : Scales{};
    const int64_t step = G % 4 == 0 ? 4 : 3;  // as heads
    for (int64_t g = 0; g < G; g += step) {
      const int64_t r = std::min<int64_t>(step, G - g);
      const float* Q = q + g * D;
      float *O = out + g * D, *m = M + g, *l = L + g;
      std::fill(m, m + r, -INFINITY), std::fill(l, l + r, 0.f), std::fill(O, O + r * D, 0.f);
      // a run's first rows are asked for two runs ahead: a page's keys and values (4 KB in float16) take longer
      // to arrive from memory than the run before takes to read (one run ahead: pages at 3x a dense row's time)
      auto ask = [&](int64_t i) {
        if (i < n)
          for (int64_t t = bounds[2 * i], e = std::min(bounds[2 * i + 1], t + 32); t < e; ++t)
            prefetch_row(K + t * c.row, D), prefetch_row(V + t * c.row, D);
      };
      ask(0), ask(1);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t s0 = bounds[2 * i], s1 = bounds[2 * i + 1], rows = s1 - s0;
        ask(i + 2);
        const T *k = K + s0 * c.row, *v = V + s0 * c.row;
        const Scales ksr = ks.from(s0), vsr = vs.from(s0);
        auto go = [&](auto G_, auto ahead) {
          blocks<decltype(G_)::value, T, decltype(ahead)::value>(Q, k, v, c.row, c.row, ksr, vsr, rows, D, scale, O,
                                                                   m, l);
        };
        auto pick = [&](auto ahead) {
          if (r == 4) go(std::integral_constant<int, 4>{}, ahead);
          else if (r == 3) go(std::integral_constant<int, 3>{}, ahead);
          else if (r == 2) go(std::integral_constant<int, 2>{}, ahead);
          else go(std::integral_constant<int, 1>{}, ahead);
        };
        if (rows >= kLong) pick(std::true_type{});
        else pick(std::false_type{});
      }
      for (int64_t h = 0; h < r; ++h) {
        scale_row(O + h * D, D, 1.f / l[h]);
        lse[g + h] = m[h] + std::log(l[h]);
      }
    }
  };
  if (c.dtype == 0) run_as(float{});
  else if (c.dtype == 1) run_as(attnlab::Half{});
  else run_as(int8_t{});
}

namespace attnlab {

View decode_attention(const Alloc& out, const Contig& q, const View& k, const View& v, double scale, const Opt& k_scale,
                      const Opt& v_scale) {
  return attend(out, q, k, v, scale, k_scale, v_scale, false);
}

View decode_attention_lse(const Alloc& out, const Contig& q, const View& k, const View& v, double scale,
                          const Opt& k_scale, const Opt& v_scale) {
  return attend(out, q, k, v, scale, k_scale, v_scale, true);
}

View quantize_kv(const Alloc& out, const Contig& x) {
  ATTNLAB_CHECK(x.scalar_type() == attnlab::kFloat && x.dim() >= 1 && x.size(-1) % 32 == 0,
                "x must be float32 [..., D] with D a multiple of 32");
  auto shape = x.sizes().vec();
  const View codes = out(shape, attnlab::kChar);
  shape.back() /= 32;
  attnlab_attend::quantize(x.data_ptr<float>(), x.numel() / 32, codes.data_ptr<int8_t>(),
                           out(shape, attnlab::kFloat).data_ptr<float>());
  return codes;
}

}  // namespace attnlab
