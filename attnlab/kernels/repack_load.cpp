// ---- repacking at load: the layouts of `repack.pack_q4` / `pack_q8` (whose torch forms are the reference)
// built in one pass over the row layout; in torch the permutes and nibble splits took ~70% of a 1B load.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <sys/mman.h>

#include <cstring>

#include "repacked_layout.h"

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
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("repack_q4", &repack_q4), m.impl("repack_q8", &repack_q8), m.impl("repack_q4k", &repack_q4k);
  m.impl("repack_q6k", &repack_q6k);
}
