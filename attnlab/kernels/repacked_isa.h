// The repacked matvecs' ISA layer: V, one step's vector types and integer dot products (16 rows a step on
// AVX-512, with VNNI's dpbusd or maddubs/madd; 8 on AVX2, AVX-VNNI's dpbusd when built with it), and Acts,
// the activations rounded to int8 per 32 with the sums the min terms need.
#pragma once
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AMX_INT8__) && defined(__AVX512F__)
#define ATTNLAB_TILES 1
#endif

#include "kernels_simd.h"
#include "ops.h"

using attnlab::Alloc;
using attnlab::View;

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
    if (M >= 64) attnlab::parallel_for(0, M, 32, rows); else rows(0, M);  // (inside a parallel region: inline)
    q = qp, d = dp, qs16 = sp, fs = sums ? fp : nullptr;
  }
};

void check_x(const View& x, int64_t K) {
  ATTNLAB_CHECK(x.scalar_type() == attnlab::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == K,
              "x must be contiguous float32 [M, K]");
}

}  // namespace
