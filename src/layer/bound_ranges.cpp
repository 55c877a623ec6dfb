#include "layer/bound_ranges.h"

#include <algorithm>
#include <string>

#include "moe/error.h"

namespace moe {
namespace {

std::string describe(const BoundRange& r) {
  return r.expert < 0 ? std::string("'") + r.name + "'"
                      : std::string("'") + r.name + "' (expert " + std::to_string(r.expert) + ")";
}

}  // namespace

void add_bound_ranges(std::vector<BoundRange>& out, const std::vector<TensorView>& views, const char* name) {
  const bool per_expert = views.size() > 1;
  for (size_t i = 0; i < views.size(); ++i) {
    const TensorView& v = views[i];
    if (v.data == nullptr || v.nbytes() == 0) continue;
    const auto begin = reinterpret_cast<uintptr_t>(v.data);
    out.push_back({name, per_expert ? static_cast<int>(i) : -1, begin, begin + static_cast<uintptr_t>(v.nbytes())});
  }
}

std::vector<BoundRange> expert_tensor_ranges(const ExpertTensors& t, bool grads) {
  static const char* const kWeights[] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  static const char* const kGrads[] = {"fc1.weight grad", "fc1.bias grad", "fc2.weight grad", "fc2.bias grad"};
  const char* const* names = grads ? kGrads : kWeights;
  std::vector<BoundRange> out;
  int i = 0;
  for (const std::vector<TensorView>* views : {&t.fc1_weight, &t.fc1_bias, &t.fc2_weight, &t.fc2_bias})
    add_bound_ranges(out, *views, names[i++]);
  return out;
}

void check_gradients_apart(const std::vector<BoundRange>& grads, const std::vector<BoundRange>& weights,
                           const char* call) {
  struct Entry {
    const BoundRange* range;
    bool grad;
  };
  std::vector<Entry> all;
  all.reserve(grads.size() + weights.size());
  for (const BoundRange& r : grads) all.push_back({&r, true});
  for (const BoundRange& r : weights) all.push_back({&r, false});
  std::sort(all.begin(), all.end(), [](const Entry& a, const Entry& b) { return a.range->begin < b.range->begin; });
  // Sweep by start: a range overlaps an earlier one iff that one ends past its start, so the
  // furthest-reaching earlier range (any, and any gradient) is the one to compare against.
  const BoundRange* reach_any = nullptr;
  const BoundRange* reach_grad = nullptr;
  for (const Entry& e : all) {
    const BoundRange& r = *e.range;
    const BoundRange* hit = e.grad ? reach_any : reach_grad;
    if (hit != nullptr && hit->end > r.begin) {
      const BoundRange& grad = e.grad ? r : *hit;
      const BoundRange& other = e.grad ? *hit : r;
      detail::throw_error(call, ": argument ", describe(grad), " overlaps ", describe(other),
                          ": a weight gradient must not share memory with a weight or another gradient");
    }
    if (reach_any == nullptr || r.end > reach_any->end) reach_any = &r;
    if (e.grad && (reach_grad == nullptr || r.end > reach_grad->end)) reach_grad = &r;
  }
}

}  // namespace moe
