// The layout of weights repacked into 16-row blocks (`attnlab.kernels.repack`), shared by the matvecs
// (repacked.cpp), the embedding gather (repacked_rows.cpp) and the load-time repacking (repack_load.cpp).
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
#pragma once
#include <cstdint>

namespace {
constexpr int64_t HALF = 1, SYM = 2, KQ = 4;  // layout flags (`repack.HALF`, `repack.SYM`, `repack.KQ`)
}  // namespace
