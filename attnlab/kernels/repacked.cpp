// Matvecs over weights repacked into 16-row blocks (the layout of `attnlab.kernels.repack`), for decode.
//
// Why a second layout: with one row per stream, a 512-bit register holds 64 weights of ONE row, and the
// row's sum ends in a horizontal add per row. Interleaving 16 rows so that each 32-bit lane holds 4
// consecutive inputs of one row lets one `vpdpbusd` (AVX-512 VNNI) multiply 16 rows by the same 4
// activations (a broadcast), accumulating 16 row sums side by side: no horizontal adds, one weight
// stream per block, scales loaded as one vector. llama.cpp repacks Q4 weights the same way.
//
// Layout of one (16-row block, group of `group` inputs), bytes:
//   q4 (w = c * s + m): per 32-input block, 4 chunks j of 64 bytes: lane r's byte t holds code
//       c[r][32b + 4j + t] in its low nibble and c[r][32b + 16 + 4j + t] in its high one;
//       then s[16] and m[16]; with SYM no m (m = -8 s for the whole layer: GGUF Q4_0).
//   q8 (w = q * s [+ m]): group/4 chunks of 64 bytes: lane r's byte t = q[r][4c + t] + 128 (unsigned,
//       as vpdpbusd wants: sum (q + 128) x = sum q x + 128 sum x, the last term removed per sub-block);
//       then s[16] and, with a min, m[16].
//   s and m are float16 with HALF (the layer's values all exact in fp16: the GGUF files' own scales),
//   float32 otherwise. Why: the matvec is bound by the bytes it reads; Q4_0 at group 32 goes from 24
//   bytes per 32 weights (f32 s + m) to llama.cpp's 18, Q4_1 to 20, Q8_0 from 36 to 34.
//   q4 with KQ (GGUF Q4_K, groups of 32 in superblocks of 256 inputs): per superblock, the 8 sub-blocks'
//       codes as above (2048 bytes), uint8 sc[8][16] and m[8][16] (0..63), float16 d[16] and dmin[16]:
//       s = sc * d and m = -(m * dmin) per sub-block, the float32 products the loader makes, so the sums
//       are the bits of the float32 layout at 4.625 bits per weight instead of 6.
//   q8 with KQ (GGUF Q6_K, codes -32..31 in groups of 16): per superblock of 256 inputs, per 32-input block,
//       the codes c = q + 32 (0..63): their low 4 bits as q4 chunks (256 bytes), then their bits 4-5, one
//       64-byte chunk per chunk pair (2p, 2p + 1): lane r's byte t holds those of inputs 8p + t, 16 + 8p + t,
//       8p + 4 + t, 20 + 8p + t in bits 0-1, 2-3, 4-5, 6-7 (so each code is rebuilt by one shift and one
//       mask); then int8 sc[16][16] (per 16 inputs) and float16 d[16]: s = sc * d, the file's 6.5625 bits.
//       Unsigned codes for vpdpbusd: sum c x = sum q x + 32 sum x, the last term removed as q8's 128 sum x.
// Activations are rounded to int8 per 32 (as every integer kernel here); the min terms use the sums of
// the rounded values per group, as q4_mm does. Code paths by compile flags: AVX-512 (with VNNI: dpbusd; without:
// maddubs/madd), AVX2 (two 8-row halves per block; AVX-VNNI's dpbusd when built with it).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <sys/mman.h>

#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AMX_INT8__) && defined(__AVX512F__)
#define ATTNLAB_TILES 1
#endif

#include "kernels_simd.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct V {  // 16 rows per step
  using I = __m512i;
  using F = __m512;
  static constexpr int R = 16;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I bcast(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
  static I lo4(I w) { return _mm512_and_si512(w, _mm512_set1_epi8(15)); }
  static I hi4(I w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(15)); }
  static I zero() { return _mm512_setzero_si512(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub1(I a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  template <int k>  // bits 4 - k and 5 - k of each byte moved to bits 4-5, the rest cleared
  static I top2(I w) {
    if constexpr (k > 0) w = _mm512_slli_epi16(w, k);
    if constexpr (k < 0) w = _mm512_srli_epi16(w, -k);
    return _mm512_and_si512(w, _mm512_set1_epi8(0x30));
  }
#if defined(__AVX512VNNI__)
  static I dp7(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I dp8(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
  static I dp7(I acc, I u, I s) {  // u <= 127: maddubs cannot saturate
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
  }
  static I dp8(I acc, I u, I s) {  // any u8: even and odd bytes widened to int16
    const I ue = _mm512_and_si512(u, _mm512_set1_epi16(0xFF)), uo = _mm512_srli_epi16(u, 8);
    const I se = _mm512_srai_epi16(_mm512_slli_epi16(s, 8), 8), so = _mm512_srai_epi16(s, 8);
    return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(ue, se), _mm512_madd_epi16(uo, so)));
  }
#endif
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F loadu8(const uint8_t* p) { return cvt(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static F loadi8(const uint8_t* p) { return cvt(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F loadh(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* o, F v) { _mm512_storeu_ps(o, v); }
};
#else
struct V {  // 8 rows per step: a 16-row block in two halves
  using I = __m256i;
  using F = __m256;
  static constexpr int R = 8;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I bcast(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
  static I lo4(I w) { return _mm256_and_si256(w, _mm256_set1_epi8(15)); }
  static I hi4(I w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(15)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub1(I a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  template <int k>
  static I top2(I w) {
    if constexpr (k > 0) w = _mm256_slli_epi16(w, k);
    if constexpr (k < 0) w = _mm256_srli_epi16(w, -k);
    return _mm256_and_si256(w, _mm256_set1_epi8(0x30));
  }
#if defined(__AVXVNNI__)
  static I dp7(I acc, I u, I s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
  static I dp8(I acc, I u, I s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
  static I dp7(I acc, I u, I s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static I dp8(I acc, I u, I s) {
    const I ue = _mm256_and_si256(u, _mm256_set1_epi16(0xFF)), uo = _mm256_srli_epi16(u, 8);
    const I se = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), so = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ue, se), _mm256_madd_epi16(uo, so)));
  }
#endif
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F loadu8(const uint8_t* p) { return cvt(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static F loadi8(const uint8_t* p) { return cvt(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F loadh(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* o, F v) { _mm256_storeu_ps(o, v); }
};
#endif

// x [M, K] rounded to int8 per 32 (q, d), with int sums of q per 16 (qs16) and sums of the rounded
// values per group (fs, [M, K/group]; group may be 16). Per-thread buffers, reused across calls.
struct Acts {
  const int8_t* q;
  const float *d, *fs;
  const int32_t* qs16;
  Acts(const float* x, int64_t M, int64_t K, int64_t group, bool sums) {
    thread_local std::vector<int8_t> qb;
    thread_local std::vector<float> db, fb;
    thread_local std::vector<int32_t> sb;
    if (static_cast<int64_t>(qb.size()) < M * K) qb.resize(M * K), sb.resize(M * K / 16);
    if (static_cast<int64_t>(db.size()) < M * K / 32) db.resize(M * K / 32);
    if (sums) fb.resize(M * K / group);
    int8_t* qp = qb.data();
    float *dp = db.data(), *fp = fb.data();
    int32_t* sp = sb.data();
    // row by row, each row's arithmetic the same however the rows are split (a 512-token prompt's rows on one
    // thread were 7% of a prefill at 2 threads)
    auto rows = [&](int64_t r0, int64_t r1) {
      attnlab_simd::quantize_rows(x + r0 * K, (r1 - r0) * K / 32, qp + r0 * K, dp + r0 * K / 32, nullptr);
      for (int64_t i = r0 * K / 16; i < r1 * K / 16; ++i) {  // sum of 16 int8: of (q + 128) as unsigned bytes, by psadbw
        const __m128i u = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + i * 16)),
                                        _mm_set1_epi8(static_cast<char>(0x80)));
        const __m128i s = _mm_sad_epu8(u, _mm_setzero_si128());
        sp[i] = _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 16 * 128;
      }
      if (!sums) return;
      // sums of the rounded values (see quantize_rows: why not of x); groups do not cross rows
      std::fill(fp + r0 * K / group, fp + r1 * K / group, 0.f);
      if (group >= 32)
        for (int64_t b = r0 * K / 32; b < r1 * K / 32; ++b) fp[b / (group / 32)] += dp[b] * static_cast<float>(sp[2 * b] + sp[2 * b + 1]);
      else
        for (int64_t i = r0 * K / 16; i < r1 * K / 16; ++i) fp[i / (group / 16)] += dp[i / 2] * static_cast<float>(sp[i]);
    };
    if (M >= 64) at::parallel_for(0, M, 32, rows); else rows(0, M);  // (inside a parallel region: inline)
    q = qp, d = dp, qs16 = sp, fs = sums ? fp : nullptr;
  }
};

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == K,
              "x must be contiguous float32 [M, K]");
}

#if ATTNLAB_TILES
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
#endif

struct NoTiles {};

// Activation rows a 16-row block is read for at once (AVX-512 only: the AVX2 path has half the registers): a
// batched decode step's B rows, a prompt's rows on the vector path. `rows(p, m, first, o)` writes rows m..m+3
// times the block at p into o[16 r ..], its codes loaded (and unpacked) once for the four; per row the operations
// of `blk` in the same order, so each row gets the bits it gets alone.
constexpr int64_t kRowsAtOnce = V::R == 16 ? 4 : 0;
constexpr int64_t kRowsBuf = kRowsAtOnce > 0 ? kRowsAtOnce : 1;  // array sizes
struct NoRows {};

// A thread's share of blocks from which run reads NS streams even beside a second reader: on the 1B-shaped
// Q4_0 file at 2 threads, four streams each 25.1 -> 29.7 tok/s (medians of 3 alternating processes); on
// SmolLM2, whose shares are 18-48 blocks and whose weights the host's cache partly holds, no change beyond
// noise (one earlier run: -11% with four streams in every share).
constexpr int64_t kTeamStreams = 32;
constexpr int64_t kStreamOut = 2 << 20;  // bytes of output from which run's tiles store around the caches

// out [M, N] from blocks of `stride` bytes per (16-row block, group): blk(h, p, m, o) writes the R
// rows of half h of the block at p times activation row m into o[0..R); blk(std::integral_constant<int, NS>, ..)
// does NS consecutive blocks in one pass (block s into o[16 s ..]): NS weight streams read side by side. With AMX
// granted and M >= 16, tiles(p, m0, o) writes activation rows m0..m0+15 times the block at p into o[16 x 16]
// instead (m0 = 0 first for each block: the call that may unpack it), the vector path taking the rows past the
// last whole tile.
void check_w(const torch::Tensor& w, int64_t NB, int64_t G, int64_t stride) {
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.is_contiguous() && w.numel() == NB * G * stride,
              "repacked weight must be contiguous uint8 [", NB, ", ", G, ", ", stride, "]");
}

template <int NS = 1, class Blk, class Tiles = NoTiles, class Rows = NoRows>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& w, int64_t N, int64_t G, int64_t stride, Blk blk,
                  Tiles tiles = {}, Rows rows = {}) {
  const int64_t M = x.size(0), NB = (N + 15) / 16;
  check_w(w, NB, G, stride);
  auto out = torch::empty({M, N}, x.options());
  float* O = out.data_ptr<float>();
  const uint8_t* W = w.data_ptr<uint8_t>();
#if ATTNLAB_TILES
  // An output past a core's L2 (2 MiB) goes around the caches: written a 64-byte piece per row and block, it was
  // read for ownership line by line, and the tiles waited on it. SmolLM2's w13 alone (512 x 3072 x 576):
  // 106 -> 212 G multiply-adds/s; a 512-token prefill 741 -> 879 tok/s at 1 thread, 1306 -> 1413 at 2 (medians
  // of 3 alternating processes, Xeon with AMX).
  const bool stream_out = M * N * 4 >= kStreamOut && N % 16 == 0;
#endif
  auto part = [&](int64_t b0, int64_t b1) {
    alignas(64) float tmp[16 * NS];
    int64_t mt = 0;  // rows done in tiles
#if ATTNLAB_TILES
    alignas(64) float tile[256];
    if constexpr (!std::is_same_v<Tiles, NoTiles>)
      if (M >= amx::kRows && amx::amx_granted()) mt = M / amx::kRows * amx::kRows, amx::configure();
    for (int64_t b = b0; b < b1 && mt; ++b) {
      const int64_t n = std::min<int64_t>(16, N - 16 * b);
      if constexpr (!std::is_same_v<Tiles, NoTiles>)
        for (int64_t m0 = 0; m0 < mt; m0 += amx::kRows) {
          tiles(W + b * G * stride, m0, tile);
          if (stream_out)
            for (int r = 0; r < 16; ++r) _mm512_stream_ps(O + (m0 + r) * N + 16 * b, _mm512_load_ps(tile + 16 * r));
          else
            for (int r = 0; r < 16; ++r) std::memcpy(O + (m0 + r) * N + 16 * b, tile + 16 * r, n * sizeof(float));
        }
    }
    if (mt) _tile_release();
    if (stream_out) _mm_sfence();  // the streamed rows reach memory before another thread reads them
#endif
    // NS blocks at a time where NS remain, when this thread is the only one reading weights (not a native step's
    // team, not a parallel_for) or its share is kTeamStreams blocks or more
#ifdef _OPENMP
    const bool alone = omp_in_parallel() ? omp_get_num_threads() == 1 : at::get_num_threads() == 1;
#else
    const bool alone = at::get_num_threads() == 1;
#endif
    if constexpr (kRowsAtOnce > 0 && !std::is_same_v<Rows, NoRows>)
      if (M - mt >= kRowsAtOnce) {  // a block's rows four at a time, then the rest one by one while it is in L1
        alignas(64) float four[16 * kRowsBuf];
        for (int64_t b = b0; b < b1; ++b) {
          const uint8_t* p = W + b * G * stride;
          const size_t bytes = std::min<int64_t>(16, N - 16 * b) * sizeof(float);
          int64_t m = mt;
          for (; m + kRowsAtOnce <= M; m += kRowsAtOnce) {
            rows(p, m, m == mt, four);
            for (int64_t r = 0; r < kRowsAtOnce; ++r) std::memcpy(O + (m + r) * N + 16 * b, four + 16 * r, bytes);
          }
          for (; m < M; ++m) {
            blk(std::integral_constant<int, 1>{}, 0, p, m, tmp);
            std::memcpy(O + m * N + 16 * b, tmp, bytes);
          }
        }
        mt = M;
      }
    for (int64_t b = b0; b < b1 && mt < M;) {
      const int64_t ns = (alone || b1 - b0 >= kTeamStreams) && b + NS <= b1 ? NS : 1;
      for (int64_t m = mt; m < M; ++m) {
        for (int h = 0; h < 16 / V::R; ++h)
          if (ns == NS) blk(std::integral_constant<int, NS>{}, h, W + b * G * stride, m, tmp + h * V::R);
          else blk(std::integral_constant<int, 1>{}, h, W + b * G * stride, m, tmp + h * V::R);
        for (int64_t s = 0; s < ns; ++s)
          std::memcpy(O + m * N + 16 * (b + s), tmp + 16 * s, std::min<int64_t>(16, N - 16 * (b + s)) * sizeof(float));
      }
      b += ns;
    }
  };
  if (at::get_num_threads() == 1) part(0, NB); else at::parallel_for(0, NB, 1, part);
  return out;
}

// silu(gate) * up [M, N / 2] for a weight whose rows are gate (N / 2) then up (an MLP's w13), as run's blocks:
// one thread takes gate block p and up block p + N / 32, each for every row into an [M x 16] scratch, and
// combines them with `attnlab_simd::silu_mul` (silu_mul_row's arithmetic: silu_mul after run gives the same
// bits). What it saves is the [M, N] output's trip through memory and back (SmolLM2's w13 in a 512-token prefill:
// 6 MiB written, read again, 3 MiB written). One weight stream per thread: for prompts, not matvecs.
template <class Blk, class Tiles = NoTiles, class Rows = NoRows>
torch::Tensor run_glu(const torch::Tensor& x, const torch::Tensor& w, int64_t N, int64_t G, int64_t stride, Blk blk,
                      Tiles tiles = {}, Rows rows = {}) {
  TORCH_CHECK(N % 32 == 0, "a gated matmul needs gate and up rows in whole 16-row blocks (N a multiple of 32)");
  const int64_t M = x.size(0), H = N / 2, NP = N / 32;
  check_w(w, 2 * NP, G, stride);
  auto out = torch::empty({M, H}, x.options());
  float* O = out.data_ptr<float>();
  const uint8_t* W = w.data_ptr<uint8_t>();
  const bool stream_out = M * H * 4 >= kStreamOut;
  auto part = [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < 32 * M + 16) buf.resize(32 * M + 16);
    float* gs = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
    float* us = gs + 16 * M;
    int64_t mt = 0;  // rows done in tiles
#if ATTNLAB_TILES
    if constexpr (!std::is_same_v<Tiles, NoTiles>)
      if (M >= amx::kRows && amx::amx_granted()) mt = M / amx::kRows * amx::kRows, amx::configure();
#endif
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t b : {p, p + NP}) {
        const uint8_t* pb = W + b * G * stride;
        float* s = b == p ? gs : us;
#if ATTNLAB_TILES
        if constexpr (!std::is_same_v<Tiles, NoTiles>)
          for (int64_t m0 = 0; m0 < mt; m0 += amx::kRows) tiles(pb, m0, s + 16 * m0);
#endif
        int64_t m = mt;
        if constexpr (kRowsAtOnce > 0 && !std::is_same_v<Rows, NoRows>)
          for (; m + kRowsAtOnce <= M; m += kRowsAtOnce) rows(pb, m, m == mt, s + 16 * m);
        for (; m < M; ++m)
          for (int h = 0; h < 16 / V::R; ++h) blk(std::integral_constant<int, 1>{}, h, pb, m, s + 16 * m + h * V::R);
      }
      for (int64_t m = 0; m < M; ++m) {
        float* o = O + m * H + 16 * p;
        const __m256 a0 = attnlab_simd::silu_mul(_mm256_load_ps(gs + 16 * m), _mm256_load_ps(us + 16 * m));
        const __m256 a1 = attnlab_simd::silu_mul(_mm256_load_ps(gs + 16 * m + 8), _mm256_load_ps(us + 16 * m + 8));
        if (stream_out) _mm256_stream_ps(o, a0), _mm256_stream_ps(o + 8, a1);
        else _mm256_storeu_ps(o, a0), _mm256_storeu_ps(o + 8, a1);
      }
    }
#if ATTNLAB_TILES
    if (mt) _tile_release();
#endif
    if (stream_out) _mm_sfence();
  };
  if (at::get_num_threads() == 1) part(0, NP); else at::parallel_for(0, NP, 1, part);
  return out;
}

constexpr int64_t HALF = 1, SYM = 2, KQ = 4;  // layout flags (`repack.HALF`, `repack.SYM`, `repack.KQ`)

// Ask for the group `kAhead` bytes past p (stride bytes) now: the matvec streams one block after another and
// the hardware prefetchers do not cross 4 KiB pages, so without it each new page starts with misses. Where to
// depends on the CPU (decode tok/s, weights from DRAM): on an AMD EPYC (Zen 5) into L1, +9-24% on q4x and +35%
// on the q8x head at 1 thread (1 KiB ahead none, 12-16 KiB no better than 8); on an Intel Xeon (with AMX,
// a VM) into L1 it cost 20% at 1 thread, and into L2 was best: SmolLM2 Q4_1 at 2 threads 260 tok/s against
// 196 with 1 KiB into L1 and 209 with 8 KiB into L1 (medians of 3-4 interleaved processes). kAhead is the
// distance in all: NS streams read side by side ask kAhead / NS ahead each (1B Q4_0 on huge pages, four streams,
// 2 threads: 33.9 tok/s at 2 KiB each against 29.3 at 8 KiB; 1 thread 19.8 against 17.5).
constexpr int64_t kAhead = 8192;
template <int NS = 1>
inline void prefetch(const uint8_t* p, int64_t stride) {
  static const bool to_l2 = __builtin_cpu_is("intel");
  const char* q = reinterpret_cast<const char*>(p) + kAhead / NS;
  if (to_l2) for (int64_t o = 0; o < stride; o += 64) _mm_prefetch(q + o, _MM_HINT_T1);
  else for (int64_t o = 0; o < stride; o += 64) _mm_prefetch(q + o, _MM_HINT_T0);
}

// 16 per-row floats of half h at p: float16 (HALF) or float32.
template <bool H>
typename V::F scales(const uint8_t* p, int h) {
  if constexpr (H) return V::loadh(reinterpret_cast<const uint16_t*>(p) + h * V::R);
  else return V::loadf(reinterpret_cast<const float*>(p) + h * V::R);
}

// Calls f(std::integral_constant<bool, HALF>, std::integral_constant<bool, SYM>) for the layout flags.
template <class Fn>
torch::Tensor with_layout(int64_t fmt, Fn f) {
  using T = std::true_type;
  using U = std::false_type;
  TORCH_CHECK(fmt >= 0 && fmt <= (HALF | SYM), "repacked layout flags must be 0-3, got ", fmt);
  switch (fmt) {
    case 0: return f(U{}, U{});
    case HALF: return f(T{}, U{});
    case SYM: return f(U{}, T{});
    default: return f(T{}, T{});
  }
}

// Sum over one 32-input block of codes c (half h's lanes at c) times the int8 activations xb: R int32 row sums.
inline typename V::I q4dot(const uint8_t* c, const int8_t* xb) {
  typename V::I i0 = V::zero(), i1 = V::zero(), i2 = V::zero(), i3 = V::zero();
  typename V::I w0 = V::load(c), w1 = V::load(c + 64), w2 = V::load(c + 128), w3 = V::load(c + 192);
  i0 = V::dp7(i0, V::lo4(w0), V::bcast(xb)), i1 = V::dp7(i1, V::hi4(w0), V::bcast(xb + 16));
  i2 = V::dp7(i2, V::lo4(w1), V::bcast(xb + 4)), i3 = V::dp7(i3, V::hi4(w1), V::bcast(xb + 20));
  i0 = V::dp7(i0, V::lo4(w2), V::bcast(xb + 8)), i1 = V::dp7(i1, V::hi4(w2), V::bcast(xb + 24));
  i2 = V::dp7(i2, V::lo4(w3), V::bcast(xb + 12)), i3 = V::dp7(i3, V::hi4(w3), V::bcast(xb + 28));
  return V::add(V::add(i0, i1), V::add(i2, i3));
}

// q4dot for activation rows m..m+3 of a (K inputs) over 32-input block u, whose codes lie at c, unpacked once:
// the same integer sums (two chains a row instead of four; int32 addition is exact, so the same bits), each added
// to acc[r] as blk adds it: fmadd(sum, s * d, acc).
inline void q4dot_rows(const uint8_t* c, const Acts& a, int64_t m, int64_t K, int64_t u, typename V::F s,
                       typename V::F* acc) {
  const typename V::I w0 = V::load(c), w1 = V::load(c + 64), w2 = V::load(c + 128), w3 = V::load(c + 192);
  const typename V::I l0 = V::lo4(w0), h0 = V::hi4(w0), l1 = V::lo4(w1), h1 = V::hi4(w1);
  const typename V::I l2 = V::lo4(w2), h2 = V::hi4(w2), l3 = V::lo4(w3), h3 = V::hi4(w3);
#pragma GCC unroll 4
  for (int64_t r = 0; r < kRowsAtOnce; ++r) {
    const int8_t* x = a.q + (m + r) * K + u * 32;
    typename V::I i0 = V::dp7(V::zero(), l0, V::bcast(x)), i1 = V::dp7(V::zero(), h0, V::bcast(x + 16));
    i0 = V::dp7(i0, l1, V::bcast(x + 4)), i1 = V::dp7(i1, h1, V::bcast(x + 20));
    i0 = V::dp7(i0, l2, V::bcast(x + 8)), i1 = V::dp7(i1, h2, V::bcast(x + 24));
    i0 = V::dp7(i0, l3, V::bcast(x + 12)), i1 = V::dp7(i1, h3, V::bcast(x + 28));
    acc[r] = V::fmadd(V::cvt(V::add(i0, i1)), V::mul(s, V::set1(a.d[(m + r) * K / 32 + u])), acc[r]);
  }
}

// The frame of `rows` (see kRowsAtOnce): per group g body(g, p, acc, accm) with each row's accumulators, then
// o[16 r ..] = fmadd(1, acc[r], accm[r]), as over_blocks ends a row.
template <class Body>
inline void over_rows(const uint8_t* p, int64_t G, int64_t stride, bool first, float* o, Body body) {
  typename V::F acc[kRowsBuf], accm[kRowsBuf];
#pragma GCC unroll 4
  for (int64_t r = 0; r < kRowsAtOnce; ++r) acc[r] = V::zerof(), accm[r] = V::zerof();
  for (int64_t g = 0; g < G; ++g, p += stride) {
    if (first) prefetch(p, stride);
    body(g, p, acc, accm);
  }
#pragma GCC unroll 4
  for (int64_t r = 0; r < kRowsAtOnce; ++r) V::store(o + 16 * r, V::fmadd(V::set1(1.f), acc[r], accm[r]));
}

// Weight streams a matvec reads side by side (blocks in one pass, see run): on a Xeon (AMX, a VM) one core read
// 11.7 GB/s from one stream, 14.5 from four (interleaved 256-byte pieces; eight: 15.0, and no faster a matvec),
// and llama.cpp's Q4_0 matvec reads four 16-row tiles at once. AVX-512 only: the AVX2 path has half the registers
// for the accumulators.
constexpr int kStreams = V::R == 16 ? 4 : 1;

// The frame of a matvec over NS blocks side by side: per group g, per block s, body(g, p, acc[s], accm[s]) with p
// block s's group g (asked for kAhead ahead with `first`), then o[16 s ..] = fmadd(1, acc[s], accm[s]).
template <int NS, class Body>
inline void over_blocks(const uint8_t* p0, int64_t G, int64_t stride, bool first, float* o, Body body) {
  typename V::F acc[NS], accm[NS];
#pragma GCC unroll 4
  for (int s = 0; s < NS; ++s) acc[s] = V::zerof(), accm[s] = V::zerof();
  for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int s = 0; s < NS; ++s) {
      const uint8_t* p = p0 + (s * G + g) * stride;
      if (first) prefetch<NS>(p, stride);
      body(g, p, acc[s], accm[s]);
    }
  }
#pragma GCC unroll 4
  for (int s = 0; s < NS; ++s) V::store(o + 16 * s, V::fmadd(V::set1(1.f), acc[s], accm[s]));
}

template <bool H, bool S>
torch::Tensor q4x(const torch::Tensor& x, const torch::Tensor& w, int64_t N, int64_t group, bool glu) {
  const int64_t K = x.size(1);
  constexpr int64_t sb = H ? 32 : 64;  // bytes of 16 scales
  const int64_t G = K / group, per = group / 32, stride = per * 256 + sb * (S ? 1 : 2);
  const Acts a(x.data_ptr<float>(), x.size(0), K, group, true);
  auto blk = [&](auto ns, int h, const uint8_t* p0, int64_t m, float* o) {
    const int8_t* xq = a.q + m * K;
    const float* d = a.d + m * K / 32;
    const float* fs = a.fs + m * G;
    constexpr int NS = decltype(ns)::value;
    over_blocks<NS>(p0, G, stride, h == 0 && m == 0, o, [&](int64_t g, const uint8_t* p, auto& acc, auto& accm) {
      const typename V::F sc = scales<H>(p + per * 256, h);
      for (int64_t b = 0; b < per; ++b) {
        const typename V::I t = q4dot(p + b * 256 + h * V::R * 4, xq + (g * per + b) * 32);
        acc = V::fmadd(V::cvt(t), V::mul(sc, V::set1(d[g * per + b])), acc);
      }
      // m * sum(x): with SYM, s * (-8 sum(x)), the same float (scaling by 8 is exact)
      if constexpr (S) accm = V::fmadd(sc, V::set1(-8.f * fs[g]), accm);
      else accm = V::fmadd(scales<H>(p + per * 256 + sb, h), V::set1(fs[g]), accm);
    });
  };
  auto rows = [&](const uint8_t* p0, int64_t m, bool first, float* o) {
    over_rows(p0, G, stride, first, o, [&](int64_t g, const uint8_t* p, typename V::F* acc, typename V::F* accm) {
      const typename V::F sc = scales<H>(p + per * 256, 0);
      for (int64_t b = 0; b < per; ++b) {
        q4dot_rows(p + b * 256, a, m, K, g * per + b, sc, acc);
      }
#pragma GCC unroll 4
      for (int64_t r = 0; r < kRowsAtOnce; ++r) {
        const float f = a.fs[(m + r) * G + g];
        if constexpr (S) accm[r] = V::fmadd(sc, V::set1(-8.f * f), accm[r]);
        else accm[r] = V::fmadd(scales<H>(p + per * 256 + sb, 0), V::set1(f), accm[r]);
      }
    });
  };
#if ATTNLAB_TILES
  auto tiles = [&](const uint8_t* p, int64_t m0, float* o) {
    const amx::Block blk(K / 32);
    if (m0 == 0)
      for (int64_t u = 0; u < K / 32; ++u) {
        amx::unpack_q4(p + u / per * stride + u % per * 256, blk.wt + u * 512);
        V::store(blk.sc + 16 * u, scales<H>(p + u / per * stride + per * 256, 0));
        if (u % per == 0)  // m * sum(x); with SYM, s * (-8 sum(x))
          V::store(blk.mn + 16 * (u / per), scales<H>(p + u / per * stride + per * 256 + (S ? 0 : sb), 0));
      }
    amx::tile_sums<false>(a, K, m0, blk, o);
    amx::add_mins(blk, a.fs, G, S ? -8.f : 1.f, m0, o);
  };
  return glu ? run_glu(x, w, N, G, stride, blk, tiles, rows) : run<kStreams>(x, w, N, G, stride, blk, tiles, rows);
#else
  return glu ? run_glu(x, w, N, G, stride, blk, NoTiles{}, rows) : run<kStreams>(x, w, N, G, stride, blk, NoTiles{}, rows);
#endif
}

// Q4_K superblocks (KQ): q4x<false, false> at group 32, each sub-block's s and m made from the factors in
// the same float32 operations as the loader's (d * sc, -(dmin * m): negating the factor negates the product
// exactly), so the same sums in the same order give the same bits.
torch::Tensor q4k(const torch::Tensor& x, const torch::Tensor& w, int64_t N, bool glu) {
  const int64_t K = x.size(1), G = K / 256, stride = 2368;
  const Acts a(x.data_ptr<float>(), x.size(0), K, 32, true);
  auto blk = [&](auto, int h, const uint8_t* p, int64_t m, float* o) {
    const int8_t* xq = a.q + m * K;
    const float* d = a.d + m * K / 32;
    const float* fs = a.fs + m * K / 32;
    typename V::F acc = V::zerof(), accm = V::zerof();
    for (int64_t g = 0; g < G; ++g, p += stride) {
      if (h == 0 && m == 0) prefetch(p, stride);
      const typename V::F sd = scales<true>(p + 2304, h), md = V::mul(scales<true>(p + 2336, h), V::set1(-1.f));
      for (int64_t u = 0; u < 8; ++u) {
        const int64_t b = g * 8 + u;  // the 32-input block
        const typename V::F s = V::mul(V::loadu8(p + 2048 + u * 16 + h * V::R), sd);
        const typename V::I t = q4dot(p + u * 256 + h * V::R * 4, xq + b * 32);
        acc = V::fmadd(V::cvt(t), V::mul(s, V::set1(d[b])), acc);
        accm = V::fmadd(V::mul(V::loadu8(p + 2176 + u * 16 + h * V::R), md), V::set1(fs[b]), accm);
      }
    }
    V::store(o, V::fmadd(V::set1(1.f), acc, accm));
  };
  auto rows = [&](const uint8_t* p0, int64_t m, bool first, float* o) {
    over_rows(p0, G, stride, first, o, [&](int64_t g, const uint8_t* p, typename V::F* acc, typename V::F* accm) {
      const typename V::F sd = scales<true>(p + 2304, 0), md = V::mul(scales<true>(p + 2336, 0), V::set1(-1.f));
      for (int64_t u = 0; u < 8; ++u) {
        const int64_t b = g * 8 + u;
        const typename V::F s = V::mul(V::loadu8(p + 2048 + u * 16), sd), mn = V::mul(V::loadu8(p + 2176 + u * 16), md);
        q4dot_rows(p + u * 256, a, m, K, b, s, acc);
#pragma GCC unroll 4
        for (int64_t r = 0; r < kRowsAtOnce; ++r) accm[r] = V::fmadd(mn, V::set1(a.fs[(m + r) * K / 32 + b]), accm[r]);
      }
    });
  };
#if ATTNLAB_TILES
  auto tiles = [&](const uint8_t* p, int64_t m0, float* o) {
    const amx::Block blk(K / 32);
    if (m0 == 0)
      for (int64_t u = 0; u < K / 32; ++u) {
        const uint8_t* f = p + u / 8 * stride;
        amx::unpack_q4(f + u % 8 * 256, blk.wt + u * 512);
        V::store(blk.sc + 16 * u, V::mul(V::loadu8(f + 2048 + u % 8 * 16), scales<true>(f + 2304, 0)));
        V::store(blk.mn + 16 * u, V::mul(V::loadu8(f + 2176 + u % 8 * 16), V::mul(scales<true>(f + 2336, 0), V::set1(-1.f))));
      }
    amx::tile_sums<false>(a, K, m0, blk, o);
    amx::add_mins(blk, a.fs, K / 32, 1.f, m0, o);
  };
  return glu ? run_glu(x, w, N, G, stride, blk, tiles, rows) : run(x, w, N, G, stride, blk, tiles, rows);
#else
  return glu ? run_glu(x, w, N, G, stride, blk, NoTiles{}, rows) : run(x, w, N, G, stride, blk, NoTiles{}, rows);
#endif
}

// Q6_K superblocks (KQ): q8x<false> at group 16 without a min, the codes rebuilt from their two parts, each
// sub-block's s = sc * d made as the loader makes it: integer sums are exact, so the same bits.
torch::Tensor q6k(const torch::Tensor& x, const torch::Tensor& w, int64_t N, bool glu) {
  const int64_t K = x.size(1), G = K / 256, stride = 3360;
  const Acts a(x.data_ptr<float>(), x.size(0), K, 16, false);
  auto blk = [&](auto, int h, const uint8_t* p, int64_t m, float* o) {
    const int8_t* xq = a.q + m * K;
    const float* d = a.d + m * K / 32;
    const int32_t* q16 = a.qs16 + m * K / 16;
    typename V::F acc = V::zerof();
    for (int64_t g = 0; g < G; ++g, p += stride) {
      if (h == 0 && m == 0) prefetch(p, stride);
      const typename V::F sd = scales<true>(p + 3328, h);
      for (int64_t u = 0; u < 8; ++u) {
        const int64_t b = g * 8 + u;  // the 32-input block
        const uint8_t* c = p + u * 384 + h * V::R * 4;
        const int8_t* xb = xq + b * 32;
        typename V::I lo = V::zero(), hi = V::zero();  // inputs 0-15 and 16-31 of the block
        for (int pr = 0; pr < 2; ++pr) {
          const typename V::I w0 = V::load(c + 128 * pr), w1 = V::load(c + 128 * pr + 64), t = V::load(c + 256 + 64 * pr);
          lo = V::dp7(lo, V::or_(V::lo4(w0), V::top2<4>(t)), V::bcast(xb + 8 * pr));
          hi = V::dp7(hi, V::or_(V::hi4(w0), V::top2<2>(t)), V::bcast(xb + 16 + 8 * pr));
          lo = V::dp7(lo, V::or_(V::lo4(w1), V::top2<0>(t)), V::bcast(xb + 8 * pr + 4));
          hi = V::dp7(hi, V::or_(V::hi4(w1), V::top2<-2>(t)), V::bcast(xb + 20 + 8 * pr));
        }
        const typename V::F xd = V::set1(d[b]);
        const typename V::F s0 = V::mul(V::loadi8(p + 3072 + 32 * u + h * V::R), sd);
        const typename V::F s1 = V::mul(V::loadi8(p + 3072 + 32 * u + 16 + h * V::R), sd);
        acc = V::fmadd(V::cvt(V::sub1(lo, 32 * q16[2 * b])), V::mul(s0, xd), acc);
        acc = V::fmadd(V::cvt(V::sub1(hi, 32 * q16[2 * b + 1])), V::mul(s1, xd), acc);
      }
    }
    V::store(o, V::fmadd(V::set1(1.f), acc, V::zerof()));
  };
  auto rows = [&](const uint8_t* p0, int64_t m, bool first, float* o) {  // accm stays zero, as above
    over_rows(p0, G, stride, first, o, [&](int64_t g, const uint8_t* p, typename V::F* acc, typename V::F*) {
      const typename V::F sd = scales<true>(p + 3328, 0);
      for (int64_t u = 0; u < 8; ++u) {
        const int64_t b = g * 8 + u;
        const uint8_t* c = p + u * 384;
        typename V::I cw[8];  // the block's codes rebuilt once for the four rows
        for (int pr = 0; pr < 2; ++pr) {
          const typename V::I w0 = V::load(c + 128 * pr), w1 = V::load(c + 128 * pr + 64), t = V::load(c + 256 + 64 * pr);
          cw[4 * pr] = V::or_(V::lo4(w0), V::top2<4>(t)), cw[4 * pr + 1] = V::or_(V::hi4(w0), V::top2<2>(t));
          cw[4 * pr + 2] = V::or_(V::lo4(w1), V::top2<0>(t)), cw[4 * pr + 3] = V::or_(V::hi4(w1), V::top2<-2>(t));
        }
        const typename V::F s0 = V::mul(V::loadi8(p + 3072 + 32 * u), sd);
        const typename V::F s1 = V::mul(V::loadi8(p + 3072 + 32 * u + 16), sd);
#pragma GCC unroll 4
        for (int64_t r = 0; r < kRowsAtOnce; ++r) {
          const int8_t* xb = a.q + (m + r) * K + b * 32;
          typename V::I lo = V::zero(), hi = V::zero();
          for (int pr = 0; pr < 2; ++pr) {
            lo = V::dp7(lo, cw[4 * pr], V::bcast(xb + 8 * pr)), hi = V::dp7(hi, cw[4 * pr + 1], V::bcast(xb + 16 + 8 * pr));
            lo = V::dp7(lo, cw[4 * pr + 2], V::bcast(xb + 8 * pr + 4)), hi = V::dp7(hi, cw[4 * pr + 3], V::bcast(xb + 20 + 8 * pr));
          }
          const int32_t* q16 = a.qs16 + (m + r) * K / 16;
          const typename V::F xd = V::set1(a.d[(m + r) * K / 32 + b]);
          acc[r] = V::fmadd(V::cvt(V::sub1(lo, 32 * q16[2 * b])), V::mul(s0, xd), acc[r]);
          acc[r] = V::fmadd(V::cvt(V::sub1(hi, 32 * q16[2 * b + 1])), V::mul(s1, xd), acc[r]);
        }
      }
    });
  };
  return glu ? run_glu(x, w, N, G, stride, blk, NoTiles{}, rows) : run(x, w, N, G, stride, blk, NoTiles{}, rows);
}

template <bool H>
torch::Tensor q8x(const torch::Tensor& x, const torch::Tensor& w, int64_t N, int64_t group, bool has_min, bool glu) {
  const int64_t K = x.size(1);
  constexpr int64_t sb = H ? 32 : 64;
  const int64_t G = K / group, stride = group * 16 + sb * (has_min ? 2 : 1), sub = std::min<int64_t>(group, 32);
  const Acts a(x.data_ptr<float>(), x.size(0), K, group, has_min);
  auto blk = [&](auto ns, int h, const uint8_t* p0, int64_t m, float* o) {
    const int8_t* xq = a.q + m * K;
    const float* d = a.d + m * K / 32;
    const int32_t* q16 = a.qs16 + m * K / 16;
    constexpr int NS = decltype(ns)::value;
    over_blocks<NS>(p0, G, stride, h == 0 && m == 0, o, [&](int64_t g, const uint8_t* p, auto& acc, auto& accm) {
      const typename V::F sc = scales<H>(p + group * 16, h);
      for (int64_t u = 0; u < group / sub; ++u) {  // sub-blocks of one activation scale and one weight scale
        const int64_t i = g * group + u * sub;  // first input
        const uint8_t* c = p + u * sub * 16 + h * V::R * 4;
        typename V::I i0 = V::zero(), i1 = V::zero();
        for (int64_t j = 0; j < sub / 4; j += 2) {
          i0 = V::dp8(i0, V::load(c + 64 * j), V::bcast(xq + i + 4 * j));
          i1 = V::dp8(i1, V::load(c + 64 * j + 64), V::bcast(xq + i + 4 * j + 4));
        }
        const int32_t corr = 128 * (sub == 32 ? q16[i / 16] + q16[i / 16 + 1] : q16[i / 16]);
        acc = V::fmadd(V::cvt(V::sub1(V::add(i0, i1), corr)), V::mul(sc, V::set1(d[i / 32])), acc);
      }
      if (has_min) accm = V::fmadd(scales<H>(p + group * 16 + sb, h), V::set1(a.fs[m * G + g]), accm);
    });
  };
  auto rows = [&](const uint8_t* p0, int64_t m, bool first, float* o) {
    over_rows(p0, G, stride, first, o, [&](int64_t g, const uint8_t* p, typename V::F* acc, typename V::F* accm) {
      const typename V::F sc = scales<H>(p + group * 16, 0);
      for (int64_t u = 0; u < group / sub; ++u) {
        const int64_t i = g * group + u * sub;
        const uint8_t* c = p + u * sub * 16;
        typename V::I i0[kRowsBuf], i1[kRowsBuf];
#pragma GCC unroll 4
        for (int64_t r = 0; r < kRowsAtOnce; ++r) i0[r] = V::zero(), i1[r] = V::zero();
        for (int64_t j = 0; j < sub / 4; j += 2) {
          const typename V::I c0 = V::load(c + 64 * j), c1 = V::load(c + 64 * j + 64);
#pragma GCC unroll 4
          for (int64_t r = 0; r < kRowsAtOnce; ++r) {
            const int8_t* xq = a.q + (m + r) * K + i + 4 * j;
            i0[r] = V::dp8(i0[r], c0, V::bcast(xq)), i1[r] = V::dp8(i1[r], c1, V::bcast(xq + 4));
          }
        }
#pragma GCC unroll 4
        for (int64_t r = 0; r < kRowsAtOnce; ++r) {
          const int32_t* q16 = a.qs16 + (m + r) * K / 16;
          const int32_t corr = 128 * (sub == 32 ? q16[i / 16] + q16[i / 16 + 1] : q16[i / 16]);
          acc[r] = V::fmadd(V::cvt(V::sub1(V::add(i0[r], i1[r]), corr)), V::mul(sc, V::set1(a.d[(m + r) * K / 32 + i / 32])), acc[r]);
        }
      }
      if (has_min)
#pragma GCC unroll 4
        for (int64_t r = 0; r < kRowsAtOnce; ++r)
          accm[r] = V::fmadd(scales<H>(p + group * 16 + sb, 0), V::set1(a.fs[(m + r) * G + g]), accm[r]);
    });
  };
#if ATTNLAB_TILES
  // groups of 32 and up (sub-blocks of 32 lie as weight tiles); groups of 16 stay on the vector path
  auto tiles = [&](const uint8_t* p, int64_t m0, float* o) {
    const int64_t per = group / 32;
    const amx::Block blk(K / 32);
    if (m0 == 0)
      for (int64_t u = 0; u < K / 32; ++u) {
        std::memcpy(blk.wt + u * 512, p + u / per * stride + u % per * 512, 512);
        V::store(blk.sc + 16 * u, scales<H>(p + u / per * stride + group * 16, 0));
      }
    if (m0 == 0 && has_min)
      for (int64_t g = 0; g < G; ++g) V::store(blk.mn + 16 * g, scales<H>(p + g * stride + group * 16 + sb, 0));
    amx::tile_sums<true>(a, K, m0, blk, o);
    amx::add_mins(blk, a.fs, has_min ? G : 0, 1.f, m0, o);
  };
  if (sub == 32) return glu ? run_glu(x, w, N, G, stride, blk, tiles, rows) : run<kStreams>(x, w, N, G, stride, blk, tiles, rows);
#endif
  return glu ? run_glu(x, w, N, G, stride, blk, NoTiles{}, rows) : run<kStreams>(x, w, N, G, stride, blk, NoTiles{}, rows);
}

}  // namespace

// x [M, K] fp32; w [ceil(N/16), K/group, group*8 + scale/min bytes] uint8 (q4 layout above, flags fmt) -> [M, N];
// with KQ [ceil(N/16), K/256, 2368]
torch::Tensor q4x_any(const torch::Tensor& x, const torch::Tensor& w, int64_t N, int64_t group, int64_t fmt, bool glu) {
  const int64_t K = x.size(1);
  TORCH_CHECK(group % 32 == 0 && group > 0 && K % group == 0, "q4x: group must be a multiple of 32 dividing K");
  check_x(x, K);
  if (fmt == KQ) {
    TORCH_CHECK(group == 32 && K % 256 == 0, "q4x: the KQ layout needs groups of 32 and K a multiple of 256");
    return q4k(x, w, N, glu);
  }
  return with_layout(fmt, [&](auto half, auto sym) { return q4x<half.value, sym.value>(x, w, N, group, glu); });
}
torch::Tensor q4x_mm(torch::Tensor x, torch::Tensor w, int64_t N, int64_t group, int64_t fmt) {
  return q4x_any(x, w, N, group, fmt, false);
}
// x @ w^T for w's rows gate (N / 2) then up -> silu(gate) * up [M, N / 2] (run_glu): an MLP's input side
torch::Tensor q4x_glu(torch::Tensor x, torch::Tensor w, int64_t N, int64_t group, int64_t fmt) {
  return q4x_any(x, w, N, group, fmt, true);
}

// x [M, K] fp32; w [ceil(N/16), K/group, group*16 + scale (+ min) bytes] uint8 (q8 layout) -> [M, N];
// with KQ [ceil(N/16), K/256, 3360]
torch::Tensor q8x_any(const torch::Tensor& x, const torch::Tensor& w, int64_t N, int64_t group, bool has_min,
                      int64_t fmt, bool glu) {
  const int64_t K = x.size(1);
  TORCH_CHECK(group % 16 == 0 && group > 0 && K % group == 0 && K % 32 == 0,
              "q8x: group must be a multiple of 16 dividing K (a multiple of 32)");
  TORCH_CHECK(group <= 32 || group % 32 == 0, "q8x: a group above 32 must be a multiple of 32");
  check_x(x, K);
  if (fmt == KQ) {
    TORCH_CHECK(group == 16 && !has_min && K % 256 == 0, "q8x: the KQ layout needs groups of 16, no min, K a multiple of 256");
    return q6k(x, w, N, glu);
  }
  TORCH_CHECK(fmt == 0 || fmt == HALF, "q8x: layout flags must be 0, HALF (1) or KQ (4), got ", fmt);
  return fmt == HALF ? q8x<true>(x, w, N, group, has_min, glu) : q8x<false>(x, w, N, group, has_min, glu);
}
torch::Tensor q8x_mm(torch::Tensor x, torch::Tensor w, int64_t N, int64_t group, bool has_min, int64_t fmt) {
  return q8x_any(x, w, N, group, has_min, fmt, false);
}
torch::Tensor q8x_glu(torch::Tensor x, torch::Tensor w, int64_t N, int64_t group, bool has_min, int64_t fmt) {
  return q8x_any(x, w, N, group, has_min, fmt, true);
}

// Rows ids [n] of a repacked int8 weight w (q8 layout, K inputs), dequantised -> [n, K] float32: a tied
// head's embedding lookup, one token per decode step, reading 16 * K bytes instead of unpacking a block.
// With KQ (Q6_K superblocks): (c - 32) * (d * sc), the loader's float32 scale times the code, dequantize()'s bits.
torch::Tensor q8x_rows(torch::Tensor w, torch::Tensor ids, int64_t K, int64_t group, bool has_min, int64_t fmt) {
  const bool kq = fmt == KQ;
  TORCH_CHECK(fmt == 0 || fmt == HALF || kq, "q8x_rows: layout flags must be 0, HALF (1) or KQ (4), got ", fmt);
  TORCH_CHECK(group > 0 && group % 4 == 0 && K % group == 0, "q8x_rows: group must divide K in fours");
  TORCH_CHECK(!kq || (group == 16 && !has_min && K % 256 == 0), "q8x_rows: KQ needs groups of 16, no min, K of 256s");
  const int64_t G = kq ? K / 256 : K / group, sb = fmt == HALF ? 32 : 64;
  const int64_t stride = kq ? 3360 : group * 16 + sb * (has_min ? 2 : 1);
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.is_contiguous() && w.dim() == 3 && w.size(1) == G &&
              w.size(2) == stride, "q8x_rows: w must be contiguous uint8 [blocks, ", G, ", ", stride, "]");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, "q8x_rows: ids must be int64 [n]");
  const auto idc = ids.contiguous();
  const int64_t n = idc.numel(), rows = w.size(0) * 16;
  const int64_t* I = idc.data_ptr<int64_t>();
  auto out = torch::empty({n, K}, w.options().dtype(torch::kFloat));
  float* O = out.data_ptr<float>();
  const uint8_t* W = w.data_ptr<uint8_t>();
  auto value = [&](const uint8_t* p, int64_t r) {  // 16 per-row floats at p: row r's
    return fmt == HALF ? static_cast<float>(reinterpret_cast<const at::Half*>(p)[r]) : reinterpret_cast<const float*>(p)[r];
  };
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(I[i] >= 0 && I[i] < rows, "q8x_rows: row ", I[i], " outside the weight's ", rows, " rows");
    const int64_t b = I[i] / 16, r = I[i] % 16;
    for (int64_t g = 0; kq && g < G; ++g) {
      const uint8_t* p = W + (b * G + g) * stride;
      const float d = static_cast<float>(reinterpret_cast<const at::Half*>(p + 3328)[r]);
      for (int64_t u = 0; u < 8; ++u)
        for (int k = 0; k < 2; ++k) {  // inputs 32u + 16k ..: low (k = 0) or high nibbles
          const float s = d * static_cast<float>(static_cast<int8_t>(p[3072 + (2 * u + k) * 16 + r]));
          for (int j = 0; j < 4; ++j)
            for (int t = 0; t < 4; ++t) {
              const int lo = p[u * 384 + 64 * j + 4 * r + t] >> (4 * k) & 15;
              const int top = p[u * 384 + 256 + 64 * (j / 2) + 4 * r + t] >> (2 * (k + 2 * (j % 2))) & 3;
              O[i * K + g * 256 + 32 * u + 16 * k + 4 * j + t] = static_cast<float>((lo | top << 4) - 32) * s;
            }
        }
    }
    for (int64_t g = 0; !kq && g < G; ++g) {
      const uint8_t* p = W + (b * G + g) * stride;
      const float s = value(p + group * 16, r), mn = has_min ? value(p + group * 16 + sb, r) : 0.f;
      float* o = O + i * K + g * group;
      for (int64_t c = 0; c < group / 4; ++c)
        for (int t = 0; t < 4; ++t) {  // q * s rounded before + m (no fused multiply-add): dequantize()'s bits
          volatile float qs = static_cast<float>(static_cast<int>(p[64 * c + 4 * r + t]) - 128) * s;
          o[4 * c + t] = qs + mn;
        }
    }
  }
  return out;
}

// ---- repacking at load: the layouts of `repack.pack_q4` / `pack_q8` (whose torch forms are the reference)
// built in one pass over the row layout; in torch the permutes and nibble splits took ~70% of a 1B load.

// 16 rows' per-group floats of block b, group g at p: float16 with HALF, else float32; rows past N stay zero.
void put_floats(uint8_t* p, const float* src, int64_t b, int64_t g, int64_t N, int64_t G, bool half) {
  for (int64_t r = 0; r < 16 && 16 * b + r < N; ++r) {
    const float v = src[(16 * b + r) * G + g];
    if (half) reinterpret_cast<at::Half*>(p)[r] = at::Half(v);
    else reinterpret_cast<float*>(p)[r] = v;
  }
}

void check_floats(const torch::Tensor& t, int64_t N, int64_t G, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == N && t.size(1) == G,
              what, " must be contiguous float32 [", N, ", ", G, "]");
}


// Zeroed uint8 [NB, G, stride] for repacked weights, in its own mapping marked for transparent huge pages
// (where the OS leaves them to madvise): a matvec streams the whole of it every step, and with 4 KiB pages
// every page is a TLB miss. 1B Q4_0 (Xeon VM, THP "madvise"): 16.8 -> 17.6 tok/s at 1 thread, 29.7 -> 32.3 at
// 2 (medians of 4 alternating processes). Under 2 MiB it would not fill one huge page.
torch::Tensor weight_buffer(int64_t NB, int64_t G, int64_t stride) {
  const size_t n = static_cast<size_t>(NB * G * stride);
  if (n < (2u << 20)) return torch::zeros({NB, G, stride}, torch::kByte);
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "mmap of ", n, " bytes for repacked weights failed");
  madvise(p, n, MADV_HUGEPAGE);
  return torch::from_blob(p, {NB, G, stride}, [n](void* q) { munmap(q, n); }, torch::kByte);
}

// pack4's codes qs [N, K/2] (byte i of a 32-block: code i low, code i + 16 high) -> the q4 blocks: the two
// layouts share that nibble order, so each 4-byte run of a row moves whole (lane r of chunk j <- bytes 4j..4j+3).
torch::Tensor repack_q4(torch::Tensor qs, torch::Tensor scale, torch::Tensor min, int64_t group, int64_t fmt) {
  TORCH_CHECK(qs.scalar_type() == torch::kByte && qs.is_contiguous() && qs.dim() == 2, "qs must be contiguous uint8 [N, K/2]");
  const int64_t N = qs.size(0), K = qs.size(1) * 2;
  TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0, "repack_q4: group must be a multiple of 32 dividing K");
  TORCH_CHECK(fmt >= 0 && fmt <= (HALF | SYM), "repack_q4: layout flags must be 0-3");
  const int64_t G = K / group, per = group / 32, NB = (N + 15) / 16, sb = fmt & HALF ? 32 : 64;
  const int64_t stride = per * 256 + sb * (fmt & SYM ? 1 : 2);
  check_floats(scale, N, G, "scale");
  if (!(fmt & SYM)) check_floats(min, N, G, "min");
  auto out = weight_buffer(NB, G, stride);
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  uint8_t* O = out.data_ptr<uint8_t>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* p = O + (b * G + g) * stride;
        for (int64_t r = 0; r < 16 && 16 * b + r < N; ++r) {
          const uint8_t* src = Q + (16 * b + r) * (K / 2) + g * per * 16;
          for (int64_t u = 0; u < per; ++u)
            for (int j = 0; j < 4; ++j) std::memcpy(p + u * 256 + j * 64 + r * 4, src + u * 16 + 4 * j, 4);
        }
        put_floats(p + per * 256, scale.data_ptr<float>(), b, g, N, G, fmt & HALF);
        if (!(fmt & SYM)) put_floats(p + per * 256 + sb, min.data_ptr<float>(), b, g, N, G, fmt & HALF);
      }
  });
  return out;
}

// Q4_K's codes and factors -> the KQ superblocks: the codes as repack_q4 moves them at group 32, then
// sc[8][16], m[8][16] (uint8 [N, K/32]) and d[16], dmin[16] (float32 [N, K/256] holding float16 values).
torch::Tensor repack_q4k(torch::Tensor qs, torch::Tensor sc, torch::Tensor m, torch::Tensor d, torch::Tensor dmin) {
  TORCH_CHECK(qs.scalar_type() == torch::kByte && qs.is_contiguous() && qs.dim() == 2, "qs must be contiguous uint8 [N, K/2]");
  const int64_t N = qs.size(0), K = qs.size(1) * 2, G = K / 256, NB = (N + 15) / 16, stride = 2368;
  TORCH_CHECK(K % 256 == 0, "repack_q4k: K must be a multiple of 256");
  for (const auto* t : {&sc, &m})
    TORCH_CHECK(t->scalar_type() == torch::kByte && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                t->size(1) == K / 32, "repack_q4k: sc and m must be contiguous uint8 [", N, ", ", K / 32, "]");
  check_floats(d, N, G, "d");
  check_floats(dmin, N, G, "dmin");
  auto out = weight_buffer(NB, G, stride);
  const uint8_t *Q = qs.data_ptr<uint8_t>(), *SC = sc.data_ptr<uint8_t>(), *MN = m.data_ptr<uint8_t>();
  uint8_t* O = out.data_ptr<uint8_t>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* p = O + (b * G + g) * stride;
        for (int64_t r = 0; r < 16 && 16 * b + r < N; ++r) {
          const int64_t row = 16 * b + r;
          for (int64_t u = 0; u < 8; ++u) {
            for (int j = 0; j < 4; ++j) std::memcpy(p + u * 256 + j * 64 + r * 4, Q + row * (K / 2) + (8 * g + u) * 16 + 4 * j, 4);
            p[2048 + u * 16 + r] = SC[row * (K / 32) + 8 * g + u];
            p[2176 + u * 16 + r] = MN[row * (K / 32) + 8 * g + u];
          }
        }
        put_floats(p + 2304, d.data_ptr<float>(), b, g, N, G, true);
        put_floats(p + 2336, dmin.data_ptr<float>(), b, g, N, G, true);
      }
  });
  return out;
}

// Q6_K's codes q [N, K] (-32..31) and factors sc (int8 [N, K/16]), d (float32 [N, K/256] of float16 values)
// -> the KQ superblocks of q8 (layout above).
torch::Tensor repack_q6k(torch::Tensor q, torch::Tensor sc, torch::Tensor d) {
  TORCH_CHECK(q.scalar_type() == torch::kChar && q.is_contiguous() && q.dim() == 2, "q must be contiguous int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), G = K / 256, NB = (N + 15) / 16, stride = 3360;
  TORCH_CHECK(K % 256 == 0, "repack_q6k: K must be a multiple of 256");
  TORCH_CHECK(sc.scalar_type() == torch::kChar && sc.is_contiguous() && sc.dim() == 2 && sc.size(0) == N &&
              sc.size(1) == K / 16, "repack_q6k: sc must be contiguous int8 [", N, ", ", K / 16, "]");
  check_floats(d, N, G, "d");
  auto out = weight_buffer(NB, G, stride);
  const int8_t *Q = q.data_ptr<int8_t>(), *SC = sc.data_ptr<int8_t>();
  uint8_t* O = out.data_ptr<uint8_t>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* p = O + (b * G + g) * stride;
        for (int64_t r = 0; r < 16 && 16 * b + r < N; ++r) {
          const int8_t* src = Q + (16 * b + r) * K + g * 256;
          for (int64_t u = 0; u < 8; ++u)
            for (int j = 0; j < 4; ++j)
              for (int t = 0; t < 4; ++t) {
                const int c0 = src[32 * u + 4 * j + t] + 32, c1 = src[32 * u + 16 + 4 * j + t] + 32;
                p[u * 384 + 64 * j + 4 * r + t] = static_cast<uint8_t>((c0 & 15) | (c1 & 15) << 4);
                p[u * 384 + 256 + 64 * (j / 2) + 4 * r + t] |= static_cast<uint8_t>(((c0 >> 4) | (c1 >> 4) << 2) << (4 * (j % 2)));
              }
          for (int k = 0; k < 16; ++k) p[3072 + 16 * k + r] = static_cast<uint8_t>(SC[(16 * b + r) * (K / 16) + 16 * g + k]);
        }
        put_floats(p + 3328, d.data_ptr<float>(), b, g, N, G, true);
      }
  });
  return out;
}

// int8 codes q [N, K] -> the q8 blocks: lane r of chunk c <- q[r][4c..4c+3] + 128.
torch::Tensor repack_q8(torch::Tensor q, torch::Tensor scale, const std::optional<torch::Tensor>& min, int64_t group,
                        int64_t fmt) {
  TORCH_CHECK(q.scalar_type() == torch::kChar && q.is_contiguous() && q.dim() == 2, "q must be contiguous int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(group > 0 && group % 4 == 0 && K % group == 0, "repack_q8: group must divide K in fours");
  TORCH_CHECK(fmt == 0 || fmt == HALF, "repack_q8: layout flags must be 0 or HALF (1)");
  const int64_t G = K / group, NB = (N + 15) / 16, sb = fmt & HALF ? 32 : 64, stride = group * 16 + sb * (min ? 2 : 1);
  check_floats(scale, N, G, "scale");
  if (min) check_floats(*min, N, G, "min");
  auto out = weight_buffer(NB, G, stride);
  const uint8_t* Q = reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>());
  uint8_t* O = out.data_ptr<uint8_t>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* p = O + (b * G + g) * stride;
        for (int64_t r = 0; r < 16; ++r) {  // rows past N hold code 0 (byte 128), as the torch layout pads
          const uint8_t* src = Q + (16 * b + r) * K + g * group;
          const bool row = 16 * b + r < N;
          for (int64_t c = 0; c < group / 4; ++c)
            for (int t = 0; t < 4; ++t) p[c * 64 + r * 4 + t] = row ? src[4 * c + t] ^ 0x80 : 0x80;  // q + 128
        }
        put_floats(p + group * 16, scale.data_ptr<float>(), b, g, N, G, fmt & HALF);
        if (min) put_floats(p + group * 16 + sb, min->data_ptr<float>(), b, g, N, G, fmt & HALF);
      }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("repack_q4(Tensor qs, Tensor scale, Tensor min, int group, int fmt) -> Tensor");
  m.def("repack_q8(Tensor q, Tensor scale, Tensor? min, int group, int fmt) -> Tensor");
  m.def("repack_q4k(Tensor qs, Tensor sc, Tensor m, Tensor d, Tensor dmin) -> Tensor");
  m.def("repack_q6k(Tensor q, Tensor sc, Tensor d) -> Tensor");
  m.def("q8x_rows(Tensor w, Tensor ids, int k, int group, bool has_min, int fmt) -> Tensor");
  m.def("q4x_mm(Tensor x, Tensor w, int n, int group, int fmt) -> Tensor");
  m.def("q8x_mm(Tensor x, Tensor w, int n, int group, bool has_min, int fmt) -> Tensor");
  m.def("q4x_glu(Tensor x, Tensor w, int n, int group, int fmt) -> Tensor");
  m.def("q8x_glu(Tensor x, Tensor w, int n, int group, bool has_min, int fmt) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("q4x_mm", &q4x_mm), m.impl("q8x_mm", &q8x_mm), m.impl("q8x_rows", &q8x_rows);
  m.impl("q4x_glu", &q4x_glu), m.impl("q8x_glu", &q8x_glu);
  m.impl("repack_q4", &repack_q4), m.impl("repack_q8", &repack_q8), m.impl("repack_q4k", &repack_q4k);
  m.impl("repack_q6k", &repack_q6k);
}
