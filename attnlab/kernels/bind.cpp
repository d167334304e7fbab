// The one file that includes torch: the attnlab ops' schemas and their CPU kernels, each a plain C++ function of
// ops.h called with Views of its tensors, torch's thread count, and an Alloc that makes its outputs as tensors.
//
// Why one file: parsing torch/extension.h took ~30 s of a 2-core machine per source and ISA variant, ten
// sources, two variants: most of an install. Adding an op: a plain function `View f(const Alloc&, const View&..,
// int64_t.., double.., bool.., const Opt&..)` declared in ops.h, then one `def` line (its schema) and one
// `impl` line (`&Op<&attnlab::f>::call`, or `Op2` for two outputs) below.
#include <torch/extension.h>
#include <torch/custom_class.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <sys/mman.h>

#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"
#include "step.h"

using attnlab::DType;
using attnlab::Opt;
using attnlab::View;

namespace {

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kChar: return DType::I8;
    case at::kByte: return DType::U8;
    case at::kLong: return DType::I64;
    case at::kShort: return DType::I16;
    default: return DType::Other;
  }
}

at::ScalarType scalar_of(DType t) {
  switch (t) {
    case DType::F32: return at::kFloat;
    case DType::F16: return at::kHalf;
    case DType::I8: return at::kChar;
    case DType::U8: return at::kByte;
    case DType::I64: return at::kLong;
    case DType::I16: return at::kShort;
    default: TORCH_CHECK(false, "attnlab: no torch dtype for a kernel's output");
  }
}

View view(const at::Tensor& t) {
  View v;
  if (!t.defined()) return v;
  TORCH_CHECK(t.dim() <= attnlab::kMaxDims, "attnlab ops take tensors of at most ", attnlab::kMaxDims, " dimensions");
  TORCH_CHECK(t.device().is_cpu(), "attnlab ops take CPU tensors");
  v.ptr = t.numel() ? t.data_ptr() : nullptr, v.dtype = dtype_of(t.scalar_type()), v.ndim = static_cast<int>(t.dim());
  v.count = t.numel(), v.contig = t.is_contiguous();
  for (int i = 0; i < v.ndim; ++i) v.sz[i] = t.size(i), v.st[i] = t.stride(i);
  return v;
}

// Zeroed uint8 for repacked weights, in its own mapping marked for transparent huge pages (where the OS leaves
// them to madvise): a matvec streams the whole of it every step, and with 4 KiB pages every page is a TLB miss.
// 1B Q4_0 (Xeon VM, THP "madvise"): 16.8 -> 17.6 tok/s at 1 thread, 29.7 -> 32.3 at 2 (medians of 4
// alternating processes). Under 2 MiB it would not fill one huge page.
at::Tensor huge_zeros(const std::vector<int64_t>& shape, at::ScalarType t) {
  int64_t n = at::elementSize(t);
  for (int64_t s : shape) n *= s;
  if (n < (2 << 20)) return at::zeros(shape, t);
  const size_t bytes = static_cast<size_t>(n);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "mmap of ", bytes, " bytes for repacked weights failed");
  madvise(p, bytes, MADV_HUGEPAGE);
  return at::from_blob(p, shape, [bytes](void* q) { munmap(q, bytes); }, at::TensorOptions().dtype(t));
}

// The tensors a kernel asked for, in order: its results.
struct Outputs : attnlab::Alloc {
  mutable std::vector<at::Tensor> made;
  View operator()(const std::vector<int64_t>& shape, DType t, int flags) const override {
    const auto st = scalar_of(t);
    made.push_back(flags & HUGE ? huge_zeros(shape, st) : flags & ZEROED ? at::zeros(shape, st) : at::empty(shape, st));
    return view(made.back());
  }
};

// A plain parameter's torch form: View <- Tensor, Opt <- Tensor?, numbers as they are.
// Contig <- Tensor made contiguous (kept alive in `keep` for the call).
template <class P>
struct Conv {
  using T = P;
  static P go(P x, std::vector<at::Tensor>&) { return x; }
};
template <>
struct Conv<const View&> {
  using T = const at::Tensor&;
  static View go(const at::Tensor& t, std::vector<at::Tensor>&) { return view(t); }
};
template <>
struct Conv<const Opt&> {
  using T = const std::optional<at::Tensor>&;
  static Opt go(const std::optional<at::Tensor>& t, std::vector<at::Tensor>&) { return t ? Opt(view(*t)) : Opt(); }
};
template <>
struct Conv<const attnlab::Contig&> {
  using T = const at::Tensor&;
  static attnlab::Contig go(const at::Tensor& t, std::vector<at::Tensor>& keep) {
    if (t.is_contiguous()) return view(t);
    keep.push_back(t.contiguous());
    return view(keep.back());
  }
};

// Runs plain op F on torch's arguments with torch's thread count; its outputs in order.
template <class... P>
std::vector<at::Tensor> run(View (*f)(const attnlab::Alloc&, P...), typename Conv<P>::T... a) {
  const attnlab::Threads threads(at::get_num_threads());
  Outputs out;
  std::vector<at::Tensor> keep;
  keep.reserve(sizeof...(P));
  const View r = f(out, Conv<P>::go(a, keep)...);
  auto& made = out.made;
  TORCH_CHECK(!made.empty(), "attnlab: an op returned no output");
  // the View it returns of its first output gives that output's shape (causal_attention's transpose)
  if (r.ptr == made[0].data_ptr() && r.dim() == made[0].dim()) {
    std::vector<int64_t> sizes(r.sz, r.sz + r.ndim), strides(r.st, r.st + r.ndim);
    if (made[0].sizes() != at::IntArrayRef(sizes) || made[0].strides() != at::IntArrayRef(strides))
      made[0] = made[0].as_strided(sizes, strides);
  }
  return made;
}

// The torch kernel of plain op F: its first output (Op2: its first two).
template <auto F>
struct Op;
template <class... P, View (*F)(const attnlab::Alloc&, P...)>
struct Op<F> {
  static at::Tensor call(typename Conv<P>::T... a) { return run<P...>(F, a...)[0]; }
};
template <auto F>
struct Op2;
template <class... P, View (*F)(const attnlab::Alloc&, P...)>
struct Op2<F> {
  static std::tuple<at::Tensor, at::Tensor> call(typename Conv<P>::T... a) {
    auto made = run<P...>(F, a...);
    return {made.at(0), made.at(1)};
  }
};

// Ops that write into a tensor the caller gives (`Tensor(a!) out`) and return it.
at::Tensor dequant_q8(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& min,
                      at::Tensor out) {
  const attnlab::Threads threads(at::get_num_threads());
  attnlab::dequant_q8(Outputs(), view(q), view(scale), min ? Opt(view(*min)) : Opt(), view(out));
  return out;
}
at::Tensor dequant_q4(const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& min, at::Tensor out) {
  const attnlab::Threads threads(at::get_num_threads());
  attnlab::dequant_q4(Outputs(), view(qs), view(scale), view(min), view(out));
  return out;
}

std::vector<View> views(const std::vector<at::Tensor>& ts) {
  std::vector<View> out;
  for (const auto& t : ts) out.push_back(view(t));
  return out;
}

// The native decode step (step.cpp) as a torch class: the tensors behind its Views held here, and each linear
// layer's kernel call (an attnlab op by name with its operands after x, or a float weight's rows) as a Linear.
struct DecodeStep : torch::CustomClassHolder {
  attnlab_step::Step s;
  std::vector<at::Tensor> held;                   // embedding, norms: for the step's life
  std::vector<std::vector<at::Tensor>> by_row;    // per bound row: its cache buffers, then its page summaries

  DecodeStep(int64_t dim, int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t hidden, double eps, int64_t threads)
      : s(dim, n_heads, n_kv, head_dim, hidden, eps, threads) {}

  static bool openmp() { return attnlab_step::Step::openmp(); }

  c10::Dict<std::string, std::vector<double>> profile(bool on) {
    c10::Dict<std::string, std::vector<double>> out;
    for (auto& [phase, row] : s.profile(on)) out.insert(phase, row);
    return out;
  }

  void set_embedding(at::Tensor w, std::optional<at::Tensor> scale, int64_t group) {
    s.set_embedding(view(w), scale ? view(*scale) : View(), group);
    held.push_back(w);
    if (scale) held.push_back(*scale);
  }

  void add_norm(at::Tensor w) {
    s.add_norm(view(w));
    held.push_back(w);
  }

  // One segment of a linear layer: output rows [row0, row0 + rows), run by team thread `thread` (row0 == 0
  // starts the next layer). op: an attnlab op name ("" = float weight rows tensors[0]); its operands after x
  // are filled in the order of the op's schema from tensors, ints and floats; bias: the segment's rows.
  void add_linear(const std::string& op, std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
                  std::vector<double> floats, std::optional<at::Tensor> bias, int64_t row0, int64_t rows,
                  int64_t thread) {
    TORCH_CHECK(!bias || bias->numel() == rows, "bias: the segment's rows");
    const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
    auto last = std::make_shared<at::Tensor>();  // the segment's output, read by the step after the call
    std::function<const float*(const float*, int64_t, int64_t)> run;
    if (op.empty()) {
      TORCH_CHECK(tensors.size() == 1 && tensors[0].scalar_type() == at::kFloat && tensors[0].size(0) == rows,
                  "a float linear takes its weight's rows");
      run = [w = tensors[0], b, last](const float* x, int64_t M, int64_t K) {
        c10::InferenceMode guard;
        const auto xt = at::from_blob(const_cast<float*>(x), {M, K}, at::kFloat);
        *last = at::linear(xt, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt).contiguous();
        return last->data_ptr<float>();
      };
    } else {
      auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(("attnlab::" + op).c_str(), "");
      const auto& schema = handle.schema();
      std::vector<c10::IValue> args;
      size_t t = 0, i = 0, f = 0;
      for (size_t a = 1; a < schema.arguments().size(); ++a) {
        switch (schema.arguments()[a].type()->kind()) {
          case c10::TypeKind::TensorType:
            TORCH_CHECK(t < tensors.size(), op, ": too few tensors"); args.emplace_back(tensors[t++]); break;
          case c10::TypeKind::IntType:
            TORCH_CHECK(i < ints.size(), op, ": too few ints"); args.emplace_back(ints[i++]); break;
          case c10::TypeKind::BoolType:
            TORCH_CHECK(i < ints.size(), op, ": too few ints"); args.emplace_back(ints[i++] != 0); break;
          case c10::TypeKind::FloatType:
            TORCH_CHECK(f < floats.size(), op, ": too few floats"); args.emplace_back(floats[f++]); break;
          default:
            TORCH_CHECK(false, op, ": argument ", schema.arguments()[a].name(), " has a type the step cannot pass");
        }
      }
      TORCH_CHECK(t == tensors.size() && i == ints.size() && f == floats.size(), op, ": more operands than its schema");
      run = [handle, args, b, last](const float* x, int64_t M, int64_t K) {
        c10::InferenceMode guard;
        torch::jit::Stack stack;
        stack.reserve(args.size() + 1);
        stack.emplace_back(at::from_blob(const_cast<float*>(x), {M, K}, at::kFloat));
        stack.insert(stack.end(), args.begin(), args.end());
        handle.callBoxed(stack);
        at::Tensor y = stack[0].toTensor();
        if (b.defined()) y.add_(b);
        *last = y.contiguous();
        return last->data_ptr<float>();
      };
    }
    s.add_linear(row0, rows, thread).run = std::move(run);
  }

  void bind_rows(int64_t row, std::vector<at::Tensor> k, std::vector<at::Tensor> v, std::vector<at::Tensor> ks,
                 std::vector<at::Tensor> vs, std::vector<at::Tensor> p) {
    s.bind_rows(row, views(k), views(v), views(ks), views(vs), views(p));
    if (row == static_cast<int64_t>(by_row.size())) by_row.emplace_back();
    auto& h = by_row[row];
    h.clear();
    for (auto* list : {&k, &v, &ks, &vs, &p}) h.insert(h.end(), list->begin(), list->end());
  }

  void bind_pages(int64_t row, int64_t page, std::vector<at::Tensor> lo, std::vector<at::Tensor> hi,
                  std::vector<at::Tensor> keys_t, std::vector<at::Tensor> keys_s) {
    s.bind_pages(row, page, views(lo), views(hi), views(keys_t), views(keys_s));
    auto& h = by_row[row];
    for (auto* list : {&lo, &hi, &keys_t, &keys_s}) h.insert(h.end(), list->begin(), list->end());
  }

  void set_quest(int64_t budget, int64_t dense, int64_t channels) { s.set_quest(budget, dense, channels); }

  // One token at cache slot `slot` (absolute position `position`), attending to slots [first, slot] of bound row
  // 0: the batch of one (see run_batch).
  at::Tensor run(int64_t token, int64_t slot, int64_t position, int64_t first, at::Tensor rot,
                 std::optional<at::Tensor> embedded) {
    return run_batch({token}, {slot}, {position}, {first}, rot,
                     embedded ? std::optional<at::Tensor>(embedded->view({1, -1})) : std::nullopt, {0}, {0});
  }

  // B rows, one token each, row r into bound cache seqs[r] (Step::run_batch): logits [outs, 1, V].
  at::Tensor run_batch(std::vector<int64_t> tokens, std::vector<int64_t> slots, std::vector<int64_t> positions,
                       std::vector<int64_t> firsts, at::Tensor rots, std::optional<at::Tensor> embedded,
                       std::vector<int64_t> seqs, std::vector<int64_t> outs) {
    auto logits = at::empty({static_cast<int64_t>(outs.size()), 1, s.vocab()}, at::kFloat);
    s.run_batch(tokens, slots, positions, firsts, view(rots), embedded ? view(*embedded) : View(), seqs, outs,
                logits.data_ptr<float>());
    return logits;
  }
};

}  // namespace

TORCH_LIBRARY(attnlab, m) {
  m.def("q4_mm(Tensor x, Tensor qs, Tensor scale, Tensor min, int group) -> Tensor");
  m.def("lut4_mm(Tensor x, Tensor qs, Tensor lut, Tensor lut_scale, int group) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor q, Tensor scale, int group) -> Tensor");
  m.def("f32_rows_mv(Tensor x, Tensor w, Tensor idx) -> Tensor");
  m.def("q8_rows_mv(Tensor x, Tensor q, Tensor scale, int group, Tensor idx) -> Tensor");
  m.def("q4_rows_mv(Tensor x, Tensor qs, Tensor scale, Tensor min, int group, Tensor idx) -> Tensor");
  m.def("f32_rows_axpy(Tensor a, Tensor w, Tensor idx) -> Tensor");
  m.def("q8_rows_axpy(Tensor a, Tensor q, Tensor scale, int group, Tensor idx) -> Tensor");
  m.def("q4_rows_axpy(Tensor a, Tensor qs, Tensor scale, Tensor min, int group, Tensor idx) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor h) -> Tensor");
  m.def("dequant_q8(Tensor q, Tensor scale, Tensor? min, Tensor(a!) out) -> Tensor(a!)");
  m.def("dequant_q4(Tensor qs, Tensor scale, Tensor min, Tensor(a!) out) -> Tensor(a!)");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def("decode_attention_lse(Tensor q, Tensor k, Tensor v, float scale, Tensor? k_scale=None, Tensor? v_scale=None) -> (Tensor, Tensor)");
  m.def("quantize_kv(Tensor x) -> (Tensor, Tensor)");
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("q4x_mm(Tensor x, Tensor w, int n, int group, int fmt) -> Tensor");
  m.def("q8x_mm(Tensor x, Tensor w, int n, int group, bool has_min, int fmt) -> Tensor");
  m.def("q4x_glu(Tensor x, Tensor w, int n, int group, int fmt) -> Tensor");
  m.def("q8x_glu(Tensor x, Tensor w, int n, int group, bool has_min, int fmt) -> Tensor");
  m.def("q8x_rows(Tensor w, Tensor ids, int k, int group, bool has_min, int fmt) -> Tensor");
  m.def("repack_q4(Tensor qs, Tensor scale, Tensor min, int group, int fmt) -> Tensor");
  m.def("repack_q8(Tensor q, Tensor scale, Tensor? min, int group, int fmt) -> Tensor");
  m.def("repack_q4k(Tensor qs, Tensor sc, Tensor m, Tensor d, Tensor dmin) -> Tensor");
  m.def("repack_q6k(Tensor q, Tensor sc, Tensor d) -> Tensor");
  m.def("gguf_q4k_codes(Tensor raw) -> (Tensor, Tensor)");
  m.def("gguf_q6k_codes(Tensor raw) -> Tensor");
  m.def("qc_cols_mv(Tensor x, float tau, Tensor codes, Tensor scale, Tensor min, int bits, int group) -> Tensor");
  m.def("f32_cols_mv(Tensor x, float tau, Tensor wt) -> Tensor");
  m.def("q8_cols_mv(Tensor x, float tau, Tensor q, Tensor scale, int group) -> Tensor");
  m.def("q4_cols_mv(Tensor x, float tau, Tensor qs, Tensor scale, Tensor min, int group) -> Tensor");
  m.class_<DecodeStep>("DecodeStep")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t>())
      .def_static("openmp", &DecodeStep::openmp)
      .def("profile", &DecodeStep::profile)
      .def("set_embedding", &DecodeStep::set_embedding)
      .def("add_norm", &DecodeStep::add_norm)
      .def("add_linear", &DecodeStep::add_linear)
      .def("bind_rows", &DecodeStep::bind_rows)
      .def("bind_pages", &DecodeStep::bind_pages)
      .def("set_quest", &DecodeStep::set_quest)
      .def("run", &DecodeStep::run)
      .def("run_batch", &DecodeStep::run_batch);
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  using namespace attnlab;
  m.impl("q4_mm", &Op<&q4_mm>::call), m.impl("lut4_mm", &Op<&lut4_mm>::call), m.impl("q8_mm", &Op<&q8_mm>::call);
  m.impl("f32_rows_mv", &Op<&f32_rows_mv>::call), m.impl("q8_rows_mv", &Op<&q8_rows_mv>::call);
  m.impl("q4_rows_mv", &Op<&q4_rows_mv>::call), m.impl("f32_rows_axpy", &Op<&f32_rows_axpy>::call);
  m.impl("q8_rows_axpy", &Op<&q8_rows_axpy>::call), m.impl("q4_rows_axpy", &Op<&q4_rows_axpy>::call);
  m.impl("rms_norm", &Op<&rms_norm>::call), m.impl("silu_mul", &Op<&silu_mul>::call);
  m.impl("dequant_q8", &::dequant_q8), m.impl("dequant_q4", &::dequant_q4);
  m.impl("decode_attention", &Op<&decode_attention>::call);
  m.impl("decode_attention_lse", &Op2<&decode_attention_lse>::call), m.impl("quantize_kv", &Op2<&quantize_kv>::call);
  m.impl("causal_attention", &Op<&causal_attention>::call);
  m.impl("q4x_mm", &Op<&q4x_mm>::call), m.impl("q8x_mm", &Op<&q8x_mm>::call);
  m.impl("q4x_glu", &Op<&q4x_glu>::call), m.impl("q8x_glu", &Op<&q8x_glu>::call);
  m.impl("q8x_rows", &Op<&q8x_rows>::call);
  m.impl("repack_q4", &Op<&repack_q4>::call), m.impl("repack_q8", &Op<&repack_q8>::call);
  m.impl("repack_q4k", &Op<&repack_q4k>::call), m.impl("repack_q6k", &Op<&repack_q6k>::call);
  m.impl("gguf_q4k_codes", &Op2<&gguf_q4k_codes>::call), m.impl("gguf_q6k_codes", &Op<&gguf_q6k_codes>::call);
  m.impl("f32_cols_mv", &Op<&f32_cols_mv>::call), m.impl("q8_cols_mv", &Op<&q8_cols_mv>::call);
  m.impl("q4_cols_mv", &Op<&q4_cols_mv>::call), m.impl("qc_cols_mv", &Op<&qc_cols_mv>::call);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
