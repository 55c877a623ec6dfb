#include "reference/router_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "moe/device_errors.h"
#include "moe/error.h"

namespace moe::ref {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Scores of one row: s (the score function over all experts) and a (the scores the balancing
// losses use: softmax over all experts, or sigmoid normalised to sum 1).
struct RowScores {
  std::vector<double> s, a;
  double lse = 0;
};

RowScores row_scores(const RouterConfig& c, const double* z) {
  const int E = c.num_experts;
  RowScores r;
  r.s.resize(E);
  r.a.resize(E);
  double m = kNegInf;
  for (int e = 0; e < E; ++e) m = std::max(m, z[e]);
  double sum = 0;
  for (int e = 0; e < E; ++e) sum += std::exp(z[e] - m);
  r.lse = m + std::log(sum);
  std::vector<double> softmax(E);
  for (int e = 0; e < E; ++e) softmax[e] = std::exp(z[e] - m) / sum;
  if (c.score == ScoreFunction::kSoftmax) {
    r.s = softmax;
    r.a = softmax;
  } else {
    double ssum = 0;
    for (int e = 0; e < E; ++e) {
      r.s[e] = 1.0 / (1.0 + std::exp(-z[e]));
      ssum += r.s[e];
    }
    for (int e = 0; e < E; ++e) r.a[e] = r.s[e] / ssum;
  }
  return r;
}

// (value desc, id asc): the order of every selection.
bool better(double va, int a, double vb, int b) { return va > vb || (va == vb && a < b); }

// Relative gap |a - b| / max(|a|, |b|) of two values a decision compared (exact ties excluded:
// they are broken by id on every implementation).
void note_gap(double& margin, double a, double b) {
  const double gap = std::fabs(a - b) / std::max(std::fabs(a), std::fabs(b));
  if (gap > 0 && std::isfinite(gap)) margin = std::min(margin, gap);
}

// Selection of one good row: experts in order (first k chosen, then candidates); -1 past the
// allowed experts.
std::vector<int32_t> select_row(const RouterConfig& c, const double* z, const RowScores& sc, const double* bias,
                                int W, double& margin) {
  const int E = c.num_experts;
  std::vector<double> v(E);
  for (int e = 0; e < E; ++e) v[e] = (c.softmax_after_topk ? z[e] : sc.s[e]) + (bias ? bias[e] : 0.0);
  if (c.num_groups > 1) {
    const int G = c.num_groups, gs = E / G;
    std::vector<double> gscore(G);
    for (int g = 0; g < G; ++g) {
      std::vector<double> vals(v.begin() + g * gs, v.begin() + (g + 1) * gs);
      std::sort(vals.begin(), vals.end(), std::greater<double>());
      gscore[g] = vals[0] + (gs > 1 ? vals[1] : 0.0);
    }
    std::vector<int> order(G);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return better(gscore[a], a, gscore[b], b); });
    if (c.topk_groups < G) note_gap(margin, gscore[order[c.topk_groups - 1]], gscore[order[c.topk_groups]]);
    std::vector<bool> keep(G, false);
    for (int i = 0; i < c.topk_groups; ++i) keep[order[i]] = true;
    for (int e = 0; e < E; ++e)
      if (!keep[e / gs]) v[e] = kNegInf;
  }
  // Without a bias the logit itself orders the experts: the score is monotone in it, and the logit
  // still tells experts apart where their scores are equal in floating point (a saturated sigmoid,
  // an underflowed softmax). The kernels compare the logits too.
  std::vector<double> key = v;
  if (!bias && !c.softmax_after_topk)
    for (int e = 0; e < E; ++e)
      if (v[e] != kNegInf) key[e] = z[e];
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return better(key[a], a, key[b], b); });
  std::vector<int32_t> sel(W, -1);
  for (int w = 0; w < W; ++w)
    if (v[order[w]] != kNegInf) sel[w] = order[w];
  // Boundaries whose neighbours decide the chosen set and the candidate set.
  for (int b : {c.topk, W})
    if (b < E && v[order[b]] != kNegInf) note_gap(margin, v[order[b - 1]], v[order[b]]);
  return sel;
}

// Within one expert: keep the best `keep` of its entries by (key desc, token asc).
struct Entry {
  double key;
  int64_t token;
  size_t slot;
};

void keep_best(std::vector<Entry>& entries, int64_t keep, std::vector<uint8_t>& kept, double& margin, bool gap) {
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.key > b.key || (a.key == b.key && a.token < b.token);
  });
  for (size_t i = 0; i < entries.size(); ++i) kept[entries[i].slot] = static_cast<int64_t>(i) < keep;
  if (gap && keep > 0 && keep < static_cast<int64_t>(entries.size()))
    note_gap(margin, entries[keep - 1].key, entries[keep].key);
}

}  // namespace

RouterResult router_forward(const RouterConfig& c, const std::vector<double>& logits, int64_t T,
                            const std::vector<double>* bias) {
  validate_router_config(c);
  const int E = c.num_experts, k = c.topk, W = router_selection_width(c);
  MOE_CHECK(T >= 0 && logits.size() == static_cast<size_t>(T) * E, "argument 'logits': expected T*E = ", T * E,
            " values, got ", logits.size());
  MOE_CHECK(!c.expert_bias || (bias && bias->size() == static_cast<size_t>(E)), "argument 'bias': expected ", E,
            " values with expert_bias on");
  const double* b = c.expert_bias ? bias->data() : nullptr;
  const bool seq = c.seq_aux_loss_coeff != 0.0f;
  MOE_CHECK(!seq || T % c.seq_length == 0, "argument 'logits': T = ", T, " is not a multiple of seq_length = ",
            c.seq_length);
  const int64_t B = seq ? T / c.seq_length : 0;
  const double alpha = c.scaling_factor;

  RouterResult r;
  r.T = T;
  r.E = E;
  r.k = k;
  r.W = W;
  r.selected.assign(T * W, -1);
  r.kept.assign(T * W, 0);
  r.slot_prob.assign(T * W, 0.0);
  r.selection_counts.assign(E, 0);
  r.counts.assign(E, 0);
  r.seq_counts.assign(B * E, 0);
  bool bias_ok = true;
  for (int e = 0; b && e < E; ++e) bias_ok = bias_ok && std::isfinite(b[e]);

  std::vector<double> P(E, 0.0), Pseq(B * E, 0.0);
  std::vector<double> slot_value(T * W, 0.0);  // selection score of each selected slot
  double zsum = 0;
  for (int64_t t = 0; t < T; ++t) {
    const double* z = &logits[t * E];
    bool ok = bias_ok;
    for (int e = 0; e < E; ++e) ok = ok && std::isfinite(z[e]);
    if (!ok) {
      r.error_bits |= kErrNonFiniteLogit;
      continue;
    }
    const RowScores sc = row_scores(c, z);
    const std::vector<int32_t> sel = select_row(c, z, sc, b, W, r.decision_margin);
    std::copy(sel.begin(), sel.end(), r.selected.begin() + t * W);
    // Probs of the chosen experts, then of the candidates.
    double denom = 0, zmax = kNegInf;
    for (int i = 0; i < k; ++i) {
      denom += sc.s[sel[i]];
      zmax = std::max(zmax, z[sel[i]]);
    }
    double ez = 0;
    for (int i = 0; i < k; ++i) ez += std::exp(z[sel[i]] - zmax);
    for (int w = 0; w < W; ++w) {
      const int e = sel[w];
      if (e < 0) continue;
      double p;
      if (w >= k)
        p = sc.s[e];
      else if (c.softmax_after_topk)
        p = std::exp(z[e] - zmax) / ez;
      else
        p = c.normalize_topk ? sc.s[e] / denom : sc.s[e];
      r.slot_prob[t * W + w] = alpha * p;
      slot_value[t * W + w] = (c.softmax_after_topk ? z[e] : sc.s[e]) + (b ? b[e] : 0.0);
      r.kept[t * W + w] = w < k;
    }
    for (int i = 0; i < k; ++i) {
      ++r.selection_counts[sel[i]];
      if (seq) ++r.seq_counts[(t / c.seq_length) * E + sel[i]];
    }
    for (int e = 0; e < E; ++e) {
      P[e] += sc.a[e];
      if (seq) Pseq[(t / c.seq_length) * E + e] += sc.a[e];
    }
    zsum += sc.lse * sc.lse;
  }

  // Capacity / token rounding: per expert, over its chosen slots (and candidates when adding).
  const int64_t cap = router_capacity(c, T);
  if (cap >= 0 || c.rounding != TokenRounding::kNone) {
    std::vector<std::vector<Entry>> per(E);
    for (int64_t t = 0; t < T; ++t)
      for (int w = 0; w < W; ++w) {
        const int e = r.selected[t * W + w];
        if (e < 0) continue;
        const double key = cap < 0 ? slot_value[t * W + w]
                           : c.drop_policy == CapacityDropPolicy::kProb ? r.slot_prob[t * W + w]
                                                                        : 0.0;  // position: token order decides
        per[e].push_back({key, t, static_cast<size_t>(t * W + w)});
      }
    for (int e = 0; e < E; ++e) {
      if (cap >= 0) {
        keep_best(per[e], cap, r.kept, r.decision_margin, c.drop_policy == CapacityDropPolicy::kProb);
        continue;
      }
      // Rounding: the chosen slots rank before the candidates, each tier by selection score.
      std::vector<Entry> chosen, cand;
      for (const Entry& en : per[e]) (static_cast<int>(en.slot % W) < k ? chosen : cand).push_back(en);
      const int64_t target = router_rounded_count(c, static_cast<int64_t>(chosen.size()), T);
      const int64_t keep_chosen = std::min<int64_t>(target, chosen.size());
      keep_best(chosen, keep_chosen, r.kept, r.decision_margin, true);
      keep_best(cand, target - keep_chosen, r.kept, r.decision_margin, true);
    }
  }

  // Outputs.
  if (c.output_form == RoutingForm::kTopK) {
    r.indices.assign(T * k, -1);
    r.probs.assign(T * k, 0.0);
  } else {
    r.map.assign(T * E, 0);
    r.probs.assign(T * E, 0.0);
  }
  for (int64_t t = 0; t < T; ++t)
    for (int w = 0; w < W; ++w) {
      const size_t i = t * W + w;
      if (!r.kept[i]) continue;
      const int e = r.selected[i];
      ++r.counts[e];
      if (c.output_form == RoutingForm::kTopK) {
        r.indices[t * k + w] = e;
        r.probs[t * k + w] = r.slot_prob[i];
      } else {
        r.map[t * E + e] = 1;
        r.probs[t * E + e] = r.slot_prob[i];
      }
    }

  // Losses.
  if (T > 0 && c.aux_loss_coeff != 0.0f) {
    double acc = 0;
    for (int e = 0; e < E; ++e)
      acc += (static_cast<double>(r.selection_counts[e]) / (static_cast<double>(T) * k)) * (P[e] / T);
    r.aux_loss = c.aux_loss_coeff * E * acc;
  }
  if (B > 0) {
    const double L = static_cast<double>(c.seq_length);
    double acc = 0;
    for (int64_t s = 0; s < B; ++s)
      for (int e = 0; e < E; ++e)
        acc += (E / (k * L)) * r.seq_counts[s * E + e] * (Pseq[s * E + e] / L);
    r.seq_aux_loss = c.seq_aux_loss_coeff * acc / B;
  }
  if (T > 0 && c.z_loss_coeff != 0.0f) r.z_loss = c.z_loss_coeff * zsum / T;
  return r;
}

std::vector<double> router_backward(const RouterConfig& c, const std::vector<double>& logits, int64_t T,
                                    const RouterResult& f, const std::vector<double>& d_probs, double d_aux,
                                    double d_seq, double d_z) {
  const int E = c.num_experts, k = c.topk, W = f.W;
  const bool map = c.output_form == RoutingForm::kMap;
  MOE_CHECK(d_probs.empty() || d_probs.size() == static_cast<size_t>(T) * (map ? E : k),
            "argument 'd_probs': expected the probs' shape");
  const double alpha = c.scaling_factor;
  const bool seq = c.seq_aux_loss_coeff != 0.0f;
  const int64_t B = seq ? T / c.seq_length : 0;
  std::vector<double> dz(T * E, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* sel = &f.selected[t * W];
    if (sel[0] < 0) continue;  // a row with non-finite input: routed nowhere, zero gradient
    const double* z = &logits[t * E];
    const RowScores sc = row_scores(c, z);
    double* g_out = &dz[t * E];
    // Incoming gradient of each kept slot.
    std::vector<double> g(W, 0.0);
    for (int w = 0; w < W; ++w)
      if (f.kept[t * W + w] && !d_probs.empty()) g[w] = map ? d_probs[t * E + sel[w]] : d_probs[t * k + w];
    std::vector<double> u(E, 0.0);  // d / d score s
    if (c.softmax_after_topk) {
      double zmax = kNegInf, ez = 0, G = 0;
      for (int i = 0; i < k; ++i) zmax = std::max(zmax, z[sel[i]]);
      for (int i = 0; i < k; ++i) ez += std::exp(z[sel[i]] - zmax);
      for (int i = 0; i < k; ++i) G += g[i] * std::exp(z[sel[i]] - zmax) / ez;
      for (int i = 0; i < k; ++i) g_out[sel[i]] += alpha * std::exp(z[sel[i]] - zmax) / ez * (g[i] - G);
    } else {
      if (c.normalize_topk) {
        double S = 0, G = 0;
        for (int i = 0; i < k; ++i) S += sc.s[sel[i]];
        for (int i = 0; i < k; ++i) G += g[i] * sc.s[sel[i]] / S;
        for (int i = 0; i < k; ++i) u[sel[i]] += alpha * (g[i] - G) / S;
      } else {
        for (int i = 0; i < k; ++i) u[sel[i]] += alpha * g[i];
      }
      for (int w = k; w < W; ++w)
        if (sel[w] >= 0) u[sel[w]] += alpha * g[w];
    }
    // Balancing losses: d / d a.
    std::vector<double> ua(E, 0.0);
    for (int e = 0; e < E; ++e) {
      if (c.aux_loss_coeff != 0.0f)
        ua[e] += d_aux * c.aux_loss_coeff * E * (static_cast<double>(f.selection_counts[e]) / (double(T) * k)) / T;
      if (seq) {
        const double L = static_cast<double>(c.seq_length);
        ua[e] += d_seq * c.seq_aux_loss_coeff / B * (E / (k * L)) * f.seq_counts[(t / c.seq_length) * E + e] / L;
      }
    }
    if (c.score == ScoreFunction::kSoftmax) {
      // s = a = softmax(z): one chain for both.
      double dot = 0;
      for (int e = 0; e < E; ++e) dot += (u[e] + ua[e]) * sc.s[e];
      for (int e = 0; e < E; ++e) g_out[e] += sc.s[e] * (u[e] + ua[e] - dot);
    } else {
      // The balancing losses' term only where a loss is on: a row whose sigmoid scores all
      // underflow to 0 (logits below about -710 here, -88.7 in the device's fp32) has no
      // normalised scores (0 / 0) but, without a loss, no need of them either.
      const bool losses = c.aux_loss_coeff != 0.0f || seq;
      double ssum = 0, dot = 0;
      for (int e = 0; e < E; ++e) ssum += sc.s[e];
      for (int e = 0; e < E; ++e) dot += ua[e] * sc.a[e];
      for (int e = 0; e < E; ++e) {
        const double ds = u[e] + (losses ? (ua[e] - dot) / ssum : 0.0);
        g_out[e] += ds * sc.s[e] * (1.0 - sc.s[e]);
      }
    }
    if (c.z_loss_coeff != 0.0f) {
      std::vector<double> sm(E);
      double m = kNegInf, sum = 0;
      for (int e = 0; e < E; ++e) m = std::max(m, z[e]);
      for (int e = 0; e < E; ++e) sum += std::exp(z[e] - m);
      for (int e = 0; e < E; ++e) g_out[e] += d_z * c.z_loss_coeff / T * 2.0 * sc.lse * std::exp(z[e] - m) / sum;
    }
  }
  return dz;
}

std::vector<double> update_expert_bias(const std::vector<int64_t>& counts, const std::vector<double>& bias,
                                       double rate) {
  MOE_CHECK(counts.size() == bias.size(), "argument 'bias': expected one value per count");
  const int64_t E = static_cast<int64_t>(counts.size());
  int64_t total = 0;
  for (int64_t v : counts) total += v;
  std::vector<double> out(bias);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t diff = total - counts[e] * E;  // sign(mean - count) without rounding
    out[e] += rate * (diff > 0 ? 1.0 : diff < 0 ? -1.0 : 0.0);
  }
  return out;
}

}  // namespace moe::ref
