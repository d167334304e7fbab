// Fused dequantise-and-multiply kernels for batch-1 decoding (AVX2 + FMA).
//
// Decoding reads every weight once per token, so the weight is never expanded to
// float in memory: each block of codes is unpacked into registers and multiplied
// there. All three multiply in integers, as llama.cpp does: the activation row is
// rounded to int8 with one scale per 32 values (relative error <= 1/254 per value),
// then 32 products are summed by one maddubs + madd. lut4 (k-means codebooks, the
// 16 centroids rounded to int8 per group) looks 32 weights up with one byte shuffle.
//
// Block layout (ggml's Q4 layout, so GGUF Q4_0/Q4_1 blocks load by copy): a block
// of 32 weights of one row is 16 bytes; byte j holds weight j in its low nibble
// and weight j + 16 in its high nibble.
//   q4:   w = code * scale[g] + min[g]        (g = group of `group` weights, a multiple of 32)
//   lut4: w = lut[g][code] * lut_scale[g]     (k-means codebooks, rounded to int8)
//   q8:   w = int8 * scale[row]
// Rows are split across torch's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i unpack32(const uint8_t* qs) {  // 16 bytes -> 32 codes, in weight order
  const __m128i m = _mm_set1_epi8(0x0F);
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

inline __m256 dot_u8i8(__m256i u, __m256i s) {  // 32 u8 x 32 i8 -> 8 float partial sums
  __m256i p = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

// x [M, K] -> int8 codes [M, K] and one scale per 32 values [M, K/32]
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d) {
  for (int64_t b = 0; b < M * K / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    d[b] = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int j = 0; j < 32; ++j) q[b * 32 + j] = static_cast<int8_t>(std::lrintf(xb[j] * inv));
  }
}

void check(const torch::Tensor& x, const torch::Tensor& w, int64_t K) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == K,
              "x must be contiguous float32 [M, K]");
  TORCH_CHECK(w.is_contiguous(), "weights must be contiguous");
}

}  // namespace

// x [M, K] fp32; qs [N, K/2] uint8; scale, min [N, K/group] fp32 -> [M, N]
torch::Tensor q4_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor scale, torch::Tensor min, int64_t group) {
  const int64_t N = qs.size(0), K = qs.size(1) * 2, M = x.size(0), G = K / group, B = K / 32;
  check(x, qs, K);
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "group must be a multiple of 32 dividing K");
  auto out = torch::empty({M, N}, x.options());
  // per-group sums of x carry the min term: sum_j (c_j s + m) x_j = s sum c_j x_j + m sum x_j
  auto xsum = x.view({M, G, group}).sum(-1).contiguous();
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * B);
  quantize_rows(x.data_ptr<float>(), M, K, xq.data(), xd.data());
  const float* XS = xsum.data_ptr<float>();
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  const float* S = scale.data_ptr<float>();
  const float* MN = min.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t per = group / 32;
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* q = Q + r * K / 2;
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xr = xq.data() + m * K;
        const float* dr = xd.data() + m * B;
        __m256 acc = _mm256_setzero_ps();
        float mins = 0.f;
        for (int64_t b = 0; b < B; ++b) {
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + b * 32));
          acc = _mm256_fmadd_ps(dot_u8i8(unpack32(q + b * 16), xv), _mm256_set1_ps(S[r * G + b / per] * dr[b]), acc);
        }
        for (int64_t g = 0; g < G; ++g) mins += MN[r * G + g] * XS[m * G + g];
        O[m * N + r] = hsum(acc) + mins;
      }
    }
  });
  return out;
}

// x [M, K] fp32; qs [N, K/2] uint8; lut [N, K/group, 16] int8 (codebooks rounded to int8);
// lut_scale [N, K/group] fp32 -> [M, N]. One byte shuffle turns 32 codes into their int8
// centroids, then the same integer dot product as q8.
torch::Tensor lut4_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor lut, torch::Tensor lut_scale, int64_t group) {
  const int64_t N = qs.size(0), K = qs.size(1) * 2, M = x.size(0), G = K / group, B = K / 32;
  check(x, qs, K);
  TORCH_CHECK(group % 32 == 0 && K % group == 0 && lut.size(-1) == 16 && lut.scalar_type() == torch::kChar,
              "bad lut4 shapes");
  auto out = torch::empty({M, N}, x.options());
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * B);
  quantize_rows(x.data_ptr<float>(), M, K, xq.data(), xd.data());
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  const int8_t* L = lut.data_ptr<int8_t>();
  const float* LS = lut_scale.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t per = group / 32;
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* q = Q + r * K / 2;
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xr = xq.data() + m * K;
        const float* dr = xd.data() + m * B;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
          const __m256i table = _mm256_broadcastsi128_si256(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(L + (r * G + g) * 16)));
          const float ls = LS[r * G + g];
          for (int64_t b = g * per; b < (g + 1) * per; ++b) {
            __m256i wv = _mm256_shuffle_epi8(table, unpack32(q + b * 16));
            __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + b * 32));
            __m256 d = dot_u8i8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
            acc = _mm256_fmadd_ps(d, _mm256_set1_ps(ls * dr[b]), acc);
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
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0), B = K / 32;
  check(x, q, K);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  auto out = torch::empty({M, N}, x.options());
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * B);
  quantize_rows(x.data_ptr<float>(), M, K, xq.data(), xd.data());
  const int8_t* Q = q.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* w = Q + r * K;
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xr = xq.data() + m * K;
        const float* dr = xd.data() + m * B;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < B; ++b) {
          __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32));
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + b * 32));
          // |w| (unsigned) times x carrying w's sign: maddubs needs one unsigned operand
          __m256 d = dot_u8i8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
          acc = _mm256_fmadd_ps(d, _mm256_set1_ps(dr[b]), acc);
        }
        O[m * N + r] = hsum(acc) * S[r];
      }
    }
  });
  return out;
}

TORCH_LIBRARY(attnlab, m) {
  m.def("q4_mm(Tensor x, Tensor qs, Tensor scale, Tensor min, int group) -> Tensor");
  m.def("lut4_mm(Tensor x, Tensor qs, Tensor lut, Tensor lut_scale, int group) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor q, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("q4_mm", &q4_mm);
  m.impl("lut4_mm", &lut4_mm);
  m.impl("q8_mm", &q8_mm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
