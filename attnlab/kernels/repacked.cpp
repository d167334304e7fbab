// Matvecs over weights repacked into 16-row blocks (the layout of `attnlab.kernels.repack`), for decode.
//
// Why a second layout: with one row per stream, a 512-bit register holds 64 weights of ONE row, and the
// row's sum ends in a horizontal add per row. Interleaving 16 rows so that each 32-bit lane holds 4
// consecutive inputs of one row lets one `vpdpbusd` (AVX-512 VNNI) multiply 16 rows by the same 4
// activations (a broadcast), accumulating 16 row sums side by side: no horizontal adds, one weight
// stream per block, scales loaded as one vector. llama.cpp repacks Q4 weights the same way.
//
// Layout: repacked_layout.h; vector types: repacked_isa.h; AMX tiles: repacked_amx.h; threads and streams:
// repacked_blocks.h. This file: each format's matvec (q4, Q4_K, Q6_K, q8) and the ops.
// Activations are rounded to int8 per 32 (as every integer kernel here); the min terms use the sums of
// the rounded values per group, as q4_mm does. Code paths by compile flags: AVX-512 (with VNNI: dpbusd; without:
// maddubs/madd), AVX2 (two 8-row halves per block; AVX-VNNI's dpbusd when built with it).
#include "repacked_blocks.h"

namespace {

template <bool H, bool S>
View q4x(const Alloc& alloc, const View& x, const View& w, int64_t N, int64_t group, bool glu) {
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
  return glu ? run_glu(alloc, x, w, N, G, stride, blk, tiles, rows) : run<kStreams>(alloc, x, w, N, G, stride, blk, tiles, rows);
#else
  return glu ? run_glu(alloc, x, w, N, G, stride, blk, NoTiles{}, rows) : run<kStreams>(alloc, x, w, N, G, stride, blk, NoTiles{}, rows);
#endif
}

// Q4_K superblocks (KQ): q4x<false, false> at group 32, each sub-block's s and m made from the factors in
// the same float32 operations as the loader's (d * sc, -(dmin * m): negating the factor negates the product
// exactly), so the same sums in the same order give the same bits.
View q4k(const Alloc& alloc, const View& x, const View& w, int64_t N, bool glu) {
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
  return glu ? run_glu(alloc, x, w, N, G, stride, blk, tiles, rows) : run(alloc, x, w, N, G, stride, blk, tiles, rows);
#else
  return glu ? run_glu(alloc, x, w, N, G, stride, blk, NoTiles{}, rows) : run(alloc, x, w, N, G, stride, blk, NoTiles{}, rows);
#endif
}

// Q6_K superblocks (KQ): q8x<false> at group 16 without a min, the codes rebuilt from their two parts, each
// sub-block's s = sc * d made as the loader makes it: integer sums are exact, so the same bits.
View q6k(const Alloc& alloc, const View& x, const View& w, int64_t N, bool glu) {
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
  return glu ? run_glu(alloc, x, w, N, G, stride, blk, NoTiles{}, rows) : run(alloc, x, w, N, G, stride, blk, NoTiles{}, rows);
}

template <bool H>
View q8x(const Alloc& alloc, const View& x, const View& w, int64_t N, int64_t group, bool has_min, bool glu) {
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
  if (sub == 32) return glu ? run_glu(alloc, x, w, N, G, stride, blk, tiles, rows) : run<kStreams>(alloc, x, w, N, G, stride, blk, tiles, rows);
#endif
  return glu ? run_glu(alloc, x, w, N, G, stride, blk, NoTiles{}, rows) : run<kStreams>(alloc, x, w, N, G, stride, blk, NoTiles{}, rows);
}

// x [M, K] fp32; w [ceil(N/16), K/group, group*8 + scale/min bytes] uint8 (q4 layout above, flags fmt) -> [M, N];
// with KQ [ceil(N/16), K/256, 2368]
View q4x_any(const Alloc& alloc, const View& x, const View& w, int64_t N, int64_t group, int64_t fmt, bool glu) {
  const int64_t K = x.size(1);
  ATTNLAB_CHECK(group % 32 == 0 && group > 0 && K % group == 0, "q4x: group must be a multiple of 32 dividing K");
  check_x(x, K);
  if (fmt == KQ) {
    ATTNLAB_CHECK(group == 32 && K % 256 == 0, "q4x: the KQ layout needs groups of 32 and K a multiple of 256");
    return q4k(alloc, x, w, N, glu);
  }
  return with_layout(fmt, [&](auto half, auto sym) { return q4x<half.value, sym.value>(alloc, x, w, N, group, glu); });
}
}  // namespace

View attnlab::q4x_mm(const Alloc& alloc, const View& x, const View& w, int64_t N, int64_t group, int64_t fmt) {
  return q4x_any(alloc, x, w, N, group, fmt, false);
}
// x @ w^T for w's rows gate (N / 2) then up -> silu(gate) * up [M, N / 2] (run_glu): an MLP's input side
View attnlab::q4x_glu(const Alloc& alloc, const View& x, const View& w, int64_t N, int64_t group, int64_t fmt) {
  return q4x_any(alloc, x, w, N, group, fmt, true);
}

// x [M, K] fp32; w [ceil(N/16), K/group, group*16 + scale (+ min) bytes] uint8 (q8 layout) -> [M, N];
// with KQ [ceil(N/16), K/256, 3360]
static View q8x_any(const Alloc& alloc, const View& x, const View& w, int64_t N, int64_t group, bool has_min,
                      int64_t fmt, bool glu) {
  const int64_t K = x.size(1);
  ATTNLAB_CHECK(group % 16 == 0 && group > 0 && K % group == 0 && K % 32 == 0,
              "q8x: group must be a multiple of 16 dividing K (a multiple of 32)");
  ATTNLAB_CHECK(group <= 32 || group % 32 == 0, "q8x: a group above 32 must be a multiple of 32");
  check_x(x, K);
  if (fmt == KQ) {
    ATTNLAB_CHECK(group == 16 && !has_min && K % 256 == 0, "q8x: the KQ layout needs groups of 16, no min, K a multiple of 256");
    return q6k(alloc, x, w, N, glu);
  }
  ATTNLAB_CHECK(fmt == 0 || fmt == HALF, "q8x: layout flags must be 0, HALF (1) or KQ (4), got ", fmt);
  return fmt == HALF ? q8x<true>(alloc, x, w, N, group, has_min, glu) : q8x<false>(alloc, x, w, N, group, has_min, glu);
}
View attnlab::q8x_mm(const Alloc& alloc, const View& x, const View& w, int64_t N, int64_t group, bool has_min, int64_t fmt) {
  return q8x_any(alloc, x, w, N, group, has_min, fmt, false);
}
View attnlab::q8x_glu(const Alloc& alloc, const View& x, const View& w, int64_t N, int64_t group, bool has_min, int64_t fmt) {
  return q8x_any(alloc, x, w, N, group, has_min, fmt, true);
}
