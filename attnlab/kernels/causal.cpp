// Causal attention of a prompt's chunk over itself and the cache before it (prefill): AVX-512, or AMX tiles.
//
// Why: in a 512-token prefill of SmolLM2 on one thread (Xeon, AMX), torch's CPU flash attention took 5.2-5.6 ms
// a layer, ~27% of the prefill, for 151 M multiply-adds (head dim 64, 9 query heads). Its bfloat16 path (q, k,
// v rounded) takes 2.1 ms but costs KL 1.3e-4 nats a token and +0.5% perplexity (SmolLM2's float32 weights,
// 2048 tokens of the test plays), 5% of what Q4_1 weights cost. Here, float32 (AVX-512): 4.3-4.7 ms; with AMX
// (below): 1.9-2.3 ms at KL 2.4e-7 (float32 path: 1.3e-7, both against torch's float32).
//
// Per item (query head, 16 query rows): the scores of the 16 rows against every key they may see, 16 keys at a
// time from keys packed transposed once per KV head ([key block][D][16], so one 512-bit load feeds 16 rows'
// broadcast queries), the exact softmax of each row (max, exponentials, sum), then the values (float32 rows)
// weighted by it, 16 / (D / 16) rows at a time so that their accumulators stay in registers. Causal with the
// keys' end aligned to the queries' end: query i of T sees keys 0 .. L - T + i (L == T for a fresh cache, more
// for a chunked prefill's later chunks).
//
// q [B, Hq, T, D] float32; k, v [B, Hkv, L, D] float32 or float16; innermost dimension contiguous, the rest
// strided (slices of the cache's buffers). out [B, Hq, T, D], laid out [B, T, Hq, D] (what the output projection
// reads next). Query head h reads KV head h / (Hq / Hkv).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "attend.h"
#include "kernels_simd.h"
#include "ops.h"

namespace {

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const attnlab::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// e^x for x <= 0: attnlab_simd::exp_neg, 16 lanes, 2^n by scalef.
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(attnlab_simd::kExp2[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(attnlab_simd::kExp2[i]));
  return _mm512_scalef_ps(p, n);
}

constexpr int kRows = 16;  // query rows per item

// The exact softmax of one row's n scores s times k, handed 16 at a time to put(t, e) (then zeros from n up to
// `upto`, a multiple of 16); returns 1 / the sum. s may be written by put (each piece is read first).
template <class Put>
inline float softmax_row(const float* s, int64_t n, int64_t upto, float k, Put put) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - t)) - 1);
  mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), kv = _mm512_set1_ps(k);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp_neg(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), m), kv));
    put(t, e), sum = _mm512_add_ps(sum, e);
  }
  const __m512 e = _mm512_maskz_mov_ps(tail, exp_neg(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), m), kv)));
  put(t, e), sum = _mm512_add_ps(sum, e);
  for (t += 16; t < upto; t += 16) put(t, _mm512_setzero_ps());
  return 1.f / _mm512_reduce_add_ps(sum);
}

// S[r][16 kb ..] = scale * q_r . key 16 kb + t for the 16 rows of Q ([16][D], contiguous), key blocks kb < nb.
inline void scores(const float* Q, const float* Kt, int64_t D, int64_t nb, float scale, float* S, int64_t ls) {
  for (int64_t kb = 0; kb < nb; ++kb) {
    const float* kt = Kt + kb * D * 16;
    __m512 acc[kRows];
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 kv = _mm512_load_ps(kt + d * 16);
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(Q[r * D + d]), kv, acc[r]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(S + r * ls + 16 * kb, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
  }
}

// Rows o_r = inv_r * sum_t P[r][t] V[t] for the R = 16 / J rows at P (zeros past a row's keys), t < n, J chunks
// of 16 dimensions; the first `keep` rows stored.
template <int J, class T>
inline void weigh(const float* P, int64_t ls, const T* V, int64_t sv, int64_t n, int keep, float* O, int64_t so,
                  const float* inv) {
  constexpr int R = 16 / J;
  __m512 acc[R][J];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m512 vv[J];
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) vv[j] = load16(V + t * sv + 16 * j);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(P[r * ls + t]);
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_fmadd_ps(p, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < keep; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(O + r * so + 16 * j, _mm512_mul_ps(acc[r][j], _mm512_set1_ps(inv[r])));
}

template <int J, class T>
void causal(const attnlab::View& q, const attnlab::View& k, const attnlab::View& v, double scale, const attnlab::View& out) {
  const int64_t B = q.size(0), Hq = q.size(1), T_ = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  const int64_t G = Hq / Hkv, nq = (T_ + kRows - 1) / kRows, NB = (L + 15) / 16;
  const T *K = k.data_ptr<T>(), *Vp = v.data_ptr<T>();
  const float* Qp = q.data_ptr<float>();
  float* Op = out.data_ptr<float>();
  // keys transposed per KV head, 16 at a time: Kt[b][h][kb][d][16] (keys past L zero)
  // and the values as float32 rows, Vf[b][h][t][D]
  attnlab::Buf<float> kt(B * Hkv * NB * D * 16);
  attnlab::Buf<float> vf(B * Hkv * L * D);
  float *Kt = kt.data(), *Vf = vf.data();
  attnlab::parallel_for(0, B * Hkv * NB, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (Hkv * NB), h = i / NB % Hkv, kb = i % NB;
      float* dst = Kt + i * D * 16;
      for (int64_t t = 0; t < 16 && 16 * kb + t < L; ++t) {
        const T* src = K + b * k.stride(0) + h * k.stride(1) + (16 * kb + t) * k.stride(2);
        const T* vs = Vp + b * v.stride(0) + h * v.stride(1) + (16 * kb + t) * v.stride(2);
        float* vd = Vf + ((b * Hkv + h) * L + 16 * kb + t) * D;
        for (int64_t d = 0; d < D; ++d) dst[d * 16 + t] = static_cast<float>(src[d]);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(vd + d, load16(vs + d));
      }
    }
  });
  // items (b, head, query block), query blocks long and short alternately (attnlab::parallel_for hands each thread
  // an equal stretch of items; causal blocks grow with their position)
  const int64_t items = B * Hq * nq;
  attnlab::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    const int64_t ls = NB * 16 + 16;
    attnlab::Buf<float> buf(kRows * ls), qbuf(kRows * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (Hq * nq), h = i / nq % Hq, j = i % nq;
      const int64_t qb = j % 2 ? nq - 1 - j / 2 : j / 2;  // 0, n-1, 1, n-2, ...
      const int64_t t0 = qb * kRows, mq = std::min<int64_t>(kRows, T_ - t0), hk = h / G;
      const float* Q = Qp + b * q.stride(0) + h * q.stride(1) + t0 * q.stride(2);
      int64_t n[kRows];
      for (int r = 0; r < kRows; ++r) n[r] = r < mq ? L - T_ + t0 + r + 1 : 0;
      const int64_t nb = (n[mq - 1] + 15) / 16;
      for (int r = 0; r < kRows; ++r)  // the rows packed, zeros past the last
        for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = r < mq ? Q[r * q.stride(2) + d] : 0.f;
      float* S = buf.data();
      scores(qbuf.data(), Kt + (b * Hkv + hk) * NB * D * 16, D, nb, static_cast<float>(scale), S, ls);
      for (int64_t r = mq; r < kRows; ++r) std::fill(S + r * ls, S + r * ls + nb * 16, 0.f);
      float inv[kRows] = {};
      for (int r = 0; r < mq; ++r) {  // row r over its n[r] keys, in place; zeros after them
        float* s = S + r * ls;
        inv[r] = softmax_row(s, n[r], nb * 16, 1.f, [&](int64_t t, __m512 e) { _mm512_storeu_ps(s + t, e); });
      }
      const float* V = Vf + (b * Hkv + hk) * L * D;
      float* O = Op + b * out.stride(0) + h * out.stride(1) + t0 * out.stride(2);
      constexpr int R = 16 / J;
      for (int r = 0; r < mq; r += R)  // a pass runs to its last row's keys: P is zero past each row's own
        weigh<J>(S + r * ls, ls, V, D, n[std::min<int64_t>(r + R, mq) - 1],
                 static_cast<int>(std::min<int64_t>(R, mq - r)), O + r * out.stride(2), out.stride(2), inv + r);
    }
  });
}
#endif

#if defined(__AMX_BF16__) && defined(__AVX512F__)
// With AMX: the same item, its two products on bfloat16 tiles (tdpbf16ps, float32 sums), each operand split
// into a high and a low bfloat16 (x = hi + lo, lo = x - hi exactly) and three products summed (hi hi + hi lo +
// lo hi; the lo lo term, 2^-16 of the product, dropped). A float16 key or value is exactly hi + lo (11 bits of
// significand), a float32 query or probability to 16 bits, so the scores carry ~1e-5 relative error, not
// bfloat16's 4e-3 (whose cost is above).
namespace tiles {

// 16 floats -> 16 high and 16 low bfloat16
inline void split16(__m512 x, uint16_t* hi, uint16_t* lo) {
  auto round = [](__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                                  _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))), 16);
  };
  const __m512i h = round(x);
  const __m512i l = round(_mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16))));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), _mm512_cvtepi32_epi16(h));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), _mm512_cvtepi32_epi16(l));
}

struct alignas(64) Config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
inline void configure() {  // eight tiles of 16 rows x 64 bytes: 0-3 sums, 4-5 A (hi, lo), 6-7 B (hi, lo)
  Config c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  asm volatile("" : : "r"(&c) : "memory");  // GCC 12 drops the stores otherwise (see repacked.cpp)
  _tile_loadconfig(&c);
}

// C += A_hi B_hi + A_hi B_lo + A_lo B_hi, tile numbers literal (GCC pastes them into the instruction)
#define ATTNLAB_DP3(C)         \
  do {                         \
    _tile_dpbf16ps(C, 4, 6);   \
    _tile_dpbf16ps(C, 4, 7);   \
    _tile_dpbf16ps(C, 5, 6);   \
  } while (0)

template <class T>
void causal(const attnlab::View& q, const attnlab::View& k, const attnlab::View& v, double scale, const attnlab::View& out) {
  const int64_t B = q.size(0), Hq = q.size(1), T_ = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  const int64_t G = Hq / Hkv, nq = (T_ + kRows - 1) / kRows, NC = (L + 31) / 32, DC = D / 32, DJ = D / 16;
  const T *K = k.data_ptr<T>(), *Vp = v.data_ptr<T>();
  const float* Qp = q.data_ptr<float>();
  float* Op = out.data_ptr<float>();
  // keys as B tiles per (16-key block, 32 dims): [pair p][key t][2] = K[t][32 c + 2p ..]; values per (32-key
  // chunk, 16 dims): [pair p][dim n][2] = V[2p ..][16 j + n]; high and low halves, zeros past L
  const int64_t kblk = 2 * NC * DC * 512, vblk = NC * DJ * 512;  // uint16 per KV head
  attnlab::Buf<uint16_t> packed(B * Hkv * 2 * (kblk + vblk));
  uint16_t* P0 = packed.data();
  const int64_t per = 2 * (kblk + vblk);
  attnlab::parallel_for(0, B * Hkv * NC, 4, [&](int64_t i0, int64_t i1) {
    alignas(64) uint16_t hi[2][16], lo[2][16];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bh = i / NC, kc = i % NC, b = bh / Hkv, h = bh % Hkv;
      uint16_t *Kh = P0 + bh * per, *Kl = Kh + kblk, *Vh = Kl + kblk, *Vl = Vh + vblk;
      for (int64_t t = 32 * kc; t < std::min(L, 32 * kc + 32); t += 2) {  // a pair of keys (the second may be past L)
        const bool two = t + 1 < L;
        for (int e = 0; e < 2; ++e) {
          if (e && !two) break;
          const T* kr = K + b * k.stride(0) + h * k.stride(1) + (t + e) * k.stride(2);
          for (int64_t d = 0; d < D; d += 16) {  // 8 dimension pairs of key t + e, each a 32-bit word of its tile row
            split16(load16(kr + d), hi[0], lo[0]);
            const int64_t o = (((t + e) / 16 * DC + d / 32) * 16 + d % 32 / 2) * 32 + (t + e) % 16 * 2;
            for (int pp = 0; pp < 8; ++pp) {
              std::memcpy(Kh + o + pp * 32, hi[0] + 2 * pp, 4);
              std::memcpy(Kl + o + pp * 32, lo[0] + 2 * pp, 4);
            }
          }
        }
        const T* v0 = Vp + b * v.stride(0) + h * v.stride(1) + t * v.stride(2);
        for (int64_t d = 0; d < D; d += 16) {  // tile row t / 2 of dims d..d+15: (V[t][n], V[t + 1][n]) pairs
          split16(load16(v0 + d), hi[0], lo[0]);
          if (two) split16(load16(v0 + v.stride(2) + d), hi[1], lo[1]);
          else std::memset(hi[1], 0, 32), std::memset(lo[1], 0, 32);
          const int64_t o = ((kc * DJ + d / 16) * 16 + t % 32 / 2) * 32;
          auto pair = [](const uint16_t* a, const uint16_t* c) {
            const __m512i x = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(a)));
            const __m512i y = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(c)));
            return _mm512_or_si512(x, _mm512_slli_epi32(y, 16));
          };
          _mm512_storeu_si512(Vh + o, pair(hi[0], hi[1]));
          _mm512_storeu_si512(Vl + o, pair(lo[0], lo[1]));
        }
      }
    }
  });
  const int64_t items = B * Hq * nq;
  attnlab::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    const int64_t ls = NC * 32 + 16;  // keys per row of S and P, and room for a row's last 16 past its end
    attnlab::Buf<float> S(kRows * ls), tmp(kRows * 64);
    attnlab::Buf<uint16_t> qh(kRows * D), ql(kRows * D), ph(kRows * ls), pl(kRows * ls);
    configure();
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (Hq * nq), h = i / nq % Hq, j = i % nq;
      const int64_t qb = j % 2 ? nq - 1 - j / 2 : j / 2;  // 0, n-1, 1, n-2, ... (see the float32 path)
      const int64_t t0 = qb * kRows, mq = std::min<int64_t>(kRows, T_ - t0), hk = h / G;
      const uint16_t *Kh = P0 + (b * Hkv + hk) * per, *Kl = Kh + kblk, *Vh = Kl + kblk, *Vl = Vh + vblk;
      const float* Q = Qp + b * q.stride(0) + h * q.stride(1) + t0 * q.stride(2);
      int64_t n[kRows];
      for (int r = 0; r < kRows; ++r) n[r] = r < mq ? L - T_ + t0 + r + 1 : 0;
      const int64_t nc = (n[mq - 1] + 31) / 32;
      for (int r = 0; r < kRows; ++r)
        for (int64_t d = 0; d < D; d += 16)
          split16(r < mq ? _mm512_loadu_ps(Q + r * q.stride(2) + d) : _mm512_setzero_ps(), qh.data() + r * D + d,
                  ql.data() + r * D + d);
      for (int64_t kb = 0; kb < 2 * nc; ++kb) {  // scores, 16 keys at a time
        _tile_zero(0);
        for (int64_t c = 0; c < DC; ++c) {
          _tile_loadd(4, qh.data() + 32 * c, D * 2);
          _tile_loadd(5, ql.data() + 32 * c, D * 2);
          _tile_loadd(6, Kh + (kb * DC + c) * 512, 64);
          _tile_loadd(7, Kl + (kb * DC + c) * 512, 64);
          ATTNLAB_DP3(0);
        }
        _tile_stored(0, S.data() + 16 * kb, ls * 4);
      }
      float inv[kRows] = {};
      for (int r = 0; r < kRows; ++r) {  // row r over its n[r] keys, split into ph, pl; zeros after them
        uint16_t *hi = ph.data() + r * ls, *lo = pl.data() + r * ls;
        auto put = [&](int64_t t, __m512 e) { split16(e, hi + t, lo + t); };
        if (r < mq) inv[r] = softmax_row(S.data() + r * ls, n[r], nc * 32, static_cast<float>(scale), put);
        else for (int64_t t = 0; t < nc * 32; t += 16) put(t, _mm512_setzero_ps());
      }
      float* O = Op + b * out.stride(0) + h * out.stride(1) + t0 * out.stride(2);
      for (int64_t d0 = 0; d0 < D; d0 += 64) {  // values: 64 dimensions (four sum tiles) at a time
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t kc = 0; kc < nc; ++kc) {
          _tile_loadd(4, ph.data() + 32 * kc, ls * 2);
          _tile_loadd(5, pl.data() + 32 * kc, ls * 2);
          const int64_t o = (kc * DJ + d0 / 16) * 512;
          _tile_loadd(6, Vh + o, 64); _tile_loadd(7, Vl + o, 64); ATTNLAB_DP3(0);
          _tile_loadd(6, Vh + o + 512, 64); _tile_loadd(7, Vl + o + 512, 64); ATTNLAB_DP3(1);
          _tile_loadd(6, Vh + o + 1024, 64); _tile_loadd(7, Vl + o + 1024, 64); ATTNLAB_DP3(2);
          _tile_loadd(6, Vh + o + 1536, 64); _tile_loadd(7, Vl + o + 1536, 64); ATTNLAB_DP3(3);
        }
        _tile_stored(0, tmp.data(), 256); _tile_stored(1, tmp.data() + 16, 256);
        _tile_stored(2, tmp.data() + 32, 256); _tile_stored(3, tmp.data() + 48, 256);
        for (int r = 0; r < mq; ++r)
          for (int jj = 0; jj < 4; ++jj)
            _mm512_storeu_ps(O + r * out.stride(2) + d0 + 16 * jj,
                             _mm512_mul_ps(_mm512_loadu_ps(tmp.data() + r * 64 + 16 * jj), _mm512_set1_ps(inv[r])));
      }
    }
    _tile_release();
  });
}
#undef ATTNLAB_DP3

}  // namespace tiles
#endif

}  // namespace

// q [B, Hq, T, D] -> out [B, Hq, T, D], stored as [B, T, Hq, D] (the layout the output projection reads)
attnlab::View attnlab::causal_attention(const Alloc& alloc, const View& q, const View& k, const View& v, double scale) {
#ifdef __AVX512F__
  ATTNLAB_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == attnlab::kFloat,
              "causal_attention: q [B, Hq, T, D] float32, k and v [B, Hkv, L, D]");
  const int64_t B = q.size(0), Hq = q.size(1), T_ = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  ATTNLAB_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && Hkv > 0 && Hq % Hkv == 0 && L >= T_ && T_ > 0,
              "causal_attention: k and v [B, Hkv, L >= T, D] with Hq a multiple of Hkv");
  ATTNLAB_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == attnlab::kFloat || k.scalar_type() == attnlab::kHalf),
              "causal_attention: k and v float32 or float16");
  ATTNLAB_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "causal_attention: innermost dimension contiguous");
  View out = alloc({B, T_, Hq, D}, attnlab::kFloat);
  std::swap(out.sz[1], out.sz[2]), std::swap(out.st[1], out.st[2]), out.contig = false;  // .transpose(1, 2)
  const bool half = k.scalar_type() == attnlab::kHalf;
#if defined(__AMX_BF16__)
  if (D % 64 == 0 && attnlab_simd::amx_granted()) {
    half ? tiles::causal<attnlab::Half>(q, k, v, scale, out) : tiles::causal<float>(q, k, v, scale, out);
    return out;
  }
#endif
  switch (D) {
    case 32: half ? causal<2, attnlab::Half>(q, k, v, scale, out) : causal<2, float>(q, k, v, scale, out); break;
    case 64: half ? causal<4, attnlab::Half>(q, k, v, scale, out) : causal<4, float>(q, k, v, scale, out); break;
    case 128: half ? causal<8, attnlab::Half>(q, k, v, scale, out) : causal<8, float>(q, k, v, scale, out); break;
    default: ATTNLAB_CHECK(false, "causal_attention: head dim 32, 64 or 128, got ", D);
  }
  return out;
#else
  // Without AVX-512: each query row as a decode step attends (attend.h's stretch over keys 0 .. L - T + t), so a
  // row's bits do not depend on the chunk it came in (torch's attention, here before, blocked by the chunk's length:
  // a prompt fed whole or 8 tokens at a time differed by up to 0.9 in a logit on SmolLM2).
  ATTNLAB_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == attnlab::kFloat,
                "causal_attention: q [B, Hq, T, D] float32, k and v [B, Hkv, L, D]");
  const int64_t B = q.size(0), Hq = q.size(1), T_ = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  ATTNLAB_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && Hkv > 0 && Hq % Hkv == 0 && L >= T_ &&
                T_ > 0 && D % 8 == 0, "causal_attention: k and v [B, Hkv, L >= T, D] with Hq a multiple of Hkv");
  ATTNLAB_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == attnlab::kFloat || k.scalar_type() == attnlab::kHalf),
                "causal_attention: k and v float32 or float16");
  ATTNLAB_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && k.stride(1) == v.stride(1) &&
                k.stride(2) == v.stride(2), "causal_attention: innermost dimension contiguous, k and v alike");
  View out = alloc({B, T_, Hq, D}, attnlab::kFloat);
  const int64_t esz = k.elem_size();
  attnlab::parallel_for(0, B * T_, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qr(Hq * D), lse(Hq);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / T_, t = i % T_;
      for (int64_t h = 0; h < Hq; ++h)
        std::memcpy(qr.data() + h * D, q.data_ptr<float>() + b * q.stride(0) + h * q.stride(1) + t * q.stride(2),
                    D * sizeof(float));
      const attnlab_attend::Cache c{static_cast<const char*>(k.data_ptr()) + b * k.stride(0) * esz,
                                    static_cast<const char*>(v.data_ptr()) + b * v.stride(0) * esz, nullptr, nullptr,
                                    k.stride(2), k.stride(1), 0, 0, k.scalar_type() == attnlab::kHalf ? 1 : 0};
      attnlab_attend::stretch(qr.data(), c, Hkv, Hq / Hkv, D, 0, L - T_ + t + 1, static_cast<float>(scale),
                              out.data_ptr<float>() + (b * T_ + t) * Hq * D, lse.data());
    }
  });
  std::swap(out.sz[1], out.sz[2]), std::swap(out.st[1], out.st[2]), out.contig = false;  // .transpose(1, 2)
  return out;
#endif
}

