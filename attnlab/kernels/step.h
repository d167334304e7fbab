// The native decode step's state, in plain C++ (step.cpp runs it; bind.cpp registers it as the torch class
// `attnlab::DecodeStep`, keeps the tensors behind its Views alive and turns each linear layer's kernel call into a
// Linear's `run`).
#pragma once
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ops.h"


namespace attnlab_step {

using attnlab::View;

// The team's barrier between the step's phases, its own rather than `omp barrier`: libgomp stops spinning after
// 100 rounds and sleeps whenever the process holds more OpenMP threads than CPUs, which a server always does on
// a 2-core machine (its model thread leads a team beside the main thread's pool): SmolLM2's 2-thread step served
// 86 tok/s against 310 in a script. Spins (pause), then yields the core, so a member that lost it gets it back.
struct SpinBarrier {
  explicit SpinBarrier(int64_t n) : n(n) {}
  void wait() {
    if (n <= 1) return;
    const uint64_t g = gen.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {  // the last one in lets the others go
      arrived.store(0, std::memory_order_relaxed);
      gen.store(g + 1, std::memory_order_release);
      return;
    }
    for (int64_t i = 0; gen.load(std::memory_order_acquire) == g; ++i) {
      if (i < kSpins) _mm_pause();
      else std::this_thread::yield();
    }
  }
  static constexpr int64_t kSpins = 1 << 14;  // ~1 ms of pauses: a phase's partner is usually in within 0.1 ms
  const int64_t n;
  alignas(64) std::atomic<int64_t> arrived{0};
  alignas(64) std::atomic<uint64_t> gen{0};
};

// y [M, rows] = x [M, K] W[rows]^T (+ b[rows]) for one segment of a linear layer's output rows [row0, row0 + rows),
// run by team thread `thread`: `run(x, M, K)` is the layer's kernel (bind.cpp: a dispatcher call, or at::linear),
// returning y, which stays valid until the segment runs again.
struct Linear {
  int64_t row0 = 0, rows = 0, thread = 0;
  std::function<const float*(const float* x, int64_t M, int64_t K)> run;
};

struct Step {
  int64_t dim, n_heads, n_kv, head_dim, hidden, threads;
  double eps, scale;
  View embed_w, embed_scale;  // float32 [V, dim], or int8 codes [V, dim] with scales [V, dim / group]
  int64_t embed_group = 0;
  std::vector<View> norms;    // attn_norm, mlp_norm per layer, then the final norm
  std::vector<std::vector<Linear>> linears;  // wqkv, wo, w13, w2 per layer, then the head: segments in row order
  struct Bound {  // one conversation's cache: per-layer buffers (Quest's page summaries where it keeps them)
    std::vector<View> k, v, k_scale, v_scale, pos, page_min, page_max, keys_t, keys_s;
    int64_t page = 0;
  };
  int64_t quest_budget = 0, quest_dense = 0, quest_channels = 0;  // Quest: tokens read per step (0: all), layers before quest_dense read all
  std::vector<Bound> bound;  // the caches of a batch: row r reads bound[seqs[r]] (llama_batch's sequence id)
  // Phase timings when profiling (`profile(true)`): seconds per thread and phase of its own work ("busy"), and
  // of the phase until its barrier released thread 0 ("wall"), summed over the calls since.
  static constexpr const char* kPhases[] = {"wqkv", "attention", "wo", "w13", "silu", "w2", "head"};
  static constexpr int kNPhases = 7;
  bool profiling = false;
  std::vector<double> busy, wall;
  int64_t profiled = 0;

  Step(int64_t dim, int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t hidden, double eps, int64_t threads);
  static bool openmp();
  std::vector<std::pair<std::string, std::vector<double>>> profile(bool on);
  void set_embedding(const View& w, const View& scale, int64_t group);
  void add_norm(const View& w);
  // opens the next layer where row0 == 0; checks the segment's place (bind.cpp fills in its kernel)
  Linear& add_linear(int64_t row0, int64_t rows, int64_t thread);
  void bind_rows(int64_t row, std::vector<View> k, std::vector<View> v, std::vector<View> ks, std::vector<View> vs,
                 std::vector<View> pos);
  void bind_pages(int64_t row, int64_t page, std::vector<View> lo, std::vector<View> hi, std::vector<View> keys_t,
                  std::vector<View> keys_s);
  void set_quest(int64_t budget, int64_t dense, int64_t channels);
  // the logits' vocabulary (the head's rows): run_batch writes [outs, vocab] into logits
  int64_t vocab() const;
  void run_batch(const std::vector<int64_t>& tokens, const std::vector<int64_t>& slots,
                 const std::vector<int64_t>& positions, const std::vector<int64_t>& firsts, const View& rots,
                 const View& embedded, const std::vector<int64_t>& seqs, const std::vector<int64_t>& outs,
                 float* logits);

 private:
  struct Buffers;
  struct Rows;
  std::pair<int64_t, int64_t> quest_pages(const Rows& rows, int64_t r, int64_t l) const;
  void body(Buffers& b, int64_t tid, const Rows& rows, std::atomic<bool>& failed, std::exception_ptr& error);
  void linear(size_t i, int64_t tid, const float* x, int64_t K, int64_t B, float* out, int64_t N, bool accumulate) const;
  void attend_stretch(Buffers& b, const Bound& c, int64_t l, int64_t tid, int64_t r, int64_t first, int64_t n,
                      const float* q);
  void merge(const Buffers& b, int64_t r, float* o) const;
  void write_kv(Bound& c, int64_t l, int64_t slot, int64_t position, const float* K, const float* V);
};

}  // namespace attnlab_step
