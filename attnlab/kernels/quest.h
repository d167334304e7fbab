// Quest's page selection for the native decode step (step.cpp), by pointers (Tang et al., ICML 2024; the eager
// reference is attnlab/model/quest.py): per KV head, upper bounds of q.k per page from the page's per-channel key
// min and max, the pages to read within a token budget, and exact attention over them (attend.h's stretch over
// the chosen rows gathered into contiguous chunks, merged by log-sum-exp). The step's threads share the bounds (pages cut in
// stretches) and the reading (each KV head's chosen pages cut in stretches), as they share full attention.
#pragma once
#include <cstdint>

#include "attend.h"

namespace attnlab_quest {

// One layer's page summaries of one conversation: lo, hi [Hkv, capacity pages, D] float16 bits (rounded outward:
// minima down, maxima up, so the bounds stay upper bounds), heads `head` elements apart.
struct Pages {
  uint16_t *lo, *hi;
  int64_t head, size;  // elements between heads; slots per page
  int8_t* keys_t = nullptr;  // CHANNELS > 0: the keys channel-major [Hkv, D, capacity] int8, or null,
  float* keys_s = nullptr;   // times each key's scale [Hkv, capacity] (attnlab.kv.pages.channel_codes)
  int64_t t_head = 0, t_row = 0, s_head = 0;  // elements between heads, between channels; between heads of keys_s
};

// Thread tid of `threads`: its share of pages 1 .. P - 2 (the first and the last are read anyway) of every KV
// head: out[h * ld + p] = max over the group's heads g of sum_c max(q_gc lo_c, q_gc hi_c), q [Hkv * G, D] rotated.
void bound_share(const float* q, const Pages& pg, int64_t Hkv, int64_t G, int64_t D, int64_t P, int64_t tid,
                 int64_t threads, float* out, int64_t ld);

// As bound_share, but a page's score is its best key's approximate q.k (SparQ's step 1 with the group's query summed;
// model/quest.py's channel_scores): per KV head the group's heads' queries summed (in head order), its `channels`
// channels of largest |sum| (ties: the lower channel), and out[h * ld + p] = max over the page's keys of their scale
// times sum . codes on those channels only, read from pg.keys_t (`channels` int8 rows of every key instead of every
// page's min and max).
void score_share(const float* q, const Pages& pg, int64_t Hkv, int64_t G, int64_t D, int64_t P, int64_t channels,
                 int64_t tid, int64_t threads, float* out, int64_t ld);

// The k < P pages to read, ascending: 0 and P - 1, then the k - 2 highest of bounds[1 .. P - 2] (ties: the lower page).
void select(const float* bounds, int64_t P, int64_t k, int64_t* pages);

// Thread tid of `threads`: per KV head, the pages chosen from its bounds (out[h * ld ..], every thread the same
// choice), its share of them (in order: the last thread holds the last page, slots up to n - 1) attended exactly.
// out [Hkv * G, D] and lse [Hkv * G] as attnlab_attend::stretch gives them (lse -inf where the share is empty).
void attend_share(const float* q, const attnlab_attend::Cache& c, const float* bounds, int64_t ld, int64_t Hkv,
                  int64_t G, int64_t D, int64_t P, int64_t k, int64_t page, int64_t n, int64_t tid, int64_t threads,
                  float scale, float* out, float* lse);

// After the keys of the Hkv heads were stored at `slot` of c: their page's min and max follow them, over the keys
// as stored (float16 widened, int8 codes times their scale, as the eager summaries); a slot opening a page starts them.
// Where pg.keys_t is set the key is also written there, column `slot`: int8 codes of key / scale rounded to nearest
// (even), scale = its largest |channel| / 127 in keys_s (attnlab.kv.pages.channel_codes).
void add_key(const Pages& pg, const attnlab_attend::Cache& c, int64_t Hkv, int64_t slot, int64_t D);

}  // namespace attnlab_quest
