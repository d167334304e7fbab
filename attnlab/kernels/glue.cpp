// The elementwise glue of a prefill's forward pass, as ops: RMSNorm, SiLU(gate) x up over rows, and the
// dequantised weight a long prompt's float matmul multiplies by.
//
// Why: in a 512-token prefill of SmolLM2 on one thread (Xeon), torch's rms_norm (a composite of pow, mean,
// rsqrt and two multiplies on CPU) and silu on the strided gate half, then a multiply, took ~90 ms of ~590
// (profiler), each pass a round trip through memory. One pass per row here, the arithmetic the native decode
// step uses (`attnlab_simd::rms_norm`, `silu_mul`), so prefill and decode normalise alike.
#include "kernels_simd.h"
#include "ops.h"

namespace attnlab {

// x [..., D] float32 contiguous, w [D] -> x / rms(x) * w, rows split across threads.
View rms_norm(const Alloc& alloc, const Contig& x, const Contig& w, double eps) {
  ATTNLAB_CHECK(x.scalar_type() == attnlab::kFloat && w.scalar_type() == attnlab::kFloat && w.dim() == 1 &&
              x.size(-1) == w.size(0), "rms_norm: float32 x [..., D] and weight [D]");
  const View &xc = x, &wc = w;
  auto out = alloc(x.sizes().vec(), attnlab::kFloat);
  const int64_t D = w.size(0), rows = D ? xc.numel() / D : 0;
  const float *X = xc.data_ptr<float>(), *W = wc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) attnlab_simd::rms_norm(X + r * D, W, O + r * D, D, eps);
  });
  return out;
}

// h [..., 2H] float32 (gate, then up) -> silu(gate) * up [..., H].
View silu_mul(const Alloc& alloc, const Contig& h) {
  ATTNLAB_CHECK(h.scalar_type() == attnlab::kFloat && h.dim() >= 1 && h.size(-1) % 2 == 0,
              "silu_mul: float32 [..., 2 hidden]");
  const View& hc = h;
  const int64_t H = h.size(-1) / 2, rows = H ? hc.numel() / (2 * H) : 0;
  auto sizes = h.sizes().vec();
  sizes.back() = H;
  auto out = alloc(sizes, attnlab::kFloat);
  const float* G = hc.data_ptr<float>();
  float* A = out.data_ptr<float>();
  parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) attnlab_simd::silu_mul_row(G + r * 2 * H, A + r * H, 0, H, H);
  });
  return out;
}

// Why: past the integer kernels' rows a prompt's chunk is multiplied by the dequantised matrix, and torch's
// dequantisation (a cast, then a broadcast multiply, each into a new tensor whose pages fault in) took 64 ms
// for Qwen2.5-0.5B's w13 [9728, 896] at 1 thread (other jobs running; `benchmarks/prefill_dequant.py` measures
// it). One pass here, into a buffer the caller keeps. The same bits as `dequantize()`: w = c * s, then + m (no fused
// multiply-add, as torch's two ops round twice).
static inline void scale_8(const __m256 c, float s, const float* m, float* o) {
  __m256 w = _mm256_mul_ps(c, _mm256_set1_ps(s));
  __asm__("" : "+x"(w));  // the product rounded before the add: the compiler may not fuse them
  _mm256_storeu_ps(o, m ? _mm256_add_ps(w, _mm256_set1_ps(*m)) : w);
}

static void check_out(const View& out, int64_t N, int64_t K) {
  ATTNLAB_CHECK(out.scalar_type() == attnlab::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == N &&
              out.size(1) == K, "dequant: out must be float32 [N, K] contiguous");
}

// q [N, K] int8, scale [N, K/g] (g a multiple of 8), min: none or like scale -> out [N, K] float32.
View dequant_q8(const Alloc&, const View& q, const View& scale, const Opt& min, const View& out) {
  ATTNLAB_CHECK(q.scalar_type() == attnlab::kInt8 && q.dim() == 2 && q.is_contiguous(), "dequant_q8: int8 q [N, K]");
  const int64_t N = q.size(0), K = q.size(1), G = scale.size(-1);
  ATTNLAB_CHECK(scale.scalar_type() == attnlab::kFloat && scale.is_contiguous() && scale.numel() == N * G && G > 0 &&
              K % G == 0 && (K / G) % 8 == 0, "dequant_q8: float32 scale [N, K/g], g a multiple of 8");
  ATTNLAB_CHECK(!min || (min->scalar_type() == attnlab::kFloat && min->is_contiguous() && min->numel() == N * G),
              "dequant_q8: min like scale");
  check_out(out, N, K);
  const int64_t g = K / G;
  const int8_t* Q = q.data_ptr<int8_t>();
  const float *S = scale.data_ptr<float>(), *M = min ? min->data_ptr<float>() : nullptr;
  float* O = out.data_ptr<float>();
  parallel_for(0, N * G, 256, [&](int64_t b0, int64_t b1) {  // over groups: rows may be few and long
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < g; j += 8) {
        const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(Q + b * g + j));
        scale_8(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8)), S[b], M ? M + b : nullptr, O + b * g + j);
      }
  });
  return out;
}

// qs [N, K/2] uint8 in blocks of 32 codes (byte i: code i in its low nibble, code 16 + i in its high one),
// scale and min [N, K/g] (g a multiple of 32) -> out [N, K] float32 = c * s + m.
View dequant_q4(const Alloc&, const View& qs, const View& scale, const View& min, const View& out) {
  ATTNLAB_CHECK(qs.scalar_type() == attnlab::kUInt8 && qs.dim() == 2 && qs.is_contiguous(), "dequant_q4: uint8 qs [N, K/2]");
  const int64_t N = qs.size(0), K = 2 * qs.size(1), G = scale.size(-1);
  ATTNLAB_CHECK(scale.scalar_type() == attnlab::kFloat && min.scalar_type() == attnlab::kFloat && scale.is_contiguous() &&
              min.is_contiguous() && scale.numel() == N * G && min.numel() == N * G && G > 0 && K % G == 0 &&
              (K / G) % 32 == 0, "dequant_q4: float32 scale and min [N, K/g], g a multiple of 32");
  check_out(out, N, K);
  const int64_t g = K / G;
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  const float *S = scale.data_ptr<float>(), *M = min.data_ptr<float>();
  float* O = out.data_ptr<float>();
  parallel_for(0, N * G, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < g; j += 32) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(Q + (b * g + j) / 2));
        const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(15));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
        float* o = O + b * g + j;
        scale_8(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), S[b], M + b, o);
        scale_8(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), S[b], M + b, o + 8);
        scale_8(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), S[b], M + b, o + 16);
        scale_8(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), S[b], M + b, o + 24);
      }
  });
  return out;
}

}  // namespace attnlab
