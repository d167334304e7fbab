// The decode step of a Llama-family network in one native call (`attnlab::DecodeStep`; state: step.h, torch class: bind.cpp): one token each for B
// conversations, every one over its own cache (continuous batching; B = 1 is the single-stream step).
//
// Why: a decode step of SmolLM2-135M is ~150 kernel calls of a few microseconds to a millisecond
// each. Run from Python, or from a compiled graph with ~500 tensor inputs, the glue between them
// (dispatch, argument lists, guards) is serial work a second thread cannot share. This class holds,
// once, every tensor the step reads (weights, norms, the cache's buffers) and each linear layer's
// kernel call, and runs embed -> layers -> norm -> head in C++. The heavy ops are called through the
// dispatcher by name (`QuantLinear.kernel()`: op name + its packed operands; attend.cpp's
// decode_attention and quantize_kv), so it never assumes a weight layout and follows whatever
// kernel variant the extension was built with. The elementwise glue (RMSNorm, RoPE, the cache write,
// SiLU, residuals) is a few thousand numbers per layer: plain loops, cheaper than an op call each.
//
// Threads: one team for the whole step (an OpenMP parallel region per call, not one per kernel). Each
// linear layer arrives cut into segments of output rows, each given to one thread
// (`QuantLinear.kernel(rows=...)`): one per thread, or, for a layer whose parts keep different formats
// (a Q4_K q/k beside a Q6_K v), one per thread and part, so each part keeps its own kernel and every
// thread gets a share of every part. Each thread runs its segments' kernels (on one thread:
// at::parallel_for runs inline in a parallel region) and writes their rows; attention is cut along the
// cache (each thread one stretch of the slots, merged by log-sum-exp, as flash-decoding does); the
// elementwise glue runs on one thread or is shared. Barriers separate the phases: ~6 per layer, against
// a fork/join per kernel call before (~150 per step).
//
// Batching: the linear phases run on the B activation rows together, so each weight is read once per step for
// every conversation (the quantized kernels' M = B path, the one prefill uses); RoPE, the K/V write and attention
// run per row over that row's own bound cache (`bind_rows`: its own capacity, dtype and length, nothing padded).
//
// The Python side (`attnlab/model/native.py`) decides which steps come here (one token per conversation, no
// padding, float32 activations, float32 / float16 / int8 caches) and keeps the caches' bookkeeping
// (positions, growth, eviction) around the call.
#ifdef _OPENMP
#include <omp.h>
#endif

#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <string>
#include <vector>

#include "attend.h"
#include "kernels_simd.h"
#include "quest.h"
#include "step.h"

using attnlab::View;
using attnlab_step::Step;

namespace {

using attnlab_simd::rms_norm;

// Rotate `heads` heads of size D in place by (cos, sin) pairs [D/2, 2] (pairs of adjacent dimensions).
void rope(float* x, const float* rot, int64_t heads, int64_t D) {
  for (int64_t h = 0; h < heads; ++h, x += D)
    for (int64_t i = 0; i < D / 2; ++i) {
      const float x0 = x[2 * i], x1 = x[2 * i + 1], c = rot[2 * i], s = rot[2 * i + 1];
      x[2 * i] = x0 * c - x1 * s;
      x[2 * i + 1] = x0 * s + x1 * c;
    }
}

void add(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// Layer l of a bound cache, by pointers (attend.h), and its page summaries (quest.h).
attnlab_attend::Cache cache_of(const Step::Bound& c, int64_t l) {
  const View &K = c.k[l], &V = c.v[l];
  const bool int8 = !c.k_scale.empty();
  const int dtype = K.scalar_type() == attnlab::kFloat ? 0 : K.scalar_type() == attnlab::kHalf ? 1 : 2;
  return {K.data_ptr(), V.data_ptr(), int8 ? c.k_scale[l].data_ptr<float>() : nullptr,
          int8 ? c.v_scale[l].data_ptr<float>() : nullptr, K.stride(2), K.stride(1),
          int8 ? c.k_scale[l].stride(2) : 0, int8 ? c.k_scale[l].stride(1) : 0, dtype};
}
attnlab_quest::Pages pages_of(const Step::Bound& c, int64_t l) {
  attnlab_quest::Pages pg{static_cast<uint16_t*>(c.page_min[l].data_ptr()),
                          static_cast<uint16_t*>(c.page_max[l].data_ptr()), c.page_min[l].stride(1), c.page};
  if (!c.keys_t.empty())
    pg.keys_t = c.keys_t[l].data_ptr<int8_t>(), pg.t_head = c.keys_t[l].stride(1), pg.t_row = c.keys_t[l].stride(2),
    pg.keys_s = c.keys_s[l].data_ptr<float>(), pg.s_head = c.keys_s[l].stride(1);
  return pg;
}

}  // namespace

constexpr const char* Step::kPhases[];

Step::Step(int64_t dim, int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t hidden, double eps, int64_t threads)
    : dim(dim), n_heads(n_heads), n_kv(n_kv), head_dim(head_dim), hidden(hidden), threads(threads), eps(eps),
      scale(1.0 / std::sqrt(static_cast<double>(head_dim))) {
  ATTNLAB_CHECK(threads >= 1 && (threads == 1 || openmp()), "threads must be >= 1 (1 in a build without OpenMP)");
}

// Start (or stop) timing the phases; returns {phase: [wall, busy thread 0, busy thread 1, ...]} in seconds
// per step, averaged over the steps since the last call.
std::vector<std::pair<std::string, std::vector<double>>> Step::profile(bool on) {
  std::vector<std::pair<std::string, std::vector<double>>> out;
  for (int p = 0; p < kNPhases && profiled; ++p) {
    std::vector<double> row{wall[p] / profiled};
    for (int64_t t = 0; t < threads; ++t) row.push_back(busy[t * kNPhases + p] / profiled);
    out.emplace_back(kPhases[p], row);
  }
  profiling = on, profiled = 0;
  busy.assign(threads * kNPhases, 0.0), wall.assign(kNPhases, 0.0);
  return out;
}

bool Step::openmp() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

void Step::set_embedding(const View& w, const View& scale, int64_t group) {
  ATTNLAB_CHECK(w.dim() == 2 && w.size(1) == dim && w.is_contiguous(), "embedding must be contiguous [V, dim]");
  ATTNLAB_CHECK(scale ? w.scalar_type() == attnlab::kChar && group > 0 && dim % group == 0 && scale.is_contiguous()
                      : w.scalar_type() == attnlab::kFloat, "embedding: float32 rows, or int8 codes with scales");
  embed_w = w, embed_scale = scale, embed_group = group;
}

void Step::add_norm(const View& w) {
  ATTNLAB_CHECK(w.scalar_type() == attnlab::kFloat && w.numel() == dim && w.is_contiguous(), "norm weight: float32 [dim]");
  norms.push_back(w);
}

// One segment of a linear layer: output rows [row0, row0 + rows), run by team thread `thread` (row0 == 0
// starts the next layer).
attnlab_step::Linear& Step::add_linear(int64_t row0, int64_t rows, int64_t thread) {
  ATTNLAB_CHECK(row0 >= 0 && rows > 0, "rows of a segment: row0 >= 0, rows > 0");
  ATTNLAB_CHECK(thread >= 0 && thread < threads, "thread ", thread, " of a team of ", threads);
  if (row0 == 0) linears.emplace_back();
  ATTNLAB_CHECK(!linears.empty() &&
                (linears.back().empty() ? row0 == 0 : row0 == linears.back().back().row0 + linears.back().back().rows),
                "segments of a layer come in row order, each starting where the last ended");
  Linear l;
  l.row0 = row0, l.rows = rows, l.thread = thread;
  linears.back().push_back(std::move(l));
  return linears.back().back();
}

// Conversation b's cache buffers per layer (row b of the next batches): k, v [1, Hkv, C, D] float32 / float16 /
// int8, pos [1, Hkv, C] int64, and for int8 the scales [1, Hkv, C, D/32] float32 (empty lists otherwise).
void Step::bind_rows(int64_t row, std::vector<View> k_, std::vector<View> v_, std::vector<View> ks,
                     std::vector<View> vs, std::vector<View> p) {
  ATTNLAB_CHECK(row >= 0 && row <= static_cast<int64_t>(bound.size()), "bind rows in order: row ", row, " after ",
                bound.size());
  const size_t L = norms.size() / 2;
  ATTNLAB_CHECK(k_.size() == L && v_.size() == L && p.size() == L, "one k, v and pos buffer per layer");
  const auto dt = k_[0].scalar_type();
  ATTNLAB_CHECK(dt == attnlab::kFloat || dt == attnlab::kHalf || dt == attnlab::kChar,
                "cache dtype must be float32, float16 or int8");
  ATTNLAB_CHECK(dt == attnlab::kChar ? ks.size() == L && vs.size() == L : ks.empty() && vs.empty(),
                "an int8 cache binds its scales, no other does");
  for (size_t i = 0; i < L; ++i) {
    for (const View* t : {&k_[i], &v_[i]})
      ATTNLAB_CHECK(t->dim() == 4 && t->size(0) == 1 && t->size(1) == n_kv && t->size(3) == head_dim &&
                        t->scalar_type() == dt && t->is_contiguous() && t->sizes() == k_[i].sizes(),
                    "cache buffers: contiguous [1, Hkv, C, D], k and v alike");
    ATTNLAB_CHECK(p[i].scalar_type() == attnlab::kLong && p[i].is_contiguous() && p[i].size(2) == k_[i].size(2),
                  "pos: int64 [1, Hkv, C]");
    if (dt == attnlab::kChar)
      ATTNLAB_CHECK(ks[i].is_contiguous() && vs[i].is_contiguous() && ks[i].dim() == 4 && ks[i].size(1) == n_kv &&
                        ks[i].size(2) == k_[i].size(2) && ks[i].size(3) == head_dim / 32 &&
                        vs[i].sizes() == ks[i].sizes() && ks[i].scalar_type() == attnlab::kFloat &&
                        vs[i].scalar_type() == attnlab::kFloat,
                    "scales: contiguous float32 [1, Hkv, C, D/32], k and v alike");
  }
  if (row == static_cast<int64_t>(bound.size())) bound.emplace_back();
  bound[row] = Bound{std::move(k_), std::move(v_), std::move(ks), std::move(vs), std::move(p), {}, {}, {}, {}, 0};
}

// Quest's page summaries of bound row b's cache per layer (after its bind_rows): lo, hi contiguous float16
// [1, Hkv, capacity / page rounded up, D]; the step reads them to select pages and keeps them up to date.
// keys_t, keys_s: none, or per layer the keys channel-major, contiguous int8 [1, Hkv, D, capacity], and each key's
// scale, contiguous float32 [1, Hkv, capacity] (Quest's CHANNELS).
void Step::bind_pages(int64_t row, int64_t page, std::vector<View> lo, std::vector<View> hi, std::vector<View> keys_t,
                      std::vector<View> keys_s) {
  ATTNLAB_CHECK(row >= 0 && row < static_cast<int64_t>(bound.size()), "bind_pages after bind_rows of row ", row);
  Bound& c = bound[row];
  ATTNLAB_CHECK(page > 0 && lo.size() == c.k.size() && hi.size() == c.k.size(), "one page_min and page_max per layer");
  for (size_t i = 0; i < lo.size(); ++i)
    for (const View* t : {&lo[i], &hi[i]})
      ATTNLAB_CHECK(t->scalar_type() == attnlab::kHalf && t->is_contiguous() && t->dim() == 4 && t->size(1) == n_kv &&
                        t->size(3) == head_dim && t->size(2) * page >= c.k[i].size(2),
                    "page summaries: contiguous float16 [1, Hkv, capacity / page, D]");
  ATTNLAB_CHECK((keys_t.empty() || keys_t.size() == c.k.size()) && keys_s.size() == keys_t.size(),
                "keys_t and keys_s: none or one each per layer");
  for (size_t i = 0; i < keys_t.size(); ++i) {
    ATTNLAB_CHECK(keys_t[i].scalar_type() == attnlab::kChar && keys_t[i].is_contiguous() && keys_t[i].dim() == 4 &&
                      keys_t[i].size(1) == n_kv && keys_t[i].size(2) == head_dim && keys_t[i].size(3) == c.k[i].size(2),
                  "keys_t: contiguous int8 [1, Hkv, D, capacity]");
    ATTNLAB_CHECK(keys_s[i].scalar_type() == attnlab::kFloat && keys_s[i].is_contiguous() && keys_s[i].dim() == 3 &&
                      keys_s[i].size(1) == n_kv && keys_s[i].size(2) == c.k[i].size(2),
                  "keys_s: contiguous float32 [1, Hkv, capacity]");
  }
  c.page_min = std::move(lo), c.page_max = std::move(hi), c.keys_t = std::move(keys_t), c.keys_s = std::move(keys_s);
  c.page = page;
}

// Quest for the next calls: each step reads `budget` tokens of a row with page summaries (whole pages: the
// first, the most recent, the highest bounds), from layer `dense` on; budget 0 reads every slot. channels > 0:
// pages ranked by their best key's q.k on that many channels (rows bound with keys_t), not by the bound.
void Step::set_quest(int64_t budget, int64_t dense, int64_t channels) {
  ATTNLAB_CHECK(budget >= 0 && dense >= 0 && channels >= 0 && channels <= head_dim,
                "quest budget and dense layers must be >= 0, channels in 0 .. head size");
  quest_budget = budget, quest_dense = dense, quest_channels = channels;
}

int64_t Step::vocab() const {
  ATTNLAB_CHECK(!linears.empty() && !linears.back().empty(), "step not built");
  return linears.back().back().row0 + linears.back().back().rows;
}

struct Step::Buffers {  // [B, ..]: shared by the team, one row per conversation; [threads, B, ..]: per thread
  int64_t B;
  attnlab::Scratch<float> x, qkv, gu, act;
  float* logits;
  attnlab::Scratch<float> h, o, qk, part, lse;  // per thread: normed inputs and merged attention, each row's rotated q and
                                           // k, each row's stretch out + lse
  attnlab::Scratch<float> bounds;               // Quest: [B, Hkv, most pages] upper bounds, shared
  int64_t most = 0;
  SpinBarrier* barrier = nullptr;               // between phases (see SpinBarrier)
};
struct Step::Rows {  // what differs per row
  int64_t n;
  const int64_t *slot, *position, *first, *seq;
  const float* rot;  // [n, D/2, 2]
  const std::vector<int64_t>* outs;  // the rows whose logits are made, ascending
  bool chained;  // some rows share a cache
};

// B rows, one token each: row r's token at slot slots[r] (absolute position positions[r]) of cache seqs[r] (a
// bound cache), attending to slots [firsts[r], slots[r]] of it. Rows of one cache (a verification row's tokens:
// consecutive slots, in order) are each a decode step over the slots before them, written in row order. rots: the
// rows' RoPE rows as (cos, sin) pairs [B, D/2, 2] float32; embedded: the tokens' embedding rows [B, dim] float32
// where no table was set (a head repacked by the kernels looks its rows up in Python, see
// `QuantLinear.embed_rows`). Writes the logits of rows outs (ascending) [outs, vocab]: only the rows asked for.
void Step::run_batch(const std::vector<int64_t>& tokens, const std::vector<int64_t>& slots,
                     const std::vector<int64_t>& positions, const std::vector<int64_t>& firsts, const View& rots,
                     const View& embedded, const std::vector<int64_t>& seqs, const std::vector<int64_t>& outs,
                     float* logits) {
  const int64_t L = static_cast<int64_t>(norms.size() / 2), B = static_cast<int64_t>(tokens.size());
  ATTNLAB_CHECK(L > 0 && static_cast<int64_t>(linears.size()) == 4 * L + 1, "step not built");
  ATTNLAB_CHECK(B >= 1 && static_cast<int64_t>(slots.size()) == B && static_cast<int64_t>(positions.size()) == B &&
                static_cast<int64_t>(firsts.size()) == B && static_cast<int64_t>(seqs.size()) == B,
                "one token, slot, position, first and cache per row");
  for (size_t j = 0; j < outs.size(); ++j)
    ATTNLAB_CHECK(outs[j] >= 0 && outs[j] < B && (j == 0 || outs[j] > outs[j - 1]), "outs: ascending rows of the batch");
  ATTNLAB_CHECK(embedded ? embedded.scalar_type() == attnlab::kFloat && embedded.is_contiguous() &&
                           embedded.numel() == B * dim
                         : embed_w.defined(), "no embedding table: pass the tokens' embedding rows, float32 [B, dim]");
  std::vector<char> seen(bound.size(), 0);
  bool chained = false;  // some rows share a cache
  for (int64_t r = 0; r < B; ++r) {
    ATTNLAB_CHECK(seqs[r] >= 0 && seqs[r] < static_cast<int64_t>(bound.size()) && !bound[seqs[r]].k.empty(),
                  "row ", r, ": cache ", seqs[r], " not bound");
    chained |= seen[seqs[r]], seen[seqs[r]] = 1;
    ATTNLAB_CHECK(slots[r] >= 0 && slots[r] < bound[seqs[r]].k[0].size(2) && firsts[r] >= 0 && firsts[r] <= slots[r],
                  "row ", r, ": slot outside its cache");
    ATTNLAB_CHECK(embedded || (tokens[r] >= 0 && tokens[r] < embed_w.size(0)), "row ", r, ": token id out of range");
  }
  ATTNLAB_CHECK(rots.scalar_type() == attnlab::kFloat && rots.is_contiguous() && rots.numel() == B * head_dim,
                "rots: float32 (cos, sin) [B, D/2, 2]");
  const int64_t HD = n_heads * head_dim;
  Buffers b{B, attnlab::Scratch<float>(B * dim), attnlab::Scratch<float>(B * (n_heads + 2 * n_kv) * head_dim),
            attnlab::Scratch<float>(B * 2 * hidden), attnlab::Scratch<float>(B * hidden), logits,
            attnlab::Scratch<float>(threads * B * dim), attnlab::Scratch<float>(threads * B * HD),
            attnlab::Scratch<float>(threads * B * (n_heads + n_kv) * head_dim), attnlab::Scratch<float>(threads * B * HD),
            attnlab::Scratch<float>(threads * B * n_heads), {}, 0};
  int64_t most = 0;  // Quest: the most pages of a row, the bounds' row length
  for (int64_t r = 0; r < B && quest_budget; ++r) {
    const Bound& c = bound[seqs[r]];
    if (!c.page) continue;
    ATTNLAB_CHECK(c.page_min[0].size(2) * c.page > slots[r], "row ", r, ": page summaries smaller than its cache");
    ATTNLAB_CHECK(!quest_channels || !c.keys_t.empty(), "row ", r, ": quest channels need its keys_t bound");
    most = std::max(most, slots[r] / c.page + 1);
  }
  if (most) b.bounds.resize(B * n_kv * most), b.most = most;
  float* X = b.x.data();
  for (int64_t r = 0; r < B; ++r, X += dim) {
    const int64_t token = tokens[r];
    if (embedded) {
      std::copy_n(embedded.data_ptr<float>() + r * dim, dim, X);
    } else if (embed_scale.defined()) {
      const int8_t* q = embed_w.data_ptr<int8_t>() + token * dim;
      const float* s = embed_scale.data_ptr<float>() + token * (dim / embed_group);
      for (int64_t i = 0; i < dim; ++i) X[i] = static_cast<float>(q[i]) * s[i / embed_group];
    } else {
      std::copy_n(embed_w.data_ptr<float>() + token * dim, dim, X);
    }
  }
  const Rows rows{B, slots.data(), positions.data(), firsts.data(), seqs.data(), rots.data_ptr<float>(), &outs, chained};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  SpinBarrier barrier(threads);
  b.barrier = &barrier;
  if (threads == 1) {
    body(b, 0, rows, failed, error);
  } else {
#ifdef _OPENMP
    bool short_team = false;
#pragma omp parallel num_threads(threads)
    {
      // every slice of the step is some thread's, and the barrier counts `threads`: a smaller team (the step
      // called inside another parallel region) does nothing rather than wait forever
      if (omp_get_num_threads() == threads) body(b, omp_get_thread_num(), rows, failed, error);
      else short_team = true;
    }
    ATTNLAB_CHECK(!short_team, "the step's team of ", threads, " threads did not start (called inside a parallel region?)");
#endif
  }
  if (error) std::rethrow_exception(error);
  profiled += profiling;
}

// Quest's pages of row r in layer l: (pages P, pages read k), k = 0 where it reads every slot.
std::pair<int64_t, int64_t> Step::quest_pages(const Rows& rows, int64_t r, int64_t l) const {
  const Bound& c = bound[rows.seq[r]];
  if (!quest_budget || !c.page || l < quest_dense || rows.first[r] != 0) return {0, 0};
  const int64_t P = rows.slot[r] / c.page + 1, k = quest_budget / c.page;
  return {P, P > k && k >= 2 ? k : 0};
}

// The step as thread tid of a team of `threads` (alone: tid 0 of 1). Phases are separated by barriers
// (SpinBarrier; a team of one passes them at once); after an error every thread still reaches every barrier,
// doing no more work, so the team never waits forever.
void Step::body(Buffers& b, int64_t tid, const Rows& rows, std::atomic<bool>& failed, std::exception_ptr& error) {
  const int64_t L = static_cast<int64_t>(norms.size() / 2), D = head_dim, HD = n_heads * D, B = rows.n;
  const int64_t QKV_N = (n_heads + 2 * n_kv) * D, QK_N = (n_heads + n_kv) * D;
  using clock = std::chrono::steady_clock;
  auto phase = [&](int id, auto&& work) {
    const auto t0 = profiling ? clock::now() : clock::time_point();
    if (!failed.load(std::memory_order_relaxed)) {
      try {
        work();
      } catch (...) {
#pragma omp critical(attnlab_step_error)
        if (!failed.exchange(true)) error = std::current_exception();
      }
    }
    if (profiling) busy[tid * kNPhases + id] += std::chrono::duration<double>(clock::now() - t0).count();
    b.barrier->wait();
    if (profiling && tid == 0) wall[id] += std::chrono::duration<double>(clock::now() - t0).count();
  };
  float* X = b.x.data();
  float* QKV = b.qkv.data();
  float* GU = b.gu.data();
  float* A = b.act.data();
  float* H = b.h.data() + tid * B * dim;
  float* O = b.o.data() + tid * B * HD;
  auto qk = [&](int64_t r) { return b.qk.data() + (tid * B + r) * QK_N; };
  auto norm_rows = [&](const View& w) {  // every thread its own copy of the B normed rows
    for (int64_t r = 0; r < B; ++r) rms_norm(X + r * dim, w.data_ptr<float>(), H + r * dim, dim, eps);
  };
  for (int64_t l = 0; l < L; ++l) {
    phase(0, [&] {
      norm_rows(norms[2 * l]);
      linear(4 * l, tid, H, dim, B, QKV, QKV_N, false);  // [B, (Hq + 2 Hkv) D]: q heads, k heads, v heads
    });
    // RoPE, the K/V write and attention in one phase (a barrier fewer per layer, no thread idle while one
    // rotates): every thread rotates its own copy of q, and the last one, whose stretch holds the new slot
    // (and alone reads it), rotates k and writes the slot before attending
    // Quest: a row that selects pages computes, in this phase, its share of the pages' bounds instead, and
    // reads its pages after a barrier (every thread then sees every bound)
    // Rows of one cache in a team (a verification row's tokens): another thread's stretch of a later row may hold
    // an earlier row's new slot, so the last thread writes every row's slot first, a barrier before any attends.
    bool selecting = false;  // the same on every thread: a phase more (its barrier) or not
    for (int64_t r = 0; r < B; ++r) selecting |= quest_pages(rows, r, l).second > 0;
    const bool write_first = threads > 1 && rows.chained;
    auto rotate = [&](int64_t r, bool write) {  // row r's q (and, on the last thread, k: adjacent) rotated
      const bool last = tid == threads - 1;
      const int64_t heads = last ? n_heads + n_kv : n_heads;
      float* Q = qk(r);
      const float* row = QKV + r * QKV_N;
      std::copy_n(row, heads * D, Q);
      rope(Q, rows.rot + r * D, heads, D);
      if (last && write) write_kv(bound[rows.seq[r]], l, rows.slot[r], rows.position[r], Q + HD, row + HD + n_kv * D);
    };
    if (write_first) phase(1, [&] {
      for (int64_t r = 0; r < B; ++r) rotate(r, true);
    });
    phase(1, [&] {
      for (int64_t r = 0; r < B; ++r) {
        if (!write_first) rotate(r, true);
        float* Q = qk(r);
        Bound& c = bound[rows.seq[r]];
        const auto [P, k] = quest_pages(rows, r, l);
        if (!k) {
          attend_stretch(b, c, l, tid, r, rows.first[r], rows.slot[r] + 1, Q);
          continue;
        }
        float* scores = b.bounds.data() + r * n_kv * b.most;
        if (quest_channels)
          attnlab_quest::score_share(Q, pages_of(c, l), n_kv, n_heads / n_kv, D, P, quest_channels, tid,
                                     threads, scores, b.most);
        else
          attnlab_quest::bound_share(Q, pages_of(c, l), n_kv, n_heads / n_kv, D, P, tid, threads, scores,
                                     b.most);
      }
    });
    if (selecting) phase(1, [&] {
      for (int64_t r = 0; r < B; ++r) {
        const auto [P, k] = quest_pages(rows, r, l);
        if (!k) continue;
        const Bound& c = bound[rows.seq[r]];
        attnlab_quest::attend_share(qk(r), cache_of(c, l), b.bounds.data() + r * n_kv * b.most, b.most, n_kv,
                                    n_heads / n_kv, D, P, k, c.page, rows.slot[r] + 1, tid, threads,
                                    static_cast<float>(scale), b.part.data() + (tid * B + r) * HD,
                                    b.lse.data() + (tid * B + r) * n_heads);
      }
    });
    phase(2, [&] {
      for (int64_t r = 0; r < B; ++r) merge(b, r, O + r * HD);
      linear(4 * l + 1, tid, O, HD, B, X, dim, true);
    });
    phase(3, [&] {
      norm_rows(norms[2 * l + 1]);
      linear(4 * l + 2, tid, H, dim, B, GU, 2 * hidden, false);  // [B, 2 hidden]: gate, then up
    });
    phase(4, [&] {  // SiLU(gate) x up, 8 at a time, in slices of 8 per thread
      const int64_t i0 = hidden / 8 * tid / threads * 8, i1 = tid + 1 == threads ? hidden : hidden / 8 * (tid + 1) / threads * 8;
      for (int64_t r = 0; r < B; ++r) attnlab_simd::silu_mul_row(GU + r * 2 * hidden, A + r * hidden, i0, i1, hidden);
    });
    phase(5, [&] { linear(4 * l + 3, tid, A, hidden, B, X, dim, true); });
  }
  phase(6, [&] {  // the rows that want logits only, side by side
    const auto& outs = *rows.outs;
    const int64_t n = static_cast<int64_t>(outs.size());
    for (int64_t j = 0; j < n; ++j) rms_norm(X + outs[j] * dim, norms[2 * L].data_ptr<float>(), H + j * dim, dim, eps);
    if (n) linear(4 * L, tid, H, dim, n, b.logits, vocab(), false);
  });
}

// Thread tid's segments of linear i over the B rows of x [B, K]: out[r, rows] = (or +=) x[r] W[rows]^T (+ b[rows]),
// each segment at its own rows; out's rows are N apart.
void Step::linear(size_t i, int64_t tid, const float* x, int64_t K, int64_t B, float* out, int64_t N,
                  bool accumulate) const {
  for (const Linear& seg : linears[i]) {
    if (seg.thread != tid) continue;
    const float* Y = seg.run(x, B, K);  // [B, seg.rows]
    for (int64_t r = 0; r < B; ++r, Y += seg.rows) {
      float* o = out + r * N + seg.row0;
      if (accumulate) add(o, Y, seg.rows);
      else std::copy_n(Y, seg.rows, o);
    }
  }
}

// Thread tid's stretch of the cache slots [first, n) for the rotated queries q: its attention output and
// log-sum-exp per query head. The last thread's stretch ends at the new slot n - 1 (the others' before it).
void Step::attend_stretch(Buffers& b, const Bound& c, int64_t l, int64_t tid, int64_t r, int64_t first, int64_t n,
                          const float* q) {
  const int64_t s0 = first + (n - first) * tid / threads, s1 = first + (n - first) * (tid + 1) / threads;
  float* lse = b.lse.data() + (tid * b.B + r) * n_heads;
  if (s1 <= s0) {
    std::fill_n(lse, n_heads, -INFINITY);
    return;
  }
  attnlab_attend::stretch(q, cache_of(c, l), n_kv, n_heads / n_kv, head_dim, s0, s1, static_cast<float>(scale),
                          b.part.data() + (tid * b.B + r) * n_heads * head_dim, lse);
}

// Row r's stretch outputs merged per query head, weighted by e^(lse_t - max lse) (every thread, into its own o).
void Step::merge(const Buffers& b, int64_t r, float* o) const {
  const int64_t D = head_dim, B = b.B;
  const float* part = b.part.data() + r * n_heads * D;  // thread t's row r at t * B * n_heads * D
  const float* lse = b.lse.data() + r * n_heads;
  if (threads == 1) {
    std::copy_n(part, n_heads * D, o);
    return;
  }
  for (int64_t g = 0; g < n_heads; ++g) {
    float top = -INFINITY, total = 0.f;
    for (int64_t t = 0; t < threads; ++t) top = std::max(top, lse[t * B * n_heads + g]);
    std::fill_n(o + g * D, D, 0.f);
    for (int64_t t = 0; t < threads; ++t) {
      if (lse[t * B * n_heads + g] == -INFINITY) continue;
      const float w = std::exp(lse[t * B * n_heads + g] - top);
      total += w;
      const float* p = part + (t * B * n_heads + g) * D;
      for (int64_t d = 0; d < D; ++d) o[g * D + d] += w * p[d];
    }
    for (int64_t d = 0; d < D; ++d) o[g * D + d] /= total;
  }
}

// The new key (already rotated) and value into layer l's slot, in the cache's dtype, as LayerKV.update stores them.
void Step::write_kv(Bound& c, int64_t l, int64_t slot, int64_t position, const float* K, const float* V) {
  const int64_t C = c.k[l].size(2), D = head_dim;
  int64_t* P = c.pos[l].data_ptr<int64_t>();
  for (int64_t h = 0; h < n_kv; ++h) P[h * C + slot] = position;
  switch (c.k[l].scalar_type()) {
    case attnlab::kFloat:
      for (int64_t h = 0; h < n_kv; ++h) {
        std::copy_n(K + h * D, D, c.k[l].data_ptr<float>() + (h * C + slot) * D);
        std::copy_n(V + h * D, D, c.v[l].data_ptr<float>() + (h * C + slot) * D);
      }
      break;
    case attnlab::kHalf:
      for (int64_t h = 0; h < n_kv; ++h) {
        attnlab::Half* kd = c.k[l].data_ptr<attnlab::Half>() + (h * C + slot) * D;
        attnlab::Half* vd = c.v[l].data_ptr<attnlab::Half>() + (h * C + slot) * D;
        for (int64_t i = 0; i < D; ++i) kd[i] = attnlab::Half(K[h * D + i]), vd[i] = attnlab::Half(V[h * D + i]);
      }
      break;
    default:  // int8 codes + a scale per 32 dimensions: attend.cpp's quantize_kv, bit for bit the cache's rule
      for (int64_t h = 0; h < n_kv; ++h) {
        attnlab_attend::quantize(K + h * D, D / 32, c.k[l].data_ptr<int8_t>() + (h * C + slot) * D,
                                 c.k_scale[l].data_ptr<float>() + (h * C + slot) * (D / 32));
        attnlab_attend::quantize(V + h * D, D / 32, c.v[l].data_ptr<int8_t>() + (h * C + slot) * D,
                                 c.v_scale[l].data_ptr<float>() + (h * C + slot) * (D / 32));
      }
  }
  if (c.page) attnlab_quest::add_key(pages_of(c, l), cache_of(c, l), n_kv, slot, D);
}
