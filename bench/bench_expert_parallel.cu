// Expert-parallel MoE layer forward per rank (docs/expert_parallel.md): the time of the
// capacity-mode dispatch (pack + all-to-all + local permute), of the experts (moe::GroupedExperts
// forward over the rank's E_local experts) and of the combine (gather + all-to-all back + slot
// sum), and the bandwidth of the bare all-to-all of the rows. Then the overlapped pipeline: the
// whole forward (dispatch + experts + combine) as one timed call, unchunked on one stream
// ("serial"), in n chunks on one stream ("chunked": the cost of chunking alone), and in n chunks
// with the all-to-alls on a communication stream ("overlapped": EpDispatcher::forward_overlapped),
// side by side, with the gain serial / overlapped and whether y is bitwise the same. With
// --dropless, a third table: the dropless eager mode's dispatch and combine per rank beside the
// capacity mode's.
//
// usage: bench_expert_parallel [SHAPE ...] [--ranks P] [--capacity-factor F] [--repeats N]
//                               [--chunks n] [--comm-sms S] [--graph] [--in-process] [--dropless]
//   SHAPE: named shapes of docs/shapes.md, read per rank: T tokens per rank, E = E_local experts
//   per rank, k; default qwen3-30b-a3b-ep8 and deepseek-v3-ep32.
//   Transport: NCCL over the first P visible GPUs (P = all of them by default), one host thread
//   per rank -- when the build has NCCL and there are >= 2 GPUs; otherwise (or with --in-process)
//   P ranks simulated on one GPU (default P = 2), where the ranks run one after the other on one
//   stream: the times are then of all ranks together, and the all-to-all is device-local copies.
//   Capacity C per (source, destination) pair = ceil(F * T * k / P) (F = 1.25 by default).
//   --chunks n: chunks of the overlapped pipeline (default 4; 1..64 and at most C). The
//   communication stream of each rank has the highest stream priority, so that the all-to-all's
//   blocks are scheduled ahead of waiting GEMM blocks.
//   --comm-sms S: the chunked pipeline's experts use at most (SMs - S) SMs (ExpertsConfig::max_sms),
//   leaving S to the all-to-all that overlaps them (default 0: every SM; the serial run always uses
//   every SM).
//   --graph: the three forwards of the pipeline table are captured in a CUDA graph per rank and
//   the replays timed (NCCL only; the in-process ranks' threads cannot share a thread-local capture).
//   --dropless: also time EpMode::kDroplessEager (dropless_max_rows = its default, P * T * min(k,
//   E_local)): its dispatch (with the counts exchange and its one host synchronisation) and its
//   combine, always eager (the mode is not capturable), beside the capacity mode's eager times,
//   and the most rows any rank received against the capacity mode's P * C.
//   NVLink multicast is switched off (NCCL_NVLS_ENABLE=0) before NCCL starts.
// Times: median over repeats of CUDA-event-timed eager calls after warm-up (bench/support); per
// rank, then the median and the maximum over ranks. All-to-all bandwidth: bytes each rank sends to
// the other ranks, (P - 1) * C * H * 2, over the median time of the rows exchange. In-process, the
// copies of every rank run on the one shared stream: the overlap is then only functional (the
// pipeline's results), not a measurement.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "device/cuda_check.h"
#include "moe/device_errors.h"
#include "moe/error_word.h"
#include "moe/expert_parallel.h"
#include "moe/grouped_experts.h"
#include "reference/routing_gen.h"
#include "support/bench_util.h"
#include "support/cli_checks.h"
#include "support/device_random.h"

#if MOE_HAVE_NCCL
#include <nccl.h>
#endif

namespace {

using namespace moe;

constexpr int kAlign = 128;  // rows per local expert group padded to a multiple of this

struct Rank {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaStream_t comm = nullptr;  // the overlapped pipeline's communication stream
  EpTransport* transport = nullptr;
  std::unique_ptr<EpDispatcher> ep;
  std::unique_ptr<GroupedExperts> ex;
  SavedState state, estate;
  // The chunked pipeline: its dispatcher (config.chunks = n), experts sized for one chunk's block
  // (the same weights), one experts state per chunk, its own x_perm, Y and y.
  std::unique_ptr<EpDispatcher> epn;
  std::unique_ptr<GroupedExperts> exn;
  SavedState staten;
  std::vector<SavedState> estaten;
  void *xn_perm = nullptr, *Yn = nullptr, *yn = nullptr;
  std::unique_ptr<ErrorWord> err;
  std::vector<DeviceBuffer> buffers;  // keeps every allocation alive
  void *x = nullptr, *x_perm = nullptr, *Y = nullptr, *y = nullptr, *w1 = nullptr, *w2 = nullptr;
  int32_t* idx = nullptr;
  float* probs = nullptr;
  bench::Timing dispatch, experts, combine, a2a, serial, chunked, overlapped;
  // --dropless: the dropless eager dispatcher, its state and x_perm (also its combine's Y: identity
  // experts), its y; its times.
  std::unique_ptr<EpDispatcher> epd;
  SavedState stated;
  void *xd_perm = nullptr, *yd = nullptr;
  bench::Timing d_dispatch, d_combine;

  void* alloc(size_t bytes) {
    buffers.push_back(cuda_malloc_allocator().allocate(bytes));
    return buffers.back().get();
  }
};

void run_threads(int n, const std::function<void(int)>& fn, InProcessGroup* group) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int p = 0; p < n; ++p)
    threads.emplace_back([&, p] {
      try {
        fn(p);
      } catch (...) {
        errors[p] = std::current_exception();
        if (group) group->abort();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// A stream of the highest priority (numerically the least value) on the current device.
cudaStream_t high_priority_stream() {
  int least = 0, greatest = 0;
  MOE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t s = nullptr;
  MOE_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
  return s;
}

// One line of the pipeline table, printed after the main table.
struct PipelineRow {
  std::string name;
  int P = 0, n = 0;
  double serial_med = 0, serial_max = 0, chunked_med = 0, chunked_max = 0, over_med = 0, over_max = 0;
  bool same_y = false;
};

// One line of the dropless table.
struct DroplessRow {
  std::string name;
  int P = 0;
  int64_t PC = 0, max_received = 0;
  double cap_med = 0, cap_max = 0, dis_med = 0, dis_max = 0, dcom_med = 0, dcom_max = 0, cap_com_med = 0,
         cap_com_max = 0;
};

}  // namespace

int main(int argc, char** argv) try {
  CLI::App app{"Expert-parallel MoE forward per rank: dispatch, experts, combine, all-to-all, overlapped pipeline"};
  std::vector<std::string> names;
  int repeats = 20, P = 0, chunks = 4, comm_sms = 0;
  double factor = 1.25;
  bool in_process = false, graph = false, dropless = false;
  app.add_option("SHAPE", names, "named shapes, read per rank (default: qwen3-30b-a3b-ep8 deepseek-v3-ep32)");
  app.add_option("--ranks", P, "ranks P (default: every visible GPU with NCCL, else 2 simulated on one GPU)")
      ->transform(moe::cli::decimal_integer());
  app.add_option("--capacity-factor", factor,
                 "capacity factor F: C = ceil(F * T * k / P) rows per (source, destination) pair");
  app.add_option("--repeats", repeats, "timed calls per measurement after warm-up (median reported)")
      ->transform(moe::cli::decimal_integer());
  app.add_option("--chunks", chunks, "chunks n of the overlapped pipeline (1..64 and at most C)")
      ->transform(moe::cli::decimal_integer())
      ->check(CLI::Range(1, 64));
  app.add_option("--comm-sms", comm_sms, "SMs the chunked pipeline's experts leave to the all-to-all (0: none)")
      ->transform(moe::cli::decimal_integer())
      ->check(CLI::Range(0, std::numeric_limits<int>::max()));
  app.add_flag("--graph", graph, "time CUDA-graph replays of the pipeline table's forwards (NCCL only)");
  app.add_flag("--in-process", in_process, "simulate the ranks on one GPU even with NCCL and >= 2 GPUs");
  app.add_flag("--dropless", dropless, "also time the dropless eager mode's dispatch and combine");
  CLI11_PARSE(app, argc, argv);
  if (names.empty()) names = {"qwen3-30b-a3b-ep8", "deepseek-v3-ep32"};
  int gpus = 0;
  MOE_CUDA_CHECK(cudaGetDeviceCount(&gpus));
  const bool use_nccl = !in_process && MOE_HAVE_NCCL && gpus >= 2;
  if (P <= 0) P = use_nccl ? gpus : 2;
  if (use_nccl && P > gpus) {
    std::fprintf(stderr, "--ranks %d: only %d GPUs\n", P, gpus);
    return 2;
  }
  if (graph && !use_nccl) {
    std::fprintf(stderr, "--graph: NCCL ranks only (in-process ranks share one stream from several threads)\n");
    return 2;
  }
  std::printf("# %s; transport: %s, P = %d ranks; capacity factor %.2f; pipeline: %d chunks%s, %d SMs left to "
              "communication\n",
              bench::device_description().c_str(),
              use_nccl ? "NCCL, one GPU per rank" : "in-process (all ranks simulated on GPU 0)", P, factor, chunks,
              graph ? ", graph-captured" : ", eager", comm_sms);

  std::unique_ptr<InProcessGroup> group;
  std::vector<std::unique_ptr<EpTransport>> nccl_transports;
#if MOE_HAVE_NCCL
  std::vector<ncclComm_t> comms;
#endif
  std::vector<EpTransport*> transports(P);
  std::vector<cudaStream_t> streams(P), comm_streams(P);
  if (use_nccl) {
#if MOE_HAVE_NCCL
    setenv("NCCL_NVLS_ENABLE", "0", 1);  // no NVLink multicast
    comms.resize(P);
    std::vector<int> devs(P);
    for (int p = 0; p < P; ++p) devs[p] = p;
    if (ncclCommInitAll(comms.data(), P, devs.data()) != ncclSuccess) {
      std::fprintf(stderr, "ncclCommInitAll failed\n");
      return 1;
    }
    for (int p = 0; p < P; ++p) {
      nccl_transports.push_back(std::make_unique<NcclTransport>(comms[p]));
      transports[p] = nccl_transports[p].get();
      MOE_CUDA_CHECK(cudaSetDevice(p));
      MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[p], cudaStreamNonBlocking));
      comm_streams[p] = high_priority_stream();
    }
#endif
  } else {
    group = std::make_unique<InProcessGroup>(P);
    MOE_CUDA_CHECK(cudaSetDevice(0));
    cudaStream_t s;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const cudaStream_t k = high_priority_stream();  // every simulated rank's copies: one stream
    for (int p = 0; p < P; ++p) {
      transports[p] = &group->endpoint(p);
      streams[p] = s;
      comm_streams[p] = k;
    }
  }

  std::vector<PipelineRow> pipeline;
  std::vector<DroplessRow> dropless_rows;
  std::printf("%-20s %3s %7s %6s | %-16s %-16s %-16s %-9s | %-16s %8s\n", "shape", "P", "C", "drop%",
              "dispatch ms", "experts ms", "combine ms", "sum ms", "all-to-all ms", "GB/s");
  std::printf("%-20s %3s %7s %6s | %-16s %-16s %-16s %-9s | %-16s %8s\n", "", "", "", "", "med/max rank",
              "med/max rank", "med/max rank", "med", "med/max rank", "per rank");
  for (const std::string& name : names) {
    const bench::Shape sh = bench::shape_by_name(name);
    const int El = sh.E, k = sh.k, E = P * El;
    const int64_t T = sh.T, H = sh.H, F = sh.F;
    const int64_t C = static_cast<int64_t>(std::ceil(factor * T * k / P));
    if (chunks > C) {
      std::printf("%-20s skipped: --chunks %d exceeds the capacity C = %lld\n", name.c_str(), chunks,
                  static_cast<long long>(C));
      continue;
    }
    EpDispatcherConfig cfg;
    cfg.ranks = P;
    cfg.local_experts = El;
    cfg.hidden = H;
    cfg.topk = k;
    cfg.align = kAlign;
    cfg.capacity = C;
    cfg.max_tokens = T;
    ExpertsConfig ec;
    ec.hidden = H;
    ec.ffn = F;
    ec.experts = El;
    const int64_t F1 = ec.fc1_out();
    // Device memory of one rank (rows of the exchange, x_perm / Y, the experts' activations, weights),
    // for the unchunked and the chunked dispatcher (n blocks of R_c rows).
    const int64_t R = P * C + int64_t{El} * (kAlign - 1);  // the dispatcher's default row bound
    const int64_t Rn = chunks * (P * ((C + chunks - 1) / chunks) + int64_t{El} * (kAlign - 1));
    const double per_rank = 2.0 * (4.0 * P * C * H + 2.0 * (R + Rn) * H + 3.0 * T * H + (R + Rn) * (F1 + F) * 2.0 +
                                   double(El) * (F1 * H + H * F));
    size_t free_b = 0, total_b = 0;
    MOE_CUDA_CHECK(cudaSetDevice(0));
    MOE_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    // --dropless: buffers of max(T * k, M) rows twice, x_perm of M + E_local * (A - 1) rows.
    const int64_t Md = P * T * std::min<int64_t>(k, El), Rd = Md + int64_t{El} * (kAlign - 1);
    const double per_rank_dropless = dropless ? 2.0 * (2.0 * std::max(T * k, Md) * H + Rd * H + T * H) : 0.0;
    const double need = (use_nccl ? 1 : P) * (per_rank + per_rank_dropless);
    if (need > 0.85 * static_cast<double>(free_b)) {
      std::printf("%-20s skipped: needs %.1f GiB on GPU 0, %.1f GiB free\n", name.c_str(), need / (1 << 30),
                  double(free_b) / (1 << 30));
      continue;
    }

    std::vector<Rank> ranks(P);
    for (int p = 0; p < P; ++p) {
      Rank& r = ranks[p];
      r.device = use_nccl ? p : 0;
      r.stream = streams[p];
      r.comm = comm_streams[p];
      r.transport = transports[p];
      MOE_CUDA_CHECK(cudaSetDevice(r.device));
      r.ep = std::make_unique<EpDispatcher>(cfg, *r.transport);
      ExpertsConfig e = ec;
      e.max_rows = r.ep->rows();
      r.ex = std::make_unique<GroupedExperts>(e);
      r.state = r.ep->new_state();
      r.estate = r.ex->new_state();
      r.err = std::make_unique<ErrorWord>();
      const int64_t Rr = r.ep->rows();
      r.x = r.alloc(T * H * 2);
      r.y = r.alloc(T * H * 2);
      r.x_perm = r.alloc(Rr * H * 2);
      r.Y = r.alloc(Rr * H * 2);
      r.w1 = r.alloc(El * F1 * H * 2);
      r.w2 = r.alloc(El * H * F * 2);
      bench::fill_random_bf16(r.x, T * H, 1 + p, 1.0f, r.stream);
      bench::fill_random_bf16(r.w1, El * F1 * H, 100 + p, 1.0f / std::sqrt(float(H)), r.stream);
      bench::fill_random_bf16(r.w2, El * H * F, 200 + p, 1.0f / std::sqrt(float(F)), r.stream);
      ExpertTensors w;
      w.fc1_weight = {TensorView(r.w1, DType::kBF16, {El, F1, H})};
      w.fc2_weight = {TensorView(r.w2, DType::kBF16, {El, H, F})};
      r.ex->set_weights(w);
      EpDispatcherConfig cn = cfg;
      cn.chunks = chunks;
      r.epn = std::make_unique<EpDispatcher>(cn, *r.transport);
      e.max_rows = r.epn->chunk_rows();
      if (comm_sms > 0) {
        int sms = 0;
        MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, r.device));
        e.max_sms = std::max(1, sms - comm_sms);
      }
      r.exn = std::make_unique<GroupedExperts>(e);
      r.exn->set_weights(w);
      r.staten = r.epn->new_state();
      for (int j = 0; j < chunks; ++j) r.estaten.push_back(r.exn->new_state());
      if (dropless) {
        EpDispatcherConfig cd = cfg;
        cd.mode = EpMode::kDroplessEager;
        r.epd = std::make_unique<EpDispatcher>(cd, *r.transport);
        r.stated = r.epd->new_state();
        r.xd_perm = r.alloc(r.epd->rows() * H * 2);
        r.yd = r.alloc(T * H * 2);
      }
      r.xn_perm = r.alloc(r.epn->rows() * H * 2);
      r.Yn = r.alloc(r.epn->rows() * H * 2);
      r.yn = r.alloc(T * H * 2);
      const ref::Routing rt = ref::make_topk_routing(T, E, k, 1000 + p);
      std::vector<float> pr(rt.probs.begin(), rt.probs.end());
      r.idx = static_cast<int32_t*>(r.alloc(rt.indices.size() * 4 + 4));
      r.probs = static_cast<float*>(r.alloc(pr.size() * 4 + 4));
      MOE_CUDA_CHECK(cudaMemcpy(r.idx, rt.indices.data(), rt.indices.size() * 4, cudaMemcpyHostToDevice));
      MOE_CUDA_CHECK(cudaMemcpy(r.probs, pr.data(), pr.size() * 4, cudaMemcpyHostToDevice));
      MOE_CUDA_CHECK(cudaStreamSynchronize(r.stream));
    }
    auto dispatch = [&](int p) {
      Rank& r = ranks[p];
      RoutingView rv;
      rv.indices = TensorView(r.idx, DType::kInt32, {T, k});
      rv.probs = TensorView(r.probs, DType::kFP32, {T, k});
      r.ep->plan_and_dispatch(rv, TensorView(r.x, DType::kBF16, {T, H}), r.err->device_ptr(), r.state,
                              TensorView(r.x_perm, DType::kBF16, {r.ep->rows(), H}), r.stream);
    };
    auto experts = [&](int p) {
      Rank& r = ranks[p];
      r.estate.reset();  // the timing repeats the forward of one micro-batch; its backward never runs
      const TensorView xp(r.x_perm, DType::kBF16, {r.ep->rows(), H}), Y(r.Y, DType::kBF16, {r.ep->rows(), H});
      r.ex->forward(xp, r.ep->group_offsets(r.state), r.ep->probs_perm(r.state), Y, r.estate, r.stream);
    };
    auto combine = [&](int p) {
      Rank& r = ranks[p];
      r.ep->combine(r.state, TensorView(r.Y, DType::kBF16, {r.ep->rows(), H}), TensorView(r.y, DType::kBF16, {T, H}),
                    MergeProbs::kNone, r.stream);
    };
    auto a2a = [&](int p) {
      Rank& r = ranks[p];
      const TensorView s = r.ep->send_buffer(), d = r.ep->recv_buffer();
      const EpExchange x{s.data, d.data, static_cast<size_t>(C * H * 2)};
      r.transport->all_to_all(&x, 1, r.stream);
    };
    // The dropless eager mode: dispatch, and combine with identity experts (Y = x_perm).
    auto d_dispatch = [&](int p) {
      Rank& r = ranks[p];
      RoutingView rv;
      rv.indices = TensorView(r.idx, DType::kInt32, {T, k});
      rv.probs = TensorView(r.probs, DType::kFP32, {T, k});
      r.epd->plan_and_dispatch(rv, TensorView(r.x, DType::kBF16, {T, H}), r.err->device_ptr(), r.stated,
                               TensorView(r.xd_perm, DType::kBF16, {r.epd->rows(), H}), r.stream);
    };
    auto d_combine = [&](int p) {
      Rank& r = ranks[p];
      r.epd->combine(r.stated, TensorView(r.xd_perm, DType::kBF16, {r.epd->rows(), H}),
                     TensorView(r.yd, DType::kBF16, {T, H}), MergeProbs::kNone, r.stream);
    };
    // The whole forward, unchunked on one stream.
    auto serial = [&](int p) {
      dispatch(p);
      experts(p);
      combine(p);
    };
    // The whole forward in n chunks; overlapped: the all-to-alls on the communication stream.
    auto chunked = [&](int p, bool overlap) {
      Rank& r = ranks[p];
      RoutingView rv;
      rv.indices = TensorView(r.idx, DType::kInt32, {T, k});
      rv.probs = TensorView(r.probs, DType::kFP32, {T, k});
      const int64_t Rr = r.epn->rows();
      const EpChunkFn ex = [&r](const EpChunk& c, cudaStream_t s) {
        r.estaten[c.index].reset();  // forward only, repeated
        r.exn->forward(c.in, c.group_offsets, c.probs_perm, c.out, r.estaten[c.index], s);
      };
      r.epn->forward_overlapped(rv, TensorView(r.x, DType::kBF16, {T, H}), r.err->device_ptr(), r.staten,
                                TensorView(r.xn_perm, DType::kBF16, {Rr, H}), TensorView(r.Yn, DType::kBF16, {Rr, H}),
                                TensorView(r.yn, DType::kBF16, {T, H}), MergeProbs::kNone, ex, r.stream,
                                overlap ? r.comm : r.stream);
    };
    const int warm = 3;
    const auto timer = graph ? bench::time_cuda_graph : bench::time_cuda;
    if (use_nccl) {
      run_threads(P, [&](int p) {
        Rank& r = ranks[p];
        MOE_CUDA_CHECK(cudaSetDevice(r.device));
        r.dispatch = bench::time_cuda([&] { dispatch(p); }, r.stream, warm, repeats);
        r.experts = bench::time_cuda([&] { experts(p); }, r.stream, warm, repeats);
        r.combine = bench::time_cuda([&] { combine(p); }, r.stream, warm, repeats);
        r.a2a = bench::time_cuda([&] { a2a(p); }, r.stream, warm, repeats);
        r.serial = timer([&] { serial(p); }, r.stream, warm, repeats, nullptr);
        r.chunked = timer([&] { chunked(p, false); }, r.stream, warm, repeats, nullptr);
        r.overlapped = timer([&] { chunked(p, true); }, r.stream, warm, repeats, nullptr);
        if (dropless) {
          r.d_dispatch = bench::time_cuda([&] { d_dispatch(p); }, r.stream, warm, repeats);
          r.d_combine = bench::time_cuda([&] { d_combine(p); }, r.stream, warm, repeats);
        }
      }, nullptr);
    } else {  // every rank's call in one timed step, on the shared stream
      auto all = [&](const std::function<void(int)>& f) {
        return [&, f] { run_threads(P, [&](int p) { MOE_CUDA_CHECK(cudaSetDevice(0)); f(p); }, group.get()); };
      };
      const bench::Timing td = bench::time_cuda(all(dispatch), streams[0], warm, repeats);
      const bench::Timing te = bench::time_cuda(all(experts), streams[0], warm, repeats);
      const bench::Timing tc = bench::time_cuda(all(combine), streams[0], warm, repeats);
      const bench::Timing ta = bench::time_cuda(all(a2a), streams[0], warm, repeats);
      const bench::Timing ts = bench::time_cuda(all(serial), streams[0], warm, repeats);
      const bench::Timing tn = bench::time_cuda(all([&](int p) { chunked(p, false); }), streams[0], warm, repeats);
      const bench::Timing to = bench::time_cuda(all([&](int p) { chunked(p, true); }), streams[0], warm, repeats);
      bench::Timing tdd, tdc;
      if (dropless) {
        tdd = bench::time_cuda(all(d_dispatch), streams[0], warm, repeats);
        tdc = bench::time_cuda(all(d_combine), streams[0], warm, repeats);
      }
      for (Rank& r : ranks) {
        r.d_dispatch = tdd;
        r.d_combine = tdc;
        r.dispatch = td;
        r.experts = te;
        r.combine = tc;
        r.a2a = ta;
        r.serial = ts;
        r.chunked = tn;
        r.overlapped = to;
      }
    }
    int64_t drops = 0;
    uint32_t bits = 0;
    bool same_y = true;  // the pipeline's y bitwise the unchunked forward's, on every rank
    for (Rank& r : ranks) {
      MOE_CUDA_CHECK(cudaSetDevice(r.device));
      MOE_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<int64_t> d(P), dn(P);
      MOE_CUDA_CHECK(cudaMemcpy(d.data(), r.ep->dropped(r.state).data, P * 8, cudaMemcpyDeviceToHost));
      MOE_CUDA_CHECK(cudaMemcpy(dn.data(), r.epn->dropped(r.staten).data, P * 8, cudaMemcpyDeviceToHost));
      same_y = same_y && d == dn;
      std::vector<uint16_t> y(T * H), yn(T * H);
      MOE_CUDA_CHECK(cudaMemcpy(y.data(), r.y, T * H * 2, cudaMemcpyDeviceToHost));
      MOE_CUDA_CHECK(cudaMemcpy(yn.data(), r.yn, T * H * 2, cudaMemcpyDeviceToHost));
      same_y = same_y && y == yn;
      for (int64_t v : d) drops += v;
      bits |= r.err->fetch_and_clear(r.stream) & ~uint32_t{kErrRowOverflow};  // drops are expected
    }
    if (bits) std::fprintf(stderr, "%s: unexpected error bits: %s\n", name.c_str(), describe_error_bits(bits).c_str());
    auto stat = [&](bench::Timing Rank::*t, double* med, double* mx) {
      std::vector<double> v;
      for (Rank& r : ranks) v.push_back((r.*t).median_ms);
      *med = median_of(v);
      *mx = *std::max_element(v.begin(), v.end());
    };
    double dm, dx, em, ex, cm, cx, am, ax;
    stat(&Rank::dispatch, &dm, &dx);
    stat(&Rank::experts, &em, &ex);
    stat(&Rank::combine, &cm, &cx);
    stat(&Rank::a2a, &am, &ax);
    PipelineRow row;
    row.name = name;
    row.P = P;
    row.n = chunks;
    row.same_y = same_y;
    stat(&Rank::serial, &row.serial_med, &row.serial_max);
    stat(&Rank::chunked, &row.chunked_med, &row.chunked_max);
    stat(&Rank::overlapped, &row.over_med, &row.over_max);
    pipeline.push_back(row);
    if (dropless) {
      DroplessRow d;
      d.name = name;
      d.P = P;
      d.PC = P * C;
      for (Rank& r : ranks) {
        int64_t received = 0;
        for (int64_t n : r.epd->received_rows(r.stated)) received += n;
        d.max_received = std::max(d.max_received, received);
      }
      d.cap_med = dm;
      d.cap_max = dx;
      d.cap_com_med = cm;
      d.cap_com_max = cx;
      stat(&Rank::d_dispatch, &d.dis_med, &d.dis_max);
      stat(&Rank::d_combine, &d.dcom_med, &d.dcom_max);
      dropless_rows.push_back(d);
    }
    const double gbs = double(P - 1) * C * H * 2 / (am * 1e-3) / 1e9;
    std::printf("%-20s %3d %7lld %6.2f | %7.3f/%-8.3f %7.3f/%-8.3f %7.3f/%-8.3f %-9.3f | %7.3f/%-8.3f %8.1f\n",
                name.c_str(), P, static_cast<long long>(C), 100.0 * drops / (double(T) * k * P), dm, dx, em, ex,
                cm, cx, dm + em + cm, am, ax, gbs);
    std::fflush(stdout);
    for (Rank& r : ranks) {
      MOE_CUDA_CHECK(cudaSetDevice(r.device));
      MOE_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  std::printf("\n# pipeline: dispatch + experts + combine per rank, one timed call each (%s); serial: unchunked, one\n"
              "# stream; chunked: %d chunks, one stream; overlapped: %d chunks, all-to-alls on the communication "
              "stream%s\n",
              graph ? "graph replays" : "eager", chunks, chunks,
              use_nccl ? "" : "\n# (in-process: every rank's copies on one stream, the overlap is only functional)");
  std::printf("%-20s %3s %3s | %-16s %-16s %-16s | %-6s %-6s | %s\n", "shape", "P", "n", "serial ms", "chunked ms",
              "overlapped ms", "gain", "gain", "y bitwise");
  std::printf("%-20s %3s %3s | %-16s %-16s %-16s | %-6s %-6s | %s\n", "", "", "", "med/max rank", "med/max rank",
              "med/max rank", "med", "max", "= serial");
  for (const PipelineRow& r : pipeline)
    std::printf("%-20s %3d %3d | %7.3f/%-8.3f %7.3f/%-8.3f %7.3f/%-8.3f | %5.2fx %5.2fx | %s\n", r.name.c_str(), r.P,
                r.n, r.serial_med, r.serial_max, r.chunked_med, r.chunked_max, r.over_med, r.over_max,
                r.serial_med / r.over_med, r.serial_max / r.over_max, r.same_y ? "yes" : "NO");
  if (dropless) {
    std::printf("\n# dropless eager (EpMode::kDroplessEager, eager calls, one host synchronisation per dispatch) "
                "beside capacity mode (eager), per rank; rows: the most any rank received (dropless) vs P * C\n");
    std::printf("%-20s %3s | %-9s %-9s | %-16s %-16s %-6s | %-16s %-16s %-6s\n", "shape", "P", "rows", "P * C",
                "dispatch cap ms", "dispatch drop ms", "ratio", "combine cap ms", "combine drop ms", "ratio");
    std::printf("%-20s %3s | %-9s %-9s | %-16s %-16s %-6s | %-16s %-16s %-6s\n", "", "", "max rank", "", "med/max rank",
                "med/max rank", "med", "med/max rank", "med/max rank", "med");
    for (const DroplessRow& d : dropless_rows)
      std::printf("%-20s %3d | %-9lld %-9lld | %7.3f/%-8.3f %7.3f/%-8.3f %5.2fx | %7.3f/%-8.3f %7.3f/%-8.3f %5.2fx\n",
                  d.name.c_str(), d.P, static_cast<long long>(d.max_received), static_cast<long long>(d.PC), d.cap_med,
                  d.cap_max, d.dis_med, d.dis_max, d.dis_med / d.cap_med, d.cap_com_med, d.cap_com_max, d.dcom_med,
                  d.dcom_max, d.dcom_med / d.cap_com_med);
  }
  bool all_same = true;
  for (const PipelineRow& r : pipeline) all_same = all_same && r.same_y;
#if MOE_HAVE_NCCL
  for (size_t p = 0; p < comms.size(); ++p) ncclCommDestroy(comms[p]);
#endif
  if (!all_same) {
    std::fprintf(stderr, "bench_expert_parallel: the overlapped pipeline's y differs from the unchunked forward's\n");
    return 1;
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_expert_parallel: %s\n", e.what());
  return 1;
}
