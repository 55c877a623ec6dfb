// TORCH_LIBRARY operators of the grouped GEMM: fprop / dgrad / wgrad over device group offsets,
// weights as one [E, N, K] tensor. One moe::GroupedGemm (argument arrays + workspace at fixed
// addresses) per (device, E, rows) serves every call of that shape, in stream order: calls of one
// shape on two concurrent streams (or parallel graph branches) would share those arrays -- use one
// stream for these functional ops (the GroupedMLP module has its own engine).
#include <torch/library.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "csrc/torch_interop.h"
#include "moe/grouped_gemm.h"

namespace moe::torch_ext {
namespace {

GroupedGemm& engine(int experts, int64_t rows) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int64_t>, std::unique_ptr<GroupedGemm>> engines;
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(mu);
  auto& e = engines[{device, experts, rows}];
  if (!e) e = std::make_unique<GroupedGemm>(experts, rows);
  return *e;
}

// x [R, K], w [E, N, K] -> y [R, N]  (rows past group_offsets[E] are left as allocated: zeroed here)
at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& group_offsets) {
  return translate_errors([&] {
    at::Tensor y = at::zeros({x.size(0), w.size(1)}, x.options());
    engine(static_cast<int>(w.size(0)), x.size(0))
        .fprop(view(x), ExpertMatrices::grouped(view(w), "w"), view(group_offsets), view(y), current_stream());
    return y;
  });
}

// dy [R, N], w [E, N, K] -> dx [R, K]
at::Tensor grouped_mm_dgrad(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& group_offsets) {
  return translate_errors([&] {
    at::Tensor dx = at::zeros({dy.size(0), w.size(2)}, dy.options());
    engine(static_cast<int>(w.size(0)), dy.size(0))
        .dgrad(view(dy), ExpertMatrices::grouped(view(w), "w"), view(group_offsets), view(dx), current_stream());
    return dx;
  });
}

// dy [R, N], x [R, K] -> dw [E, N, K] (bf16), E = group_offsets.size(0) - 1
at::Tensor grouped_mm_wgrad(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& group_offsets) {
  return translate_errors([&] {
    const int E = static_cast<int>(group_offsets.size(0)) - 1;
    at::Tensor dw = at::empty({E, dy.size(1), x.size(1)}, dy.options());
    engine(E, dy.size(0))
        .wgrad(view(dy), view(x), view(group_offsets), ExpertMatrices::grouped(view(dw), "dw"), false,
               current_stream());
    return dw;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_engine, m) {
  m.def("grouped_mm(Tensor x, Tensor w, Tensor group_offsets) -> Tensor");
  m.def("grouped_mm_dgrad(Tensor dy, Tensor w, Tensor group_offsets) -> Tensor");
  m.def("grouped_mm_wgrad(Tensor dy, Tensor x, Tensor group_offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_engine, CUDA, m) {
  m.impl("grouped_mm", &grouped_mm);
  m.impl("grouped_mm_dgrad", &grouped_mm_dgrad);
  m.impl("grouped_mm_wgrad", &grouped_mm_wgrad);
}

}  // namespace moe::torch_ext
