// TORCH_LIBRARY operators of the grouped GEMM: fprop / dgrad / wgrad over device group offsets,
// weights as one [E, N, K] tensor. The engine holds configuration only (one per device and E,
// created once the arguments are checked); each call takes its argument arrays and CUTLASS
// workspace from PyTorch's allocator, so calls on any streams, in graphs or not, never share them
// (the first call on a device must be eager: it allocates the device error word).
// Offsets that are not 0-based, decrease or run past the rows are clamped on the device and
// reported through a device error word: grouped_mm_check_errors() raises them (it synchronises).
#include <torch/library.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "csrc/torch_interop.h"
#include "moe/error_word.h"
#include "moe/grouped_gemm.h"

namespace moe::torch_ext {
namespace {

constexpr int64_t kMaxRows = (int64_t(1) << 31) - 1;

struct DeviceEngines {
  std::map<int, std::unique_ptr<GroupedGemm>> by_experts;
  std::unique_ptr<ErrorWord> errors;
};

DeviceEngines& device_engines() {
  static std::mutex mu;
  static std::map<int, DeviceEngines> all;
  int device = 0;
  cudaGetDevice(&device);
  std::lock_guard<std::mutex> lock(mu);
  DeviceEngines& d = all[device];
  if (!d.errors) {
    // The error word is allocated and zeroed synchronously, once per device: not inside a capture.
    MOE_CHECK(!capturing(), "moe_engine.grouped_mm: the first call on a device must run outside CUDA graph capture ",
              "(it allocates the device error word); run one eager call before capturing");
    d.errors = std::make_unique<ErrorWord>();
  }
  return d;
}

const GroupedGemm& engine(int experts) {
  static std::mutex mu;
  DeviceEngines& d = device_engines();
  std::lock_guard<std::mutex> lock(mu);
  auto& e = d.by_experts[experts];
  if (!e) e = std::make_unique<GroupedGemm>(experts, kMaxRows);
  return *e;
}

// Shapes first, so that no engine is made for (and no size is read from) a bad argument.
int check_operands(const at::Tensor& a, const char* a_name, const at::Tensor& w, const char* w_name,
                   const at::Tensor& group_offsets) {
  require_dims(a, a_name, 2);
  require_dims(w, w_name, 3);
  require_dims(group_offsets, "group_offsets", 1);
  MOE_CHECK(w.size(0) >= 1 && w.size(0) <= 65535, "argument '", w_name, "': expected 1..65535 experts, got ",
            int64_t{w.size(0)});
  MOE_CHECK(group_offsets.size(0) == w.size(0) + 1, "argument 'group_offsets': expected ", int64_t{w.size(0) + 1},
            " entries (experts + 1), got ", int64_t{group_offsets.size(0)});
  return static_cast<int>(w.size(0));
}

void run(const GemmProblem& p, int experts, const at::Tensor& like) {
  const GroupedGemm& g = engine(experts);
  at::Tensor ws = at::empty({static_cast<int64_t>(g.workspace_bytes(experts))}, like.options().dtype(at::kByte));
  GemmProblem q = p;
  q.error_word = device_engines().errors->device_ptr();
  g.run(q, view(ws, "workspace"), current_stream());
}

// x [R, K], w [E, N, K] -> y [R, N]  (rows past group_offsets[E] are zero)
at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& group_offsets) {
  return translate_errors([&] {
    const int E = check_operands(x, "x", w, "w", group_offsets);
    at::Tensor y = at::zeros({x.size(0), w.size(1)}, x.options());
    GemmProblem p;
    p.op = GemmOp::kFprop;
    p.a = view(x, "x");
    p.w = ExpertMatrices::grouped(view(w, "w"), "w");
    p.d = view(y, "y");
    p.group_offsets = view(group_offsets, "group_offsets");
    run(p, E, x);
    return y;
  });
}

// dy [R, N], w [E, N, K] -> dx [R, K]
at::Tensor grouped_mm_dgrad(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& group_offsets) {
  return translate_errors([&] {
    const int E = check_operands(dy, "dy", w, "w", group_offsets);
    at::Tensor dx = at::zeros({dy.size(0), w.size(2)}, dy.options());
    GemmProblem p;
    p.op = GemmOp::kDgrad;
    p.a = view(dy, "dy");
    p.w = ExpertMatrices::grouped(view(w, "w"), "w");
    p.d = view(dx, "dx");
    p.group_offsets = view(group_offsets, "group_offsets");
    run(p, E, dy);
    return dx;
  });
}

// dy [R, N], x [R, K] -> dw [E, N, K] (bf16), E = group_offsets.size(0) - 1
at::Tensor grouped_mm_wgrad(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& group_offsets) {
  return translate_errors([&] {
    require_dims(dy, "dy", 2);
    require_dims(x, "x", 2);
    require_dims(group_offsets, "group_offsets", 1);
    const int64_t E = group_offsets.size(0) - 1;
    MOE_CHECK(E >= 1 && E <= 65535, "argument 'group_offsets': expected 2..65536 entries (experts + 1), got ",
              int64_t{group_offsets.size(0)});
    at::Tensor dw = at::empty({E, dy.size(1), x.size(1)}, dy.options());
    GemmProblem p;
    p.op = GemmOp::kWgrad;
    p.a = view(dy, "dy");
    p.b = view(x, "x");
    p.w = ExpertMatrices::grouped(view(dw, "dw"), "dw");
    p.group_offsets = view(group_offsets, "group_offsets");
    run(p, static_cast<int>(E), dy);
    return dw;
  });
}

void grouped_mm_check_errors() {
  translate_errors([&] {
    device_engines().errors->check(current_stream());
    return 0;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_engine, m) {
  m.def("grouped_mm(Tensor x, Tensor w, Tensor group_offsets) -> Tensor");
  m.def("grouped_mm_dgrad(Tensor dy, Tensor w, Tensor group_offsets) -> Tensor");
  m.def("grouped_mm_wgrad(Tensor dy, Tensor x, Tensor group_offsets) -> Tensor");
  m.def("grouped_mm_check_errors() -> ()", &grouped_mm_check_errors);
}

TORCH_LIBRARY_IMPL(moe_engine, CUDA, m) {
  m.impl("grouped_mm", &grouped_mm);
  m.impl("grouped_mm_dgrad", &grouped_mm_dgrad);
  m.impl("grouped_mm_wgrad", &grouped_mm_wgrad);
}

}  // namespace moe::torch_ext
