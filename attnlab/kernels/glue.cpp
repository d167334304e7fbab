// The elementwise glue of a prefill's forward pass, as ops: RMSNorm and SiLU(gate) x up over rows.
//
// Why: in a 512-token prefill of SmolLM2 on one thread (Xeon), torch's rms_norm (a composite of pow, mean,
// rsqrt and two multiplies on CPU) and silu on the strided gate half, then a multiply, took ~90 ms of ~590
// (profiler), each pass a round trip through memory. One pass per row here, the arithmetic the native decode
// step uses (`attnlab_simd::rms_norm`, `silu_mul`), so prefill and decode normalise alike.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "kernels_simd.h"

namespace {

// x [..., D] float32 contiguous, w [D] -> x / rms(x) * w, rows split across threads.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && w.dim() == 1 &&
              x.size(-1) == w.size(0), "rms_norm: float32 x [..., D] and weight [D]");
  const auto xc = x.contiguous(), wc = w.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t D = w.size(0), rows = D ? xc.numel() / D : 0;
  const float *X = xc.data_ptr<float>(), *W = wc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) attnlab_simd::rms_norm(X + r * D, W, O + r * D, D, eps);
  });
  return out;
}

// h [..., 2H] float32 (gate, then up) -> silu(gate) * up [..., H].
torch::Tensor silu_mul(const torch::Tensor& h) {
  TORCH_CHECK(h.scalar_type() == torch::kFloat && h.dim() >= 1 && h.size(-1) % 2 == 0,
              "silu_mul: float32 [..., 2 hidden]");
  const auto hc = h.contiguous();
  const int64_t H = h.size(-1) / 2, rows = H ? hc.numel() / (2 * H) : 0;
  auto sizes = h.sizes().vec();
  sizes.back() = H;
  auto out = torch::empty(sizes, h.options());
  const float* G = hc.data_ptr<float>();
  float* A = out.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) attnlab_simd::silu_mul_row(G + r * 2 * H, A + r * H, 0, H, H);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor h) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("rms_norm", &rms_norm), m.impl("silu_mul", &silu_mul);
}
