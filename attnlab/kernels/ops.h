// What the kernels see of a tensor, and how they get threads, outputs and errors, in plain C++: the kernel
// sources include this, never torch's headers; bind.cpp (the one torch-binding file) turns tensors into Views,
// allocates what a kernel asks for through Alloc, and registers the ops.
//
// Why: every source that included torch/extension.h spent ~30 s of a 2-core machine parsing it, per ISA
// variant; the kernels themselves compile in 1-10 s. Parallel loops keep at::parallel_for's rules (the same
// split of a range, inline in a parallel region or at one thread) with the thread count bind.cpp passes from
// torch (`torch.get_num_threads()`), so the same work lands on the same threads as before.
#pragma once
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <new>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace attnlab {

// float16 as the caches and the repacked scales store it: conversions rounding to nearest even (F16C), as c10::Half.
struct Half {
  uint16_t x;
  Half() = default;
  explicit Half(float f) : x(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)) {}
  operator float() const { return _cvtsh_ss(x); }
};

enum class DType : int8_t { F32, F16, I8, U8, I64, I16, Other };
constexpr DType kFloat = DType::F32, kHalf = DType::F16, kChar = DType::I8, kByte = DType::U8, kLong = DType::I64,
                kShort = DType::I16,
                kInt8 = DType::I8, kUInt8 = DType::U8;

inline const char* dtype_name(DType t) {  // torch's names, as its messages print them
  switch (t) {
    case DType::F32: return "Float";
    case DType::F16: return "Half";
    case DType::I8: return "Char";
    case DType::U8: return "Byte";
    case DType::I64: return "Long";
    case DType::I16: return "Short";
    default: return "Other";
  }
}
inline std::ostream& operator<<(std::ostream& o, DType t) { return o << dtype_name(t); }

constexpr int kMaxDims = 8;

struct Shape {  // a View's sizes, compared and printed as torch's
  int n = 0;
  const int64_t* p = nullptr;
  bool operator==(const Shape& s) const {
    if (n != s.n) return false;
    for (int i = 0; i < n; ++i)
      if (p[i] != s.p[i]) return false;
    return true;
  }
  bool operator!=(const Shape& s) const { return !(*this == s); }
  std::vector<int64_t> vec() const { return std::vector<int64_t>(p, p + n); }
};
inline std::ostream& operator<<(std::ostream& o, const Shape& s) {
  o << "[";
  for (int i = 0; i < s.n; ++i) o << (i ? ", " : "") << s.p[i];
  return o << "]";
}

// A tensor's data, dtype, sizes and strides (in elements). A default View is "absent" (an optional's None).
struct View {
  void* ptr = nullptr;
  DType dtype = DType::Other;
  int ndim = -1;
  int64_t sz[kMaxDims] = {}, st[kMaxDims] = {};
  int64_t count = 0;
  bool contig = false;  // torch's is_contiguous() of the tensor

  bool defined() const { return ndim >= 0; }
  bool has_value() const { return defined(); }
  explicit operator bool() const { return defined(); }
  const View* operator->() const { return this; }  // a View in an optional's place reads as one
  const View& operator*() const { return *this; }
  DType scalar_type() const { return dtype; }
  int64_t dim() const { return ndim; }
  int64_t size(int64_t i) const { return sz[i < 0 ? i + ndim : i]; }
  int64_t stride(int64_t i) const { return st[i < 0 ? i + ndim : i]; }
  int64_t numel() const { return count; }
  Shape sizes() const { return {ndim, sz}; }
  bool is_contiguous() const { return contig; }
  template <class T>
  T* data_ptr() const { return static_cast<T*>(ptr); }
  void* data_ptr() const { return ptr; }
  // the slice [i] of the first dimension
  View operator[](int64_t i) const {
    View v;
    v.ptr = static_cast<char*>(ptr) + i * st[0] * elem_size();
    v.dtype = dtype, v.ndim = ndim - 1, v.count = sz[0] ? count / sz[0] : 1, v.contig = contig;
    for (int d = 1; d < ndim; ++d) v.sz[d - 1] = sz[d], v.st[d - 1] = st[d];
    return v;
  }
  int64_t elem_size() const {
    switch (dtype) {
      case DType::F32: return 4;
      case DType::F16: case DType::I16: return 2;
      case DType::I64: return 8;
      default: return 1;
    }
  }
};

// An optional tensor argument (torch's `Tensor?`): a View, absent for None.
struct Opt : View {
  Opt() = default;
  Opt(const View& v) : View(v) {}
};

// A tensor argument bind.cpp makes contiguous first (a copy only where it is not), as `.contiguous()` did.
struct Contig : View {
  Contig() = default;
  Contig(const View& v) : View(v) {}
};

// Memory aligned as torch's allocator aligns it (64 bytes): the kernels' aligned loads and streaming stores into
// their own buffers rely on it, as they did when these buffers were torch tensors. Buf is zero-filled (torch::zeros),
// Scratch left as it comes (torch::empty: a decode step's buffers, written before they are read).
template <class T, bool Zero>
struct Aligned64 {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = Aligned64<U, Zero>;
  };
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U, Zero>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    if constexpr (sizeof...(A) == 0 && !Zero) ::new (static_cast<void*>(p)) U;
    else ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
  template <class U>
  bool operator==(const Aligned64<U, Zero>&) const { return true; }
};
template <class T>
using Buf = std::vector<T, Aligned64<T, true>>;
template <class T>
using Scratch = std::vector<T, Aligned64<T, false>>;

// A contiguous View of n-dimensional `shape` over memory at p.
inline View view_of(void* p, DType t, const std::vector<int64_t>& shape) {
  View v;
  v.ptr = p, v.dtype = t, v.ndim = static_cast<int>(shape.size()), v.count = 1, v.contig = true;
  for (int i = v.ndim - 1; i >= 0; --i) v.sz[i] = shape[i], v.st[i] = v.count, v.count *= shape[i];
  return v;
}

// How a kernel gets its outputs: a new tensor of `shape` (contiguous), owned by the caller (bind.cpp returns it).
// ZEROED: filled with zeros; HUGE: zeroed, in a mapping of its own marked for transparent huge pages (repacked
// weights, which a matvec streams whole every step).
struct Alloc {
  enum Flags { ZEROED = 1, HUGE = 2 };
  virtual View operator()(const std::vector<int64_t>& shape, DType t, int flags = 0) const = 0;
  virtual ~Alloc() = default;
};

// Errors: a message built like TORCH_CHECK's, thrown as std::runtime_error (torch raises RuntimeError with it).
template <class... A>
[[noreturn]] void fail(const A&... parts) {
  std::ostringstream o;
  (o << ... << parts);
  throw std::runtime_error(o.str());
}
#define ATTNLAB_CHECK(cond, ...) \
  do {                           \
    if (!(cond)) ::attnlab::fail(__VA_ARGS__); \
  } while (0)

// ---- threads: at::parallel_for's rules with the count torch has (set by bind.cpp for each call) ----
inline int& threads_slot() {
  thread_local int n = 1;
  return n;
}
inline int num_threads() { return threads_slot(); }
struct Threads {  // bind.cpp: `Threads t(at::get_num_threads());` before a kernel runs
  int prev;
  explicit Threads(int n) : prev(threads_slot()) { threads_slot() = n; }
  ~Threads() { threads_slot() = prev; }
};
inline bool& inside_slot() {
  thread_local bool b = false;
  return b;
}
inline bool in_parallel_region() {
#ifdef _OPENMP
  if (omp_in_parallel()) return true;
#endif
  return inside_slot();
}
struct Inside {
  bool prev;
  Inside() : prev(inside_slot()) { inside_slot() = true; }
  ~Inside() { inside_slot() = prev; }
};

// f(b0, b1) over [begin, end) split as at::parallel_for splits it: one chunk per thread of at most
// ceil(n / threads), no more threads than ceil(n / grain); inline where n <= grain, at one thread, or inside a
// parallel region. The first exception a thread throws is rethrown after the region.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  const int nt = num_threads();
  if (n <= grain || n == 1 || nt <= 1 || in_parallel_region()) {
    Inside g;
    f(begin, end);
    return;
  }
#ifdef _OPENMP
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  std::exception_ptr err;
#pragma omp parallel num_threads(nt)
  {
    int64_t t = omp_get_num_threads();
    if (grain > 0) t = std::min<int64_t>(t, (n + grain - 1) / grain);
    const int64_t tid = omp_get_thread_num(), chunk = (n + t - 1) / t, b = begin + tid * chunk;
    if (b < end) {
      try {
        Inside g;
        f(b, std::min(end, b + chunk));
      } catch (...) {
        if (!failed.test_and_set()) err = std::current_exception();
      }
    }
  }
  if (err) std::rethrow_exception(err);
#else
  Inside g;
  f(begin, end);
#endif
}

}  // namespace attnlab

// ---- the ops (bind.cpp registers each under its name; `out` allocates its results, in order) ----
namespace attnlab {
// kernels.cpp: quantized matmuls and Deja Vu's row-sparse ops
View q4_mm(const Alloc& out, const View& x, const View& qs, const View& scale, const View& min, int64_t group);
View lut4_mm(const Alloc& out, const View& x, const View& qs, const View& lut, const View& lut_scale, int64_t group);
View q8_mm(const Alloc& out, const View& x, const View& q, const View& scale, int64_t group);
View f32_rows_mv(const Alloc& out, const View& x, const View& w, const View& idx);
View q8_rows_mv(const Alloc& out, const View& x, const View& q, const View& scale, int64_t group, const View& idx);
View q4_rows_mv(const Alloc& out, const View& x, const View& qs, const View& scale, const View& min, int64_t group,
                const View& idx);
View f32_rows_axpy(const Alloc& out, const View& a, const View& w, const View& idx);
View q8_rows_axpy(const Alloc& out, const View& a, const View& q, const View& scale, int64_t group, const View& idx);
View q4_rows_axpy(const Alloc& out, const View& a, const View& qs, const View& scale, const View& min, int64_t group,
                  const View& idx);
}  // namespace attnlab
namespace attnlab {
// glue.cpp: a prefill's elementwise glue, and dequantisation into a buffer the caller keeps (returned)
View rms_norm(const Alloc& out, const Contig& x, const Contig& w, double eps);
View silu_mul(const Alloc& out, const Contig& h);
View dequant_q8(const Alloc& out, const View& q, const View& scale, const Opt& min, const View& into);
View dequant_q4(const Alloc& out, const View& qs, const View& scale, const View& min, const View& into);
}  // namespace attnlab
namespace attnlab {
// attend.cpp: a decode step's attention over the KV cache (out [B, Hq, 1, D]; _lse: and the log-sum-exp [B, Hq]),
// and the int8 cache's rounding (codes, then scales)
View decode_attention(const Alloc& out, const Contig& q, const View& k, const View& v, double scale, const Opt& k_scale,
                      const Opt& v_scale);
View decode_attention_lse(const Alloc& out, const Contig& q, const View& k, const View& v, double scale,
                          const Opt& k_scale, const Opt& v_scale);
View quantize_kv(const Alloc& out, const Contig& x);
}  // namespace attnlab
namespace attnlab {
// causal.cpp: a prompt's causal attention (AVX-512 builds; the returned View is the first output transposed)
View causal_attention(const Alloc& out, const View& q, const View& k, const View& v, double scale);
}  // namespace attnlab
namespace attnlab {
// repack_load.cpp: weights repacked into 16-row blocks at load (repacked_layout.h)
View repack_q4(const Alloc& out, const View& qs, const View& scale, const View& min, int64_t group, int64_t fmt);
View repack_q8(const Alloc& out, const View& q, const View& scale, const Opt& min, int64_t group, int64_t fmt);
View repack_q4k(const Alloc& out, const View& qs, const View& sc, const View& m, const View& d, const View& dmin);
View repack_q6k(const Alloc& out, const View& q, const View& sc, const View& d);
// GGUF K-quant blocks decoded at load: Q4_K -> pack4 codes [nb, 128], then uint8 sc and m [nb, 16]; Q6_K -> int8 [nb, 256]
View gguf_q4k_codes(const Alloc& out, const View& raw);
View gguf_q6k_codes(const Alloc& out, const View& raw);
// repacked_rows.cpp: rows of a repacked int8 weight, dequantised (a tied head read as the token table)
View q8x_rows(const Alloc& out, const View& w, const Contig& ids, int64_t K, int64_t group, bool has_min, int64_t fmt);
}  // namespace attnlab
namespace attnlab {
// repacked.cpp: matvecs over repacked weights (x [M, K] -> [M, n]; _glu: silu(gate) * up [M, n / 2])
View q4x_mm(const Alloc& out, const View& x, const View& w, int64_t N, int64_t group, int64_t fmt);
View q4x_glu(const Alloc& out, const View& x, const View& w, int64_t N, int64_t group, int64_t fmt);
View q8x_mm(const Alloc& out, const View& x, const View& w, int64_t N, int64_t group, bool has_min, int64_t fmt);
View q8x_glu(const Alloc& out, const View& x, const View& w, int64_t N, int64_t group, bool has_min, int64_t fmt);
}  // namespace attnlab
namespace attnlab {
// sparse_cols.cpp: TEAL's column-sparse matvecs (x [K], |x_j| <= tau dropped -> [N])
View f32_cols_mv(const Alloc& out, const View& x, double tau, const View& wt);
View q8_cols_mv(const Alloc& out, const View& x, double tau, const View& q, const View& scale, int64_t group);
View q4_cols_mv(const Alloc& out, const View& x, double tau, const View& qs, const View& scale, const View& min,
                int64_t group);
View qc_cols_mv(const Alloc& out, const View& x, double tau, const View& codes, const View& scale, const View& min,
                int64_t bits, int64_t group);
}  // namespace attnlab
