// attend.cpp's single-query attention over one stretch of a cache, by pointers: for the native step
// (step.cpp, the same extension), whose threads each attend to a stretch of the slots. A dispatcher call
// with its tensor views and outputs cost ~10 us per layer, as much as the pass itself at depth 128.
#pragma once
#include <cstdint>

namespace attnlab_attend {

// One layer's cache: k, v [Hkv, capacity, D] with rows `row` elements apart and heads `head` apart, float32
// (dtype 0), float16 (1) or int8 (2, then ks, vs: float32 scales per 32 dimensions, [Hkv, capacity, D / 32]).
struct Cache {
  const void *k, *v;
  const float *ks, *vs;
  int64_t row, head, srow, shead;  // elements between rows / heads of k and v; of ks and vs
  int dtype;
};

// q [Hkv * G, D] -> out [Hkv * G, D] over rows [s0, s1) of c, and each query head's log-sum-exp of its scores.
void stretch(const float* q, const Cache& c, int64_t Hkv, int64_t G, int64_t D, int64_t s0, int64_t s1, float scale,
             float* out, float* lse);

// One KV head's G query heads q [G, D] over the runs of rows [bounds[2i], bounds[2i + 1]) of c (its head 0), i < n,
// as one online softmax -> out [G, D] and lse [G] as stretch gives them: Quest's chosen pages, read without a
// pass, a merge and prefetches past the run for each run (each cost more than the run's rows, measured).
void runs(const float* q, const Cache& c, int64_t G, int64_t D, const int64_t* bounds, int64_t n, float scale,
          float* out, float* lse);

// An int8 cache's rounding of nb blocks of 32 floats X -> codes Q [nb * 32] and scales S [nb] (quantize_kv).
void quantize(const float* X, int64_t nb, int8_t* Q, float* S);

}  // namespace attnlab_attend
