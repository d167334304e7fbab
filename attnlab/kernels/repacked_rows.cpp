// The embedding gather over repacked int8 weights (a tied head read as the token table; layout:
// repacked_layout.h).
#include "ops.h"
#include "repacked_layout.h"

// Rows ids [n] of a repacked int8 weight w (q8 layout, K inputs), dequantised -> [n, K] float32: a tied
// head's embedding lookup, one token per decode step, reading 16 * K bytes instead of unpacking a block.
// With KQ (Q6_K superblocks): (c - 32) * (d * sc), the loader's float32 scale times the code, dequantize()'s bits.
attnlab::View attnlab::q8x_rows(const Alloc& alloc, const View& w, const Contig& ids, int64_t K, int64_t group, bool has_min,
                                int64_t fmt) {
  const bool kq = fmt == KQ;
  ATTNLAB_CHECK(fmt == 0 || fmt == HALF || kq, "q8x_rows: layout flags must be 0, HALF (1) or KQ (4), got ", fmt);
  ATTNLAB_CHECK(group > 0 && group % 4 == 0 && K % group == 0, "q8x_rows: group must divide K in fours");
  ATTNLAB_CHECK(!kq || (group == 16 && !has_min && K % 256 == 0), "q8x_rows: KQ needs groups of 16, no min, K of 256s");
  const int64_t G = kq ? K / 256 : K / group, sb = fmt == HALF ? 32 : 64;
  const int64_t stride = kq ? 3360 : group * 16 + sb * (has_min ? 2 : 1);
  ATTNLAB_CHECK(w.scalar_type() == attnlab::kByte && w.is_contiguous() && w.dim() == 3 && w.size(1) == G &&
              w.size(2) == stride, "q8x_rows: w must be contiguous uint8 [blocks, ", G, ", ", stride, "]");
  ATTNLAB_CHECK(ids.scalar_type() == attnlab::kLong && ids.dim() == 1, "q8x_rows: ids must be int64 [n]");
  const View& idc = ids;  // contiguous (Contig)
  const int64_t n = idc.numel(), rows = w.size(0) * 16;
  const int64_t* I = idc.data_ptr<int64_t>();
  auto out = alloc({n, K}, attnlab::kFloat);
  float* O = out.data_ptr<float>();
  const uint8_t* W = w.data_ptr<uint8_t>();
  auto value = [&](const uint8_t* p, int64_t r) {  // 16 per-row floats at p: row r's
    return fmt == HALF ? static_cast<float>(reinterpret_cast<const attnlab::Half*>(p)[r]) : reinterpret_cast<const float*>(p)[r];
  };
  for (int64_t i = 0; i < n; ++i) {
    ATTNLAB_CHECK(I[i] >= 0 && I[i] < rows, "q8x_rows: row ", I[i], " outside the weight's ", rows, " rows");
    const int64_t b = I[i] / 16, r = I[i] % 16;
    for (int64_t g = 0; kq && g < G; ++g) {
      const uint8_t* p = W + (b * G + g) * stride;
      const float d = static_cast<float>(reinterpret_cast<const attnlab::Half*>(p + 3328)[r]);
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
