// AMX tiles of the repacked matvecs (variants built with -mamx-int8 only: ATTNLAB_TILES).
#pragma once
#include "repacked_isa.h"

#if ATTNLAB_TILES
namespace {
// ---- AMX tiles, for inputs of 16 activation rows and more (prefill). A tile multiply (`tdpbsud`) takes 16
// activation rows x 32 inputs (int8) times 32 inputs x 16 weight rows (uint8, four inputs per 32-bit lane: the
// chunk order of the repacked layouts, so Q8 blocks load as they lie and Q4 codes need only their nibbles split)
// into 16 x 16 int32 sums: one instruction for what takes the vector path 16 x 8 `vpdpbusd`. The sums are the same
// integers, and the float work after them (scale, order of the fused multiply-adds) is the vector path's per row,
// so the outputs are its bits. Tiles need the OS's grant per process (Linux >= 5.16) and a configuration per thread.
namespace amx {
constexpr int64_t kRows = 16;  // activation rows per tile; a remainder below 16 rows takes the vector path

using attnlab_simd::amx_granted;

struct alignas(64) Config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-1: sums (16 x 16 int32); 2-3: activations (16 rows x 32 int8); 4-5: weights (8 x 64 bytes).
inline void configure() {
  Config c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = 16, c.colsb[t] = 64;
    c.rows[2 + t] = 16, c.colsb[2 + t] = 32;
    c.rows[4 + t] = 8, c.colsb[4 + t] = 64;
  }
  // GCC 12 deletes the stores above without this (it does not see ldtilecfg read them): llama.cpp's AMX build
  // loads a configuration of garbage and dies on it
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// A 16-row block's weights as tiles, made once per block and read by every 16 activation rows: wt[u] the
// weight tile of 32-input block u (512 bytes), sc[u] its 16 rows' float32 scales, mn[v] the min vector of
// min term v (per group, or per block for Q4_K; the scale for Q4_0's -8 * scale). Per-thread buffers.
struct Block {
  uint8_t* wt;
  float *sc, *mn;
  explicit Block(int64_t U) {
    thread_local std::vector<uint8_t> buf;
    if (static_cast<int64_t>(buf.size()) < U * 640) buf.resize(U * 640);
    wt = buf.data(), sc = reinterpret_cast<float*>(buf.data() + U * 512), mn = sc + 16 * U;
  }
};

// One 32-input block of Q4 codes (4 chunks of 64 bytes: low nibbles inputs 4j.., high ones 16 + 4j..) as a
// weight tile: rows 0-3 the low nibbles of chunks 0-3, rows 4-7 the high ones.
inline void unpack_q4(const uint8_t* c, uint8_t* t) {
  const __m512i m = _mm512_set1_epi8(15);
  for (int j = 0; j < 4; ++j) {
    const __m512i w = _mm512_loadu_si512(c + 64 * j);
    _mm512_storeu_si512(t + 64 * j, _mm512_and_si512(w, m));
    _mm512_storeu_si512(t + 256 + 64 * j, _mm512_and_si512(_mm512_srli_epi16(w, 4), m));
  }
}

// o[16 r + n] for activation rows m0 + r: the sum over 32-input blocks u of
// float(dot_u[r][n] - c) * (sc[u][n] * d[m0 + r][u]), c = 128 x the block's activation sum with Corr (weights
// stored + 128), one fused multiply-add per block in order u. Two tile sets alternate so that one multiply
// runs while the other's sums are scaled; the 16 accumulators stay in registers (loops over r unrolled: as
// a loop, GCC kept them on the stack, 7% slower).
template <bool Corr>
inline void tile_sums(const Acts& a, int64_t K, int64_t m0, const Block& w, float* o) {
  const int64_t U = K / 32;
  const int8_t* xa = a.q + m0 * K;
  alignas(64) int32_t c[2][256];
  __m512 acc[16];  // in registers: every loop over r is unrolled
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  auto add = [&](const int32_t* sums, int64_t u) __attribute__((always_inline)) {
    const __m512 s = _mm512_loadu_ps(w.sc + 16 * u);
    const float* d = a.d + m0 * U + u;
    const int32_t* q16 = a.qs16 + m0 * 2 * U + 2 * u;
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      __m512i t = _mm512_load_si512(sums + 16 * r);
      if constexpr (Corr) t = _mm512_sub_epi32(t, _mm512_set1_epi32(128 * (q16[r * 2 * U] + q16[r * 2 * U + 1])));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(s, _mm512_set1_ps(d[r * U])), acc[r]);
    }
  };
  // GCC's tile intrinsics paste their tile numbers into the instruction text: literals only
#define ATTNLAB_ISSUE(C, A, B, u)                                                         \
  do {                                                                                    \
    _tile_zero(C);                                                                        \
    _tile_loadd(A, xa + (u) * 32, K);                                                     \
    _tile_loadd(B, w.wt + (u) * 512, 64);                                                 \
    _tile_dpbsud(C, A, B);                                                                \
  } while (0)
  // block u's sums are stored while u + 1 multiplies and scaled after the next store: a load right behind a
  // tile store waits for it to reach the cache (scaling at once measured 15% slower)
  ATTNLAB_ISSUE(0, 2, 4, 0);
  for (int64_t u = 0; u < U; u += 2) {
    if (u + 1 < U) ATTNLAB_ISSUE(1, 3, 5, u + 1);
    _tile_stored(0, c[0], 64);
    if (u > 0) add(c[1], u - 1);
    if (u + 1 < U) {
      if (u + 2 < U) ATTNLAB_ISSUE(0, 2, 4, u + 2);
      _tile_stored(1, c[1], 64);
      add(c[0], u);
    }
  }
  add(c[(U - 1) % 2], U - 1);
#undef ATTNLAB_ISSUE
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) _mm512_store_ps(o + 16 * r, acc[r]);
}

// o[16 r ..] = fmadd(1, o[16 r ..], accm_r), the vector path's last step, with accm_r = sum over min terms v
// in order of fmadd(mn[v], k * fs[m0 + r][v]): its sums, the 16 rows' chains side by side (one row at a time,
// the chain's latency cost as much as the tiles).
inline void add_mins(const Block& w, const float* fs, int64_t V, float k, int64_t m0, float* o) {
  __m512 accm[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) accm[r] = _mm512_setzero_ps();
  const float* f = fs + m0 * V;
  for (int64_t v = 0; v < V; ++v) {
    const __m512 mv = _mm512_loadu_ps(w.mn + 16 * v);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) accm[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(k * f[r * V + v]), accm[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r)
    _mm512_store_ps(o + 16 * r, _mm512_fmadd_ps(_mm512_set1_ps(1.f), _mm512_load_ps(o + 16 * r), accm[r]));
}
}  // namespace amx
}  // namespace
#endif
