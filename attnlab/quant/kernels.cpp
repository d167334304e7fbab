// Fused dequantise-and-multiply kernels for batch-1 decoding (AVX2 + FMA).
//
// Decoding reads every weight once per token, so the weight is never expanded to
// float in memory: each block of 4-bit codes is unpacked into registers and
// multiplied there. Activations stay fp32 (no activation rounding), so each kernel
// equals "dequantise, then float matmul" up to summation order.
//
// Block layout (ggml's Q4 layout, so GGUF Q4_0/Q4_1 blocks load by copy): a block
// of 32 weights of one row is 16 bytes; byte j holds weight j in its low nibble
// and weight j + 16 in its high nibble.
//   q4:   w = code * scale[g] + min[g]        (g = group of `group` weights, a multiple of 32)
//   lut4: w = codebook[g][code]               (16 floats per group; k-means codebooks)
//   q8:   w = int8 * scale[row]
// Rows are split across torch's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 u8x8_to_ps(__m128i bytes) {  // the low 8 bytes -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

// sum over one 32-weight block of code[j] * x[j]
inline __m256 q4_block(const uint8_t* qs, const float* x, __m256 acc) {
  const __m128i m = _mm_set1_epi8(0x0F);
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  __m128i lo = _mm_and_si128(b, m);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
  acc = _mm256_fmadd_ps(u8x8_to_ps(lo), _mm256_loadu_ps(x), acc);
  acc = _mm256_fmadd_ps(u8x8_to_ps(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(x + 8), acc);
  acc = _mm256_fmadd_ps(u8x8_to_ps(hi), _mm256_loadu_ps(x + 16), acc);
  acc = _mm256_fmadd_ps(u8x8_to_ps(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(x + 24), acc);
  return acc;
}

inline __m256 lut8(__m128i codes8, __m256 lo, __m256 hi, const float* x, __m256 acc) {
  __m256i idx = _mm256_cvtepu8_epi32(codes8);
  __m256 a = _mm256_permutevar8x32_ps(lo, idx);
  __m256 b = _mm256_permutevar8x32_ps(hi, idx);
  __m256 w = _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));  // bit 3 -> sign
  return _mm256_fmadd_ps(w, _mm256_loadu_ps(x), acc);
}

void check(const torch::Tensor& x, const torch::Tensor& w, int64_t K) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == K,
              "x must be contiguous float32 [M, K]");
  TORCH_CHECK(w.is_contiguous(), "weights must be contiguous");
}

}  // namespace

// x [M, K] fp32; qs [N, K/2] uint8; scale, min [N, K/group] fp32 -> [M, N]
torch::Tensor q4_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor scale, torch::Tensor min, int64_t group) {
  const int64_t N = qs.size(0), K = qs.size(1) * 2, M = x.size(0), G = K / group;
  check(x, qs, K);
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "group must be a multiple of 32 dividing K");
  auto out = torch::empty({M, N}, x.options());
  // per-group sums of x carry the min term: sum_j (c_j s + m) x_j = s sum c_j x_j + m sum x_j
  auto xsum = x.view({M, G, group}).sum(-1).contiguous();
  const float* X = x.data_ptr<float>();
  const float* XS = xsum.data_ptr<float>();
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  const float* S = scale.data_ptr<float>();
  const float* MN = min.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* q = Q + r * K / 2;
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = X + m * K;
        __m256 acc = _mm256_setzero_ps();
        float mins = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          __m256 gacc = _mm256_setzero_ps();
          for (int64_t b = g * group; b < (g + 1) * group; b += 32)
            gacc = q4_block(q + b / 2, xr + b, gacc);
          acc = _mm256_fmadd_ps(gacc, _mm256_set1_ps(S[r * G + g]), acc);
          mins += MN[r * G + g] * XS[m * G + g];
        }
        O[m * N + r] = hsum(acc) + mins;
      }
    }
  });
  return out;
}

// x [M, K] fp32; qs [N, K/2] uint8; codebook [N, K/group, 16] fp32 -> [M, N]
torch::Tensor lut4_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor codebook, int64_t group) {
  const int64_t N = qs.size(0), K = qs.size(1) * 2, M = x.size(0), G = K / group;
  check(x, qs, K);
  TORCH_CHECK(group % 32 == 0 && K % group == 0 && codebook.size(-1) == 16, "bad lut4 shapes");
  auto out = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  const float* CB = codebook.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const __m128i m4 = _mm_set1_epi8(0x0F);
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* q = Q + r * K / 2;
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = X + m * K;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
          const float* cb = CB + (r * G + g) * 16;
          __m256 lo = _mm256_loadu_ps(cb), hi = _mm256_loadu_ps(cb + 8);
          for (int64_t b = g * group; b < (g + 1) * group; b += 32) {
            __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b / 2));
            __m128i l = _mm_and_si128(v, m4), h = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
            acc = lut8(l, lo, hi, xr + b, acc);
            acc = lut8(_mm_srli_si128(l, 8), lo, hi, xr + b + 8, acc);
            acc = lut8(h, lo, hi, xr + b + 16, acc);
            acc = lut8(_mm_srli_si128(h, 8), lo, hi, xr + b + 24, acc);
          }
        }
        O[m * N + r] = hsum(acc);
      }
    }
  });
  return out;
}

// x [M, K] fp32; q [N, K] int8; scale [N] fp32 -> [M, N]
torch::Tensor q8_mm(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0);
  check(x, q, K);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  auto out = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const int8_t* Q = q.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* w = Q + r * K;
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = X + m * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
          __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
          a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_loadu_ps(xr + k), a0);
          a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))),
                               _mm256_loadu_ps(xr + k + 8), a1);
        }
        O[m * N + r] = hsum(_mm256_add_ps(a0, a1)) * S[r];
      }
    }
  });
  return out;
}

TORCH_LIBRARY(attnlab, m) {
  m.def("q4_mm(Tensor x, Tensor qs, Tensor scale, Tensor min, int group) -> Tensor");
  m.def("lut4_mm(Tensor x, Tensor qs, Tensor codebook, int group) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor q, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("q4_mm", &q4_mm);
  m.impl("lut4_mm", &lut4_mm);
  m.impl("q8_mm", &q8_mm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
