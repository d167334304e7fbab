// ---- repacking at load: the layouts of `repack.pack_q4` / `pack_q8` (whose torch forms are the reference)
// built in one pass over the row layout; in torch the permutes and nibble splits took ~70% of a 1B load.
#include <cstring>

#include "ops.h"
#include "repacked_layout.h"

using attnlab::Alloc;
using attnlab::Opt;
using attnlab::View;

namespace {

// 16 rows' per-group floats of block b, group g at p: float16 with HALF, else float32; rows past N stay zero.
void put_floats(uint8_t* p, const float* src, int64_t b, int64_t g, int64_t N, int64_t G, bool half) {
  for (int64_t r = 0; r < 16 && 16 * b + r < N; ++r) {
    const float v = src[(16 * b + r) * G + g];
    if (half) reinterpret_cast<attnlab::Half*>(p)[r] = attnlab::Half(v);
    else reinterpret_cast<float*>(p)[r] = v;
  }
}

void check_floats(const View& t, int64_t N, int64_t G, const char* what) {
  ATTNLAB_CHECK(t.scalar_type() == attnlab::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == N && t.size(1) == G,
              what, " must be contiguous float32 [", N, ", ", G, "]");
}


// Zeroed uint8 [NB, G, stride] for repacked weights (bind.cpp: in huge pages where it fills one).
View weight_buffer(const Alloc& alloc, int64_t NB, int64_t G, int64_t stride) {
  return alloc({NB, G, stride}, attnlab::kByte, Alloc::HUGE);
}

}  // namespace

// pack4's codes qs [N, K/2] (byte i of a 32-block: code i low, code i + 16 high) -> the q4 blocks: the two
// layouts share that nibble order, so each 4-byte run of a row moves whole (lane r of chunk j <- bytes 4j..4j+3).
View attnlab::repack_q4(const Alloc& alloc, const View& qs, const View& scale, const View& min, int64_t group, int64_t fmt) {
  ATTNLAB_CHECK(qs.scalar_type() == attnlab::kByte && qs.is_contiguous() && qs.dim() == 2, "qs must be contiguous uint8 [N, K/2]");
  const int64_t N = qs.size(0), K = qs.size(1) * 2;
  ATTNLAB_CHECK(group > 0 && group % 32 == 0 && K % group == 0, "repack_q4: group must be a multiple of 32 dividing K");
  ATTNLAB_CHECK(fmt >= 0 && fmt <= (HALF | SYM), "repack_q4: layout flags must be 0-3");
  const int64_t G = K / group, per = group / 32, NB = (N + 15) / 16, sb = fmt & HALF ? 32 : 64;
  const int64_t stride = per * 256 + sb * (fmt & SYM ? 1 : 2);
  check_floats(scale, N, G, "scale");
  if (!(fmt & SYM)) check_floats(min, N, G, "min");
  auto out = weight_buffer(alloc, NB, G, stride);
  const uint8_t* Q = qs.data_ptr<uint8_t>();
  uint8_t* O = out.data_ptr<uint8_t>();
  attnlab::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
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
View attnlab::repack_q4k(const Alloc& alloc, const View& qs, const View& sc, const View& m, const View& d, const View& dmin) {
  ATTNLAB_CHECK(qs.scalar_type() == attnlab::kByte && qs.is_contiguous() && qs.dim() == 2, "qs must be contiguous uint8 [N, K/2]");
  const int64_t N = qs.size(0), K = qs.size(1) * 2, G = K / 256, NB = (N + 15) / 16, stride = 2368;
  ATTNLAB_CHECK(K % 256 == 0, "repack_q4k: K must be a multiple of 256");
  for (const View* t : {&sc, &m})
    ATTNLAB_CHECK(t->scalar_type() == attnlab::kByte && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                t->size(1) == K / 32, "repack_q4k: sc and m must be contiguous uint8 [", N, ", ", K / 32, "]");
  check_floats(d, N, G, "d");
  check_floats(dmin, N, G, "dmin");
  auto out = weight_buffer(alloc, NB, G, stride);
  const uint8_t *Q = qs.data_ptr<uint8_t>(), *SC = sc.data_ptr<uint8_t>(), *MN = m.data_ptr<uint8_t>();
  uint8_t* O = out.data_ptr<uint8_t>();
  attnlab::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
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
View attnlab::repack_q6k(const Alloc& alloc, const View& q, const View& sc, const View& d) {
  ATTNLAB_CHECK(q.scalar_type() == attnlab::kChar && q.is_contiguous() && q.dim() == 2, "q must be contiguous int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), G = K / 256, NB = (N + 15) / 16, stride = 3360;
  ATTNLAB_CHECK(K % 256 == 0, "repack_q6k: K must be a multiple of 256");
  ATTNLAB_CHECK(sc.scalar_type() == attnlab::kChar && sc.is_contiguous() && sc.dim() == 2 && sc.size(0) == N &&
              sc.size(1) == K / 16, "repack_q6k: sc must be contiguous int8 [", N, ", ", K / 16, "]");
  check_floats(d, N, G, "d");
  auto out = weight_buffer(alloc, NB, G, stride);
  const int8_t *Q = q.data_ptr<int8_t>(), *SC = sc.data_ptr<int8_t>();
  uint8_t* O = out.data_ptr<uint8_t>();
  attnlab::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
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
View attnlab::repack_q8(const Alloc& alloc, const View& q, const View& scale, const Opt& min, int64_t group,
                        int64_t fmt) {
  ATTNLAB_CHECK(q.scalar_type() == attnlab::kChar && q.is_contiguous() && q.dim() == 2, "q must be contiguous int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  ATTNLAB_CHECK(group > 0 && group % 4 == 0 && K % group == 0, "repack_q8: group must divide K in fours");
  ATTNLAB_CHECK(fmt == 0 || fmt == HALF, "repack_q8: layout flags must be 0 or HALF (1)");
  const int64_t G = K / group, NB = (N + 15) / 16, sb = fmt & HALF ? 32 : 64, stride = group * 16 + sb * (min ? 2 : 1);
  check_floats(scale, N, G, "scale");
  if (min) check_floats(*min, N, G, "min");
  auto out = weight_buffer(alloc, NB, G, stride);
  const uint8_t* Q = reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>());
  uint8_t* O = out.data_ptr<uint8_t>();
  attnlab::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
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

// ---- GGUF K-quant blocks decoded at load, in one pass (formats.gguf_q4_k / gguf_q6_k's torch forms are the reference)

// Q4_K blocks [nb, 144] (d, dmin, 12 bytes of 6-bit scales and mins, 128 code bytes) -> codes [nb, 128] in pack4's
// layout (per sub-block of 32, byte j: value j low nibble, value j + 16 high) and the uint8 scales and mins
// [nb, 16] (sc[8] then m[8]: ggml's get_scale_min_k4).
View attnlab::gguf_q4k_codes(const Alloc& alloc, const View& raw) {
  ATTNLAB_CHECK(raw.scalar_type() == attnlab::kByte && raw.is_contiguous() && raw.dim() == 2 && raw.size(1) == 144,
                "gguf_q4k_codes: raw must be contiguous uint8 [blocks, 144]");
  const int64_t nb = raw.size(0);
  View codes = alloc({nb, 128}, attnlab::kByte), scales = alloc({nb, 16}, attnlab::kByte);
  const uint8_t* R = raw.data_ptr<uint8_t>();
  uint8_t *C = codes.data_ptr<uint8_t>(), *S = scales.data_ptr<uint8_t>();
  attnlab::parallel_for(0, nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t *s = R + b * 144 + 4, *q = R + b * 144 + 16;
      uint8_t *c = C + b * 128, *o = S + b * 16;
      for (int u = 0; u < 4; ++u) {
        o[u] = s[u] & 63, o[8 + u] = s[4 + u] & 63;
        o[4 + u] = (s[8 + u] & 15) | ((s[u] >> 2) & 48), o[12 + u] = (s[8 + u] >> 4) | ((s[4 + u] >> 2) & 48);
      }
      for (int ch = 0; ch < 4; ++ch)  // chunk ch of 32 bytes: sub-block 2 ch in the low nibbles, 2 ch + 1 in the high
        for (int j = 0; j < 16; ++j) {
          const uint8_t lo = q[32 * ch + j], hi = q[32 * ch + 16 + j];
          c[32 * ch + j] = (lo & 15) | static_cast<uint8_t>(hi << 4);
          c[32 * ch + 16 + j] = (lo >> 4) | (hi & 0xF0);
        }
    }
  });
  return codes;
}

// Q6_K blocks [nb, 210] (128 bytes of low 4 bits, 64 of high 2 bits, int8 scales[16], d) -> the codes - 32, int8
// [nb, 256] in input order (ggml's dequantize_row_q6_K).
View attnlab::gguf_q6k_codes(const Alloc& alloc, const View& raw) {
  ATTNLAB_CHECK(raw.scalar_type() == attnlab::kByte && raw.is_contiguous() && raw.dim() == 2 && raw.size(1) == 210,
                "gguf_q6k_codes: raw must be contiguous uint8 [blocks, 210]");
  const int64_t nb = raw.size(0);
  View q = alloc({nb, 256}, attnlab::kChar);
  const uint8_t* R = raw.data_ptr<uint8_t>();
  int8_t* Q = q.data_ptr<int8_t>();
  attnlab::parallel_for(0, nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t *ql = R + b * 210, *qh = R + b * 210 + 128;
      int8_t* out = Q + b * 256;
      for (int h = 0; h < 2; ++h)  // halves of 128 values: 64 low-bit bytes and 32 high-bit bytes each
        for (int i = 0; i < 32; ++i) {
          const uint8_t l0 = ql[64 * h + i], l1 = ql[64 * h + 32 + i], hb = qh[32 * h + i];
          out[128 * h + i] = static_cast<int8_t>(((l0 & 15) | ((hb & 3) << 4)) - 32);
          out[128 * h + 32 + i] = static_cast<int8_t>(((l1 & 15) | (((hb >> 2) & 3) << 4)) - 32);
          out[128 * h + 64 + i] = static_cast<int8_t>(((l0 >> 4) | (((hb >> 4) & 3) << 4)) - 32);
          out[128 * h + 96 + i] = static_cast<int8_t>(((l1 >> 4) | (((hb >> 6) & 3) << 4)) - 32);
        }
    }
  });
  return q;
}
