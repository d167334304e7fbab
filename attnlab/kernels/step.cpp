// The single-token decode step of a Llama-family network in one native call (`attnlab::DecodeStep`).
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
// The Python side (`attnlab/model/native.py`) decides which steps come here (batch 1, one token, no
// padding, float32 activations, a float32 / float16 / int8 cache) and keeps the cache's bookkeeping
// (positions, growth, eviction) around the call.
#include <torch/extension.h>
#include <torch/custom_class.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

// y = x W^T (+ b): a dispatcher op with its operands after x (a quantized layer's `kernel()`), or a
// float weight through at::linear.
struct Linear {
  std::optional<c10::OperatorHandle> op;
  std::vector<c10::IValue> args;
  at::Tensor weight, bias;

  at::Tensor operator()(const at::Tensor& x) const {
    if (!op) return at::linear(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
    torch::jit::Stack stack;
    stack.reserve(args.size() + 1);
    stack.emplace_back(x);
    stack.insert(stack.end(), args.begin(), args.end());
    op->callBoxed(stack);
    at::Tensor y = stack[0].toTensor();
    if (bias.defined()) y.add_(bias);
    return y;
  }
};

void rms_norm(const float* x, const float* w, float* out, int64_t n, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// Rotate `heads` heads of size D in place by (cos, sin) pairs [D/2, 2] (pairs of adjacent dimensions).
void rope(float* x, const float* rot, int64_t heads, int64_t D) {
  for (int64_t h = 0; h < heads; ++h, x += D)
    for (int64_t i = 0; i < D / 2; ++i) {
      const float x0 = x[2 * i], x1 = x[2 * i + 1], c = rot[2 * i], s = rot[2 * i + 1];
      x[2 * i] = x0 * c - x1 * s;
      x[2 * i + 1] = x0 * s + x1 * c;
    }
}

}  // namespace

struct DecodeStep : torch::CustomClassHolder {
  int64_t dim, n_heads, n_kv, head_dim, hidden;
  double eps, scale;
  at::Tensor embed_w, embed_scale;  // float32 [V, dim], or int8 codes [V, dim] with scales [V, dim / group]
  int64_t embed_group = 0;
  std::vector<at::Tensor> norms;    // attn_norm, mlp_norm per layer, then the final norm
  std::vector<Linear> linears;      // wqkv, wo, w13, w2 per layer, then the head
  std::vector<at::Tensor> k, v, k_scale, v_scale, pos;  // the bound cache's per-layer buffers
  // attend.cpp's ops, called boxed: by schema, whatever C++ signature their kernels have
  c10::OperatorHandle attend = c10::Dispatcher::singleton().findSchemaOrThrow("attnlab::decode_attention", "");
  c10::OperatorHandle quantize_kv = c10::Dispatcher::singleton().findSchemaOrThrow("attnlab::quantize_kv", "");

  DecodeStep(int64_t dim, int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t hidden, double eps)
      : dim(dim), n_heads(n_heads), n_kv(n_kv), head_dim(head_dim), hidden(hidden), eps(eps),
        scale(1.0 / std::sqrt(static_cast<double>(head_dim))) {}

  void set_embedding(at::Tensor w, std::optional<at::Tensor> scale, int64_t group) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == dim && w.is_contiguous(), "embedding must be contiguous [V, dim]");
    TORCH_CHECK(scale ? w.scalar_type() == at::kChar && group > 0 && dim % group == 0 && scale->is_contiguous()
                      : w.scalar_type() == at::kFloat, "embedding: float32 rows, or int8 codes with scales");
    embed_w = w, embed_scale = scale ? *scale : at::Tensor(), embed_group = group;
  }

  void add_norm(at::Tensor w) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.numel() == dim && w.is_contiguous(), "norm weight: float32 [dim]");
    norms.push_back(w);
  }

  // op: an attnlab op name ("" = float weight tensors[0]); its operands after x are filled in the
  // order of the op's schema from tensors, ints and floats.
  void add_linear(const std::string& op, std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
                  std::vector<double> floats, std::optional<at::Tensor> bias) {
    Linear l;
    if (bias) l.bias = bias->contiguous();
    if (op.empty()) {
      TORCH_CHECK(tensors.size() == 1 && tensors[0].scalar_type() == at::kFloat, "a float linear takes its weight");
      l.weight = tensors[0];
      linears.push_back(std::move(l));
      return;
    }
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(("attnlab::" + op).c_str(), "");
    const auto& schema = handle.schema();
    size_t t = 0, i = 0, f = 0;
    for (size_t a = 1; a < schema.arguments().size(); ++a) {
      switch (schema.arguments()[a].type()->kind()) {
        case c10::TypeKind::TensorType:
          TORCH_CHECK(t < tensors.size(), op, ": too few tensors"); l.args.emplace_back(tensors[t++]); break;
        case c10::TypeKind::IntType:
          TORCH_CHECK(i < ints.size(), op, ": too few ints"); l.args.emplace_back(ints[i++]); break;
        case c10::TypeKind::BoolType:
          TORCH_CHECK(i < ints.size(), op, ": too few ints"); l.args.emplace_back(ints[i++] != 0); break;
        case c10::TypeKind::FloatType:
          TORCH_CHECK(f < floats.size(), op, ": too few floats"); l.args.emplace_back(floats[f++]); break;
        default:
          TORCH_CHECK(false, op, ": argument ", schema.arguments()[a].name(), " has a type the step cannot pass");
      }
    }
    TORCH_CHECK(t == tensors.size() && i == ints.size() && f == floats.size(), op, ": more operands than its schema");
    l.op = handle;
    linears.push_back(std::move(l));
  }

  // The cache's buffers per layer: k, v [1, Hkv, C, D] float32 / float16 / int8, pos [1, Hkv, C] int64,
  // and for int8 the scales [1, Hkv, C, D/32] float32 (empty lists otherwise).
  void bind(std::vector<at::Tensor> k_, std::vector<at::Tensor> v_, std::vector<at::Tensor> ks,
            std::vector<at::Tensor> vs, std::vector<at::Tensor> p) {
    const size_t L = norms.size() / 2;
    TORCH_CHECK(k_.size() == L && v_.size() == L && p.size() == L, "one k, v and pos buffer per layer");
    const auto dt = k_[0].scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kChar, "cache dtype must be float32, float16 or int8");
    TORCH_CHECK(dt == at::kChar ? ks.size() == L && vs.size() == L : ks.empty() && vs.empty(),
                "an int8 cache binds its scales, no other does");
    for (size_t i = 0; i < L; ++i) {
      for (const auto& t : {k_[i], v_[i]})
        TORCH_CHECK(t.dim() == 4 && t.size(0) == 1 && t.size(1) == n_kv && t.size(3) == head_dim &&
                    t.scalar_type() == dt && t.is_contiguous(), "cache buffers: contiguous [1, Hkv, C, D]");
      TORCH_CHECK(p[i].scalar_type() == at::kLong && p[i].is_contiguous() && p[i].size(2) == k_[i].size(2),
                  "pos: int64 [1, Hkv, C]");
      if (dt == at::kChar)
        TORCH_CHECK(ks[i].is_contiguous() && vs[i].is_contiguous() && ks[i].size(2) == k_[i].size(2), "scales");
    }
    k = std::move(k_), v = std::move(v_), k_scale = std::move(ks), v_scale = std::move(vs), pos = std::move(p);
  }

  // One token at cache slot `slot` (absolute position `position`), attending to slots [first, slot];
  // rot: its RoPE row as (cos, sin) pairs [.., D/2, 2] float32; embedded: the token's embedding row [dim]
  // float32 where no table was set (a head repacked by the kernels looks its rows up in Python, see
  // `QuantLinear.embed_rows`). Returns logits [1, 1, V] float32.
  at::Tensor run(int64_t token, int64_t slot, int64_t position, int64_t first, at::Tensor rot,
                 std::optional<at::Tensor> embedded) {
    const int64_t L = static_cast<int64_t>(norms.size() / 2), D = head_dim;
    TORCH_CHECK(L > 0 && static_cast<int64_t>(linears.size()) == 4 * L + 1, "step not built");
    TORCH_CHECK(embedded ? embedded->scalar_type() == at::kFloat && embedded->is_contiguous() && embedded->numel() == dim
                         : embed_w.defined(), "no embedding table: pass the token's embedding row, float32 [dim]");
    TORCH_CHECK(static_cast<int64_t>(k.size()) == L, "no cache bound");
    TORCH_CHECK(slot >= 0 && slot < k[0].size(2) && first >= 0 && first <= slot, "slot outside the cache");
    TORCH_CHECK(embedded || (token >= 0 && token < embed_w.size(0)), "token id out of range");
    TORCH_CHECK(rot.scalar_type() == at::kFloat && rot.is_contiguous() && rot.numel() == D, "rot: float32 (cos, sin) [D/2, 2]");
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor x = at::empty({1, dim}, f32), h = at::empty({1, dim}, f32), act = at::empty({1, hidden}, f32);
    float* X = x.data_ptr<float>();
    float* H = h.data_ptr<float>();
    if (embedded) {
      std::copy_n(embedded->data_ptr<float>(), dim, X);
    } else if (embed_scale.defined()) {
      const int8_t* q = embed_w.data_ptr<int8_t>() + token * dim;
      const float* s = embed_scale.data_ptr<float>() + token * (dim / embed_group);
      for (int64_t i = 0; i < dim; ++i) X[i] = static_cast<float>(q[i]) * s[i / embed_group];
    } else {
      std::copy_n(embed_w.data_ptr<float>() + token * dim, dim, X);
    }
    const float* R = rot.data_ptr<float>();
    const int64_t n = slot + 1;
    for (int64_t l = 0; l < L; ++l) {
      rms_norm(X, norms[2 * l].data_ptr<float>(), H, dim, eps);
      at::Tensor qkv = linears[4 * l](h).contiguous();  // [1, (Hq + 2 Hkv) D]: q heads, k heads, v heads
      float* Q = qkv.data_ptr<float>();
      float* K = Q + n_heads * D;
      const float* V = K + n_kv * D;
      rope(Q, R, n_heads + n_kv, D);  // q and k heads are adjacent
      write_kv(l, slot, position, K, V);
      auto q = qkv.narrow(1, 0, n_heads * D).view({1, n_heads, 1, D});
      const bool int8 = !k_scale.empty();
      auto span = [&](const at::Tensor& t) { return t.narrow(2, first, n - first); };
      torch::jit::Stack stack{q, span(k[l]), span(v[l]), scale, int8 ? c10::IValue(span(k_scale[l])) : c10::IValue(),
                              int8 ? c10::IValue(span(v_scale[l])) : c10::IValue()};
      attend.callBoxed(stack);
      at::Tensor out = stack[0].toTensor();
      at::Tensor o = linears[4 * l + 1](out.reshape({1, n_heads * D})).contiguous();
      add(X, o.data_ptr<float>(), dim);
      rms_norm(X, norms[2 * l + 1].data_ptr<float>(), H, dim, eps);
      at::Tensor gu = linears[4 * l + 2](h).contiguous();  // [1, 2 hidden]: gate, then up
      const float* G = gu.data_ptr<float>();
      float* A = act.data_ptr<float>();
      for (int64_t i = 0; i < hidden; ++i) A[i] = G[i] / (1.f + std::exp(-G[i])) * G[hidden + i];
      at::Tensor y = linears[4 * l + 3](act).contiguous();
      add(X, y.data_ptr<float>(), dim);
    }
    rms_norm(X, norms[2 * L].data_ptr<float>(), H, dim, eps);
    at::Tensor logits = linears[4 * L](h);
    return logits.view({1, 1, logits.size(1)});
  }

 private:
  static void add(float* x, const float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
  }

  // The new key (already rotated) and value into layer l's slot, in the cache's dtype, as LayerKV.update stores them.
  void write_kv(int64_t l, int64_t slot, int64_t position, const float* K, const float* V) {
    const int64_t C = k[l].size(2), D = head_dim;
    int64_t* P = pos[l].data_ptr<int64_t>();
    for (int64_t h = 0; h < n_kv; ++h) P[h * C + slot] = position;
    switch (k[l].scalar_type()) {
      case at::kFloat:
        for (int64_t h = 0; h < n_kv; ++h) {
          std::copy_n(K + h * D, D, k[l].data_ptr<float>() + (h * C + slot) * D);
          std::copy_n(V + h * D, D, v[l].data_ptr<float>() + (h * C + slot) * D);
        }
        break;
      case at::kHalf:
        for (int64_t h = 0; h < n_kv; ++h) {
          at::Half* kd = k[l].data_ptr<at::Half>() + (h * C + slot) * D;
          at::Half* vd = v[l].data_ptr<at::Half>() + (h * C + slot) * D;
          for (int64_t i = 0; i < D; ++i) kd[i] = at::Half(K[h * D + i]), vd[i] = at::Half(V[h * D + i]);
        }
        break;
      default: {  // int8 codes + a scale per 32 dimensions: attend.cpp's quantize_kv, bit for bit the cache's rule
        const auto f32 = at::TensorOptions().dtype(at::kFloat);
        const float* src[2] = {K, V};
        at::Tensor* codes[2] = {&k[l], &v[l]};
        at::Tensor* scales[2] = {&k_scale[l], &v_scale[l]};
        for (int w = 0; w < 2; ++w) {
          torch::jit::Stack stack{at::from_blob(const_cast<float*>(src[w]), {n_kv, D}, f32)};
          quantize_kv.callBoxed(stack);
          (*codes[w])[0].select(1, slot).copy_(stack[0].toTensor());
          (*scales[w])[0].select(1, slot).copy_(stack[1].toTensor());
        }
      }
    }
  }
};

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.class_<DecodeStep>("DecodeStep")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def("set_embedding", &DecodeStep::set_embedding)
      .def("add_norm", &DecodeStep::add_norm)
      .def("add_linear", &DecodeStep::add_linear)
      .def("bind", &DecodeStep::bind)
      .def("run", &DecodeStep::run);
}
