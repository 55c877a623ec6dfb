// Grouped GEMM benchmark: TFLOP/s of fprop, dgrad and wgrad for the fc1 (N = 2F, K = H) and fc2
// (N = H, K = F) products of every named shape, balanced and skewed routing, beside a cuBLAS dense
// GEMM of the same total size in the same run (the practical ceiling).
//
// Groups: tokens per expert from make_topk_routing (docs/shapes.md, Routing), padded to 128 rows as
// the layer dispatches them. TFLOP/s = 2 * T*k * N * K / time: padding rows are computed but not
// counted (docs/semantics.md, FLOP convention), for ours and for the dense ceiling alike (whose M is
// the padded row count).
//
// Timing: GPU clocks on the H100 depend on power draw, so back-to-back measurements of different
// kernels drift by up to ~10%. Every measurement of one (shape, fc, op) -- ours eager, ours in a
// CUDA graph, cuBLAS and, with --all-configs, every tile configuration -- is therefore interleaved:
// after a warm-up, R rounds each time one batch (>= ~4 ms) of every candidate in rotating order, and
// the median per-launch time over the rounds is reported.
//
// --fp8 adds the FP8 block-scaled products (E4M3, 1x128 token blocks, 128x128 weight blocks,
// docs/gemm.md) to the same interleaved measurements: operands quantized once beforehand (not
// timed), fprop and dgrad writing bf16, wgrad fp32 (written, or accumulated into main_grad). The
// token scales are MN-major, as the layer writes them. --fp8-scale-baselines also times each FP8
// product with its scales where the kernels' scale producers take their other path (the "base"
// column, graph-captured): fprop and dgrad with row-major token scales (16-byte register loads),
// wgrad with copies of its scales one word off the 16-byte alignment of the bulk copies (word by
// word).
//
// --groups-json writes the group sizes so that bench/torch_grouped_mm.py times torch._grouped_mm on
// exactly the same groups (the same way, beside torch's own cuBLAS); --json writes our figures for
// that script's side-by-side table.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "device/cuda_check.h"
#include "moe/grouped_gemm.h"
#include "moe/quantize.h"
#include "reference/routing_gen.h"
#include "support/bench_util.h"
#include "support/cli_checks.h"
#include "support/dense_gemm.h"
#include "support/interleaved_timing.h"

namespace {

using moe::DType;
using moe::ExpertMatrices;
using moe::GemmOp;
using moe::GroupedGemm;
using moe::TensorView;
using moe::bench::Candidate;
using moe::bench::dense_gemm;
using moe::bench::DeviceMem;
using moe::bench::interleaved_ms;
using moe::bench::tflops;

void fill(const DeviceMem& m, int64_t n, uint32_t seed, cudaStream_t s) { moe::bench::fill_bf16_uniform(m.p, n, seed, s); }

// Group sizes of a named shape: tokens per expert, padded to `align` rows.
struct Groups {
  std::vector<int32_t> padded;  // rows per expert in the buffer
  int64_t useful = 0;           // T * k routed rows (FLOPs count only these)
  int64_t rows = 0;             // sum of padded
};

Groups make_groups(const moe::bench::Shape& s, double skew, int align) {
  const moe::ref::Routing r = moe::ref::make_topk_routing(s.T, s.E, s.k, /*seed=*/1234, skew);
  std::vector<int64_t> count(s.E, 0);
  for (int32_t e : r.indices)
    if (e >= 0) ++count[e];
  Groups g;
  for (int64_t c : count) {
    const int64_t p = (c + align - 1) / align * align;
    g.padded.push_back(int32_t(p));
    g.useful += c;
    g.rows += p;
  }
  return g;
}

// The FP8 operands of one (shape, fc): every copy the three products read, quantized from the
// bf16 buffers (docs/gemm.md, FP8).
struct Fp8Operands {
  static constexpr int64_t kB = 128;
  static int64_t blocks(int64_t n) { return (n + kB - 1) / kB; }
  // The MN-major scale count of a rowwise copy of [rows, cols] (quantize's layout, rows padded to 4).
  static int64_t mn_scales(int64_t rows, int64_t cols) {
    moe::QuantConfig c;
    c.scale_layout = moe::ScaleLayout::kMNMajor;
    const moe::ScaleShape sh = moe::scale_shape(c, rows, cols);
    return sh.rows * sh.cols;
  }
  // Token copies: rowwise data with MN-major scales (xrs, dyrs) and the same scales row-major
  // (xrs_rm, dyrs_rm); columnwise data and scales (wgrad). Weights: both copies.
  DeviceMem xr, xrs, xrs_rm, xc, xcs, dyr, dyrs, dyrs_rm, dyc, dycs, wr, wrs, wc, wcs;
  DeviceMem xcs_off, dycs_off;  // the columnwise scales again from the second word (16-byte misaligned)
  TensorView xrs_mn, dyrs_mn;   // views of xrs and dyrs as quantize wrote them
  Fp8Operands(const void* x, const void* dy, const void* w, int64_t R, int64_t N, int64_t K, int64_t E,
              cudaStream_t s)
      : xr(R * K), xrs(mn_scales(R, K) * 4), xrs_rm(R * blocks(K) * 4), xc(R * K), xcs(blocks(R) * K * 4),
        dyr(R * N), dyrs(mn_scales(R, N) * 4), dyrs_rm(R * blocks(N) * 4), dyc(R * N), dycs(blocks(R) * N * 4),
        wr(E * N * K), wrs(E * blocks(N) * blocks(K) * 4), wc(E * N * K), wcs(E * blocks(N) * blocks(K) * 4),
        xcs_off((blocks(R) * K + 1) * 4), dycs_off((blocks(R) * N + 1) * 4) {
    using moe::QuantizedTensor;
    moe::QuantConfig rowwise, rowwise_rm, columnwise, weights;
    rowwise.scale_layout = moe::ScaleLayout::kMNMajor;
    columnwise.rowwise = false, columnwise.columnwise = true, columnwise.scale_layout = moe::ScaleLayout::kMNMajor;
    weights.blocking = moe::QuantBlocking::k2D, weights.columnwise = true;
    auto token = [&](const void* src, int64_t cols, const DeviceMem& r, const DeviceMem& rs, const DeviceMem& rs_rm,
                     const DeviceMem& c, const DeviceMem& cs, TensorView& rs_mn) {
      const TensorView v(const_cast<void*>(src), DType::kBF16, {R, cols});
      QuantizedTensor q;
      q.rowwise_data = TensorView(r.p, DType::kFP8E4M3, {R, cols});
      const moe::ScaleShape sh = moe::scale_shape(rowwise, R, cols);
      rs_mn = q.rowwise_scale = TensorView(rs.p, DType::kFP32, {sh.rows, sh.cols});
      moe::quantize(rowwise, v, q, s);
      q.rowwise_scale = TensorView(rs_rm.p, DType::kFP32, {R, blocks(cols)});  // the same codes again
      moe::quantize(rowwise_rm, v, q, s);
      QuantizedTensor qc;
      qc.columnwise_data = TensorView(c.p, DType::kFP8E4M3, {cols, R});
      qc.columnwise_scale = TensorView(cs.p, DType::kFP32, {blocks(R), cols});
      moe::quantize(columnwise, v, qc, s);
    };
    token(x, K, xr, xrs, xrs_rm, xc, xcs, xrs_mn);
    token(dy, N, dyr, dyrs, dyrs_rm, dyc, dycs, dyrs_mn);
    MOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<float*>(xcs_off.p) + 1, xcs.p, blocks(R) * K * 4,
                                   cudaMemcpyDeviceToDevice, s));
    MOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<float*>(dycs_off.p) + 1, dycs.p, blocks(R) * N * 4,
                                   cudaMemcpyDeviceToDevice, s));
    QuantizedTensor qw;
    qw.rowwise_data = TensorView(wr.p, DType::kFP8E4M3, {E, N, K});
    qw.rowwise_scale = TensorView(wrs.p, DType::kFP32, {E, blocks(N), blocks(K)});
    qw.columnwise_data = TensorView(wc.p, DType::kFP8E4M3, {E, K, N});
    qw.columnwise_scale = TensorView(wcs.p, DType::kFP32, {E, blocks(K), blocks(N)});
    moe::quantize(weights, TensorView(const_cast<void*>(w), DType::kBF16, {E, N, K}), qw, s);
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Grouped GEMM (fprop/dgrad/wgrad) TFLOP/s on the named shapes, beside cuBLAS dense"};
  std::vector<std::string> shapes, products, routings;
  std::string json_out, groups_out;
  bool all_configs = false, fp8 = false, fp8_scale_baselines = false;
  int rounds = 9;
  int tile_run = 1;
  double skew = 1.0;
  app.add_option("--shape", shapes, "named shapes or T,H,F,E,k (default: every named shape)");
  app.add_option("--json", json_out, "write our figures to this JSON file");
  app.add_option("--groups-json", groups_out, "write the group sizes (for torch_grouped_mm.py)");
  app.add_flag("--fp8", fp8, "also time the FP8 block-scaled products in the same measurements");
  app.add_flag("--fp8-scale-baselines", fp8_scale_baselines,
               "with --fp8: also time the scale producers' other paths (row-major token scales; wgrad scales "
               "off the bulk-copy alignment), graph-captured: the base column");
  app.add_flag("--all-configs", all_configs, "also time every compiled tile configuration and raster order");
  app.add_option("--rounds", rounds, "interleaved timing rounds per measurement (median reported)")
      ->transform(moe::cli::decimal_integer())
      ->check(CLI::Range(1, 1000));
  app.add_option("--skew", skew, "Zipf-like skew of the skewed routing");
  app.add_option("--product", products, "only these products, e.g. fc2:fprop (default: all; for profiling one kernel)");
  app.add_option("--tile-run", tile_run, "with --all-configs: consecutive cluster tiles per CTA visit for every alternative")
      ->transform(moe::cli::decimal_integer())
      ->check(CLI::Range(1, 1024));
  app.add_option("--routing", routings, "only these routings: balanced, skewed (default: both)")
      ->check(CLI::IsMember({"balanced", "skewed"}));
  CLI11_PARSE(app, argc, argv);
  shapes = moe::bench::shape_args_or_all(std::move(shapes));

  const moe::bench::CublasOnStream on_stream;
  cudaStream_t stream = on_stream.stream;
  cublasHandle_t blas = on_stream.blas;
  std::printf("device: %s\n", moe::bench::device_description().c_str());
  std::printf("TFLOP/s = 2*T*k*N*K / median time (padding rows not counted); groups padded to 128 rows\n");
  std::printf("%-18s %-8s %-3s %-9s %6s %6s %7s %8s %8s %8s%s  %s\n", "shape", "routing", "fc", "op", "N", "K",
              "rows", "ours", "graph", "cublas", fp8 ? "      fp8 fp8graph  fp8/bf16" : "", "config [alternatives]");

  nlohmann::json results = nlohmann::json::array(), groups_json = nlohmann::json::array();
  for (const std::string& name : shapes) {
    const moe::bench::Shape s = moe::bench::parse_shape(name);
    for (const auto& [routing, sk] : {std::pair<const char*, double>{"balanced", 0.0}, {"skewed", skew}}) {
      if (!routings.empty() && std::find(routings.begin(), routings.end(), routing) == routings.end()) continue;
      const Groups g = make_groups(s, sk, 128);
      groups_json.push_back({{"shape", s.name}, {"routing", routing}, {"T", s.T}, {"H", s.H}, {"F", s.F},
                             {"E", s.E}, {"k", s.k}, {"useful_rows", g.useful}, {"sizes", g.padded}});
      std::vector<int32_t> off{0};
      for (int32_t p : g.padded) off.push_back(off.back() + p);
      DeviceMem d_off(off.size() * sizeof(int32_t));
      // On the non-blocking stream the kernels run on (a plain cudaMemcpy would not be ordered before them).
      MOE_CUDA_CHECK(cudaMemcpyAsync(d_off.p, off.data(), off.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      const TensorView offs(d_off.p, DType::kInt32, {int64_t(s.E) + 1});
      const int64_t R = g.rows;
      // The weight-dim bound lets the 192-wide FP8 configurations run (their restated weight scales).
      GroupedGemm gg(s.E, R, 0, std::max<int64_t>(2 * s.F, s.H));
      DeviceMem gws(static_cast<int64_t>(gg.workspace_bytes()));
      const TensorView ws(gws.p, DType::kUInt8, {static_cast<int64_t>(gg.workspace_bytes())});

      for (int fc = 1; fc <= 2; ++fc) {
        const int64_t N = fc == 1 ? 2 * s.F : s.H, K = fc == 1 ? s.H : s.F;
        DeviceMem x(R * K * 2), w(int64_t(s.E) * N * K * 2), y(R * N * 2), dy(R * N * 2), dx(R * K * 2);
        DeviceMem dw(int64_t(s.E) * N * K * 2), mg(int64_t(s.E) * N * K * 4);
        fill(x, R * K, 1, stream);
        fill(w, int64_t(s.E) * N * K, 2, stream);
        fill(dy, R * N, 3, stream);
        MOE_CUDA_CHECK(cudaMemsetAsync(mg.p, 0, int64_t(s.E) * N * K * 4, stream));
        const TensorView tx(x.p, DType::kBF16, {R, K}), ty(y.p, DType::kBF16, {R, N});
        const TensorView tdy(dy.p, DType::kBF16, {R, N}), tdx(dx.p, DType::kBF16, {R, K});
        const ExpertMatrices mw = ExpertMatrices::grouped(TensorView(w.p, DType::kBF16, {s.E, N, K}), "w");
        const ExpertMatrices mdw = ExpertMatrices::grouped(TensorView(dw.p, DType::kBF16, {s.E, N, K}), "dw");
        const ExpertMatrices mmg =
            ExpertMatrices::grouped(TensorView(mg.p, DType::kFP32, {s.E, N, K}), "main_grad");
        const double flops = 2.0 * double(g.useful) * double(N) * double(K);
        std::unique_ptr<Fp8Operands> q;
        if (fp8) q = std::make_unique<Fp8Operands>(x.p, dy.p, w.p, R, N, K, int64_t(s.E), stream);
        // baseline: row-major token scales (fprop, dgrad), or scales one word off the 16-byte
        // alignment (wgrad: a_scale from dycs_off, b_scale from xcs_off).
        auto fp8_run = [&](GemmOp op, bool accumulate, bool baseline) {
          using moe::GemmProblem;
          const int64_t E = s.E;
          const auto nb = Fp8Operands::blocks(N), kb = Fp8Operands::blocks(K), rb = Fp8Operands::blocks(R);
          GemmProblem p;
          p.op = op;
          p.group_offsets = offs;
          if (op == GemmOp::kFprop) {
            p.a = TensorView(q->xr.p, DType::kFP8E4M3, {R, K});
            p.a_scale = baseline ? TensorView(q->xrs_rm.p, DType::kFP32, {R, kb}) : q->xrs_mn;
            p.a_scale_layout = baseline ? moe::ScaleLayout::kRowMajor : moe::ScaleLayout::kMNMajor;
            p.w = ExpertMatrices::grouped(TensorView(q->wr.p, DType::kFP8E4M3, {E, N, K}), "w");
            p.w_scale = ExpertMatrices::grouped(TensorView(q->wrs.p, DType::kFP32, {E, nb, kb}), "w_scale", 4);
            p.d = ty;
          } else if (op == GemmOp::kDgrad) {
            p.a = TensorView(q->dyr.p, DType::kFP8E4M3, {R, N});
            p.a_scale = baseline ? TensorView(q->dyrs_rm.p, DType::kFP32, {R, nb}) : q->dyrs_mn;
            p.a_scale_layout = baseline ? moe::ScaleLayout::kRowMajor : moe::ScaleLayout::kMNMajor;
            p.w = ExpertMatrices::grouped(TensorView(q->wc.p, DType::kFP8E4M3, {E, K, N}), "w").as_transposed();
            p.w_scale =
                ExpertMatrices::grouped(TensorView(q->wcs.p, DType::kFP32, {E, kb, nb}), "w_scale", 4).as_transposed();
            p.d = tdx;
          } else {
            p.a = TensorView(q->dyc.p, DType::kFP8E4M3, {N, R});
            p.a_scale =
                TensorView(baseline ? static_cast<float*>(q->dycs_off.p) + 1 : q->dycs.p, DType::kFP32, {rb, N});
            p.b = TensorView(q->xc.p, DType::kFP8E4M3, {K, R});
            p.b_scale =
                TensorView(baseline ? static_cast<float*>(q->xcs_off.p) + 1 : q->xcs.p, DType::kFP32, {rb, K});
            p.w = mmg;
            p.epilogue = accumulate ? moe::GemmEpilogue::kAccumulate : moe::GemmEpilogue::kStore;
          }
          return [&gg, p, &ws, &stream] { gg.run(p, ws, stream); };
        };

        struct OpRun {
          const char* label;
          GemmOp op;
          DType out;
          std::function<void()> ours, dense;
          bool accumulate = false;
        };
        const std::vector<OpRun> runs = {
            {"fprop", GemmOp::kFprop, DType::kBF16, [&] { gg.fprop(tx, mw, offs, ty, ws, stream); },
             [&] { dense_gemm(blas, x.p, w.p, y.p, R, N, K, false, true); }},
            {"dgrad", GemmOp::kDgrad, DType::kBF16, [&] { gg.dgrad(tdy, mw, offs, tdx, ws, stream); },
             [&] { dense_gemm(blas, dy.p, w.p, dx.p, R, K, N, false, false); }},
            {"wgrad", GemmOp::kWgrad, DType::kBF16, [&] { gg.wgrad(tdy, tx, offs, mdw, false, ws, stream); },
             [&] { dense_gemm(blas, dy.p, x.p, dw.p, N, K, R, true, false); }},
            {"wgrad_acc", GemmOp::kWgrad, DType::kFP32, [&] { gg.wgrad(tdy, tx, offs, mmg, true, ws, stream); }, nullptr,
             true},
        };
        for (const OpRun& r : runs) {
          const std::string product = "fc" + std::to_string(fc) + ":" + r.label;
          if (!products.empty() && std::find(products.begin(), products.end(), product) == products.end()) continue;
          gg.force_config(r.op, "");
          const std::string chosen = gg.chosen_config(r.op, N, K, r.out, r.accumulate);
          std::vector<Candidate> cands = {{"ours", r.ours, false}, {"graph", r.ours, true}};
          if (r.dense) cands.push_back({"cublas", r.dense, false});
          size_t fp8_at = 0, fp8_rm_at = 0;
          // FP8 dgrad runs the fprop-form kernels, so its configuration is forced as fprop's.
          const GemmOp fp8_op = r.op == GemmOp::kWgrad ? GemmOp::kWgrad : GemmOp::kFprop;
          const DType fp8_out = r.op == GemmOp::kWgrad ? DType::kFP32 : DType::kBF16;
          std::vector<std::pair<std::string, bool>> fp8_alt;
          if (fp8) {  // fp32 wgrad output either way: the bf16 row compares against a written fp32 gradient
            fp8_at = cands.size();
            const std::function<void()> f = fp8_run(r.op, r.accumulate, false);
            const std::function<void()> heuristic = [&gg, f, fp8_op] {
              gg.force_config(fp8_op, "");
              f();
            };
            cands.push_back({"fp8", heuristic, false});
            cands.push_back({"fp8_graph", heuristic, true});
            if (fp8_scale_baselines) {
              fp8_rm_at = cands.size();
              const std::function<void()> f_rm = fp8_run(r.op, r.accumulate, true);
              cands.push_back({"fp8_base_graph", [&gg, f_rm, fp8_op] {
                                 gg.force_config(fp8_op, "");
                                 f_rm();
                               },
                               true});
            }
            if (all_configs)
              for (const std::string& c : GroupedGemm::configs(fp8_op, fp8_out, DType::kFP8E4M3))
                for (bool along_n : {false, true}) {
                  fp8_alt.push_back({c, along_n});
                  cands.push_back({c + (along_n ? "/N" : "/M"), [&gg, f, fp8_op, c, along_n] {
                                     gg.force_config(fp8_op, c, along_n);
                                     f();
                                   },
                                   false});
                }
          }
          // Alternatives: every compiled configuration in both tile orders (force_config before each
          // launch, since all candidates share one GroupedGemm). The rows GEMM ("rows_*") has one
          // order of its own and no tile runs.
          std::vector<std::pair<std::string, bool>> alt_cfg;
          if (all_configs)
            for (const std::string& c : GroupedGemm::configs(r.op, r.out)) {
              const bool rows_gemm = c.rfind("rows_", 0) == 0;
              for (bool along_n : {false, true}) {
                if (rows_gemm && along_n) continue;
                const int run = rows_gemm ? 1 : tile_run;
                alt_cfg.push_back({c, along_n});
                cands.push_back({c + (along_n ? "/N" : "/M"), [&, c, along_n, run] {
                                   gg.force_config(r.op, c, along_n, run);
                                   r.ours();
                                 },
                                 false});
              }
            }
          // The heuristic candidates must not inherit a forced configuration.
          cands[0].fn = cands[1].fn = [&] {
            gg.force_config(r.op, "");
            r.ours();
          };
          const std::vector<double> ms = interleaved_ms(cands, stream, rounds);
          gg.force_config(r.op, "");
          gg.force_config(fp8_op, "");
          const double dense = r.dense ? tflops(flops, ms[2]) : 0.0;
          nlohmann::json rec = {{"shape", s.name}, {"routing", routing}, {"fc", fc}, {"op", r.label}, {"N", N},
                                {"K", K}, {"E", s.E}, {"rows", R}, {"useful_rows", g.useful},
                                {"config", chosen}, {"ours_ms", ms[0]}, {"ours_tflops", tflops(flops, ms[0])},
                                {"ours_graph_tflops", tflops(flops, ms[1])}, {"cublas_tflops", dense}};
          std::string fp8_cols;
          if (fp8) {
            rec["fp8_tflops"] = tflops(flops, ms[fp8_at]);
            rec["fp8_graph_tflops"] = tflops(flops, ms[fp8_at + 1]);
            char buf[64];
            std::snprintf(buf, sizeof buf, " %8.1f %8.1f %8.2fx", tflops(flops, ms[fp8_at]),
                          tflops(flops, ms[fp8_at + 1]), ms[0] / ms[fp8_at]);
            fp8_cols = buf;
            if (fp8_rm_at > 0) {
              rec["fp8_scale_baseline_graph_tflops"] = tflops(flops, ms[fp8_rm_at]);
              std::snprintf(buf, sizeof buf, " base=%.1f", tflops(flops, ms[fp8_rm_at]));
              fp8_cols += buf;
            }
          }
          std::string alts;
          if (all_configs) {
            nlohmann::json alt = nlohmann::json::object();
            // The FP8 alternatives follow the two FP8 candidates; the bf16 alternatives come last.
            std::vector<size_t> alt_at;
            for (size_t i = 0; i < fp8_alt.size(); ++i) alt_at.push_back(fp8_at + (fp8_rm_at > 0 ? 3 : 2) + i);
            for (size_t i = 0; i < alt_cfg.size(); ++i) alt_at.push_back(cands.size() - alt_cfg.size() + i);
            for (size_t i : alt_at) {
              alt[cands[i].label] = tflops(flops, ms[i]);
              char buf[96];
              std::snprintf(buf, sizeof buf, " %s=%.0f", cands[i].label.c_str(), tflops(flops, ms[i]));
              alts += buf;
            }
            rec["alternatives"] = alt;
          }
          results.push_back(rec);
          std::printf("%-18s %-8s fc%d %-9s %6lld %6lld %7lld %8.1f %8.1f %8.1f%s  %s%s\n", s.name, routing, fc,
                      r.label, (long long)N, (long long)K, (long long)R, tflops(flops, ms[0]), tflops(flops, ms[1]),
                      dense, fp8_cols.c_str(), chosen.c_str(), alts.c_str());
          std::fflush(stdout);
        }
      }
    }
  }
  if (!json_out.empty()) std::ofstream(json_out) << results.dump(1) << "\n";
  if (!groups_out.empty()) std::ofstream(groups_out) << groups_json.dump(1) << "\n";
  return 0;
}
