// The block drivers of the repacked matvecs: run / run_glu split a matvec over threads, streams and (AMX)
// tiles; prefetch, the layout's scales and the per-group frames (over_blocks, over_rows) every format's
// matvec (repacked.cpp) fills with its own arithmetic.
#pragma once
#include <type_traits>

#include "repacked_amx.h"
#include "repacked_layout.h"

namespace {

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
void check_w(const View& w, int64_t NB, int64_t G, int64_t stride) {
  ATTNLAB_CHECK(w.scalar_type() == attnlab::kByte && w.is_contiguous() && w.numel() == NB * G * stride,
              "repacked weight must be contiguous uint8 [", NB, ", ", G, ", ", stride, "]");
}

template <int NS = 1, class Blk, class Tiles = NoTiles, class Rows = NoRows>
View run(const Alloc& alloc, const View& x, const View& w, int64_t N, int64_t G, int64_t stride, Blk blk,
                  Tiles tiles = {}, Rows rows = {}) {
  const int64_t M = x.size(0), NB = (N + 15) / 16;
  check_w(w, NB, G, stride);
  auto out = alloc({M, N}, attnlab::kFloat);
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
    const bool alone = omp_in_parallel() ? omp_get_num_threads() == 1 : attnlab::num_threads() == 1;
#else
    const bool alone = attnlab::num_threads() == 1;
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
  if (attnlab::num_threads() == 1) part(0, NB); else attnlab::parallel_for(0, NB, 1, part);
  return out;
}

// silu(gate) * up [M, N / 2] for a weight whose rows are gate (N / 2) then up (an MLP's w13), as run's blocks:
// one thread takes gate block p and up block p + N / 32, each for every row into an [M x 16] scratch, and
// combines them with `attnlab_simd::silu_mul` (silu_mul_row's arithmetic: silu_mul after run gives the same
// bits). What it saves is the [M, N] output's trip through memory and back (SmolLM2's w13 in a 512-token prefill:
// 6 MiB written, read again, 3 MiB written). One weight stream per thread: for prompts, not matvecs.
template <class Blk, class Tiles = NoTiles, class Rows = NoRows>
View run_glu(const Alloc& alloc, const View& x, const View& w, int64_t N, int64_t G, int64_t stride, Blk blk,
                      Tiles tiles = {}, Rows rows = {}) {
  ATTNLAB_CHECK(N % 32 == 0, "a gated matmul needs gate and up rows in whole 16-row blocks (N a multiple of 32)");
  const int64_t M = x.size(0), H = N / 2, NP = N / 32;
  check_w(w, 2 * NP, G, stride);
  auto out = alloc({M, H}, attnlab::kFloat);
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
  if (attnlab::num_threads() == 1) part(0, NP); else attnlab::parallel_for(0, NP, 1, part);
  return out;
}

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
View with_layout(int64_t fmt, Fn f) {
  using T = std::true_type;
  using U = std::false_type;
  ATTNLAB_CHECK(fmt >= 0 && fmt <= (HALF | SYM), "repacked layout flags must be 0-3, got ", fmt);
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

}  // namespace
