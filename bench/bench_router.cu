// Fused router: time and bandwidth of forward and backward for T in {16384, 32768, 65536},
// E in {8, 64, 128, 256}, k in {2, 8}, bf16 and fp32 logits, beside the device-to-device copy
// bandwidth measured in the same run.
//
// usage: bench_router [--repeats N] [--warm-l2] [--calls N] [--dtype bf16|fp32|both] [--T N] [--E N]
//                     [--k N] [--variant NAME] [--checksum]
//
// --calls N (default 1, at most 64) times N routers back to back in one graph, each with logits,
// outputs and gradients of its own, and reports the time per call: the graph launch and the gaps
// between kernels are shared by N calls, as in a stream of work, so the figure is the router's
// throughput rather than the latency of one call.
//
// --T / --E / --k / --variant keep one value of that axis (one kernel to profile); --T, --E and --k
// may also name a value outside the default axis (E >= k; the deepseek variant needs E >= 64 and
// E a multiple of its 8 groups). --checksum times
// nothing: it runs one forward + backward of each of a list of routers (every routing variant, form,
// loss and lane layout; T not a multiple of a warp's rows) and prints a hash of every output bit
// (indices / map, probs, selected, counts, losses, d logits), so two builds can be compared bit for
// bit. The timed table also ends each line with the hash of that router's outputs.
//
// "read us" is the read floor: a kernel that only reads the same logits (16-byte loads, one wave of
// blocks) and writes one word per warp, timed the same way -- what any router's forward pays at the
// least, its launch, ramp-up and tail included; "%cp" beside it is its rate against the copy's.
//
// GB/s counts the logits read once (T * E * element bytes) -- the floor of any router; the other traffic
// (indices / probs / selected written, d logits written) is listed at the end. Two comparisons with
// the device-to-device copy measured in the same run (a 2 GiB buffer, so DRAM-bound):
//   "%cp": the logits-read rate / the copy's bytes moved (read + write) per second;
//   "%rd": the logits-read rate / the copy's read rate (half of that).
// Routing variants: "mixtral" (softmax, top-k, renormalise), "deepseek" (sigmoid + bias, groups of
// E/8 keeping 4, renormalise, scaled; E >= 64), "losses" (mixtral + aux loss + z-loss). Medians of
// CUDA-event-timed replays of a graph holding one call; before each timed replay a 256 MiB write
// evicts the logits from L2 (they would otherwise stay there between replays: at most 32 MiB here),
// unless --warm-l2. Each time includes the graph launch of one call.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "device/cuda_check.h"
#include "moe/error_word.h"
#include "moe/router.h"
#include "support/bench_util.h"
#include "support/cli_checks.h"
#include "support/device_random.h"

namespace {

using namespace moe;

struct Variant {
  const char* name;
  void (*edit)(RouterConfig&);
};

// FNV-1a over the bytes of a device buffer.
uint64_t hash_device(uint64_t h, const void* p, size_t bytes) {
  std::vector<unsigned char> host(bytes);
  if (bytes) MOE_CUDA_CHECK(cudaMemcpy(host.data(), p, bytes, cudaMemcpyDeviceToHost));
  for (unsigned char c : host) h = (h ^ c) * 1099511628211ull;
  return h;
}

// The read floor: reads n 16-byte words (a grid-stride loop, four loads in flight per thread) and
// writes one word per warp, so that the loads cannot be dropped.
__global__ void read_floor_kernel(const uint4* __restrict__ p, int64_t n, uint32_t* __restrict__ out) {
  uint32_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = p[i];
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  for (int o = 16; o > 0; o /= 2) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) out[(static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32] = acc;
}

// One wave of read_floor_kernel blocks over the device.
struct ReadFloor {
  static constexpr int kThreads = 256;
  int blocks = 0;
  uint32_t* out = nullptr;
  ReadFloor() {
    int device = 0, sms = 0, per_sm = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_floor_kernel, kThreads, 0));
    blocks = sms * std::max(per_sm, 1);
    MOE_CUDA_CHECK(cudaMalloc(&out, sizeof(uint32_t) * blocks * (kThreads / 32)));
  }
  ~ReadFloor() { cudaFree(out); }
  // bytes: a multiple of 16 (every timed logits tensor: E is a multiple of 8 for bf16).
  void read(const void* p, size_t bytes, cudaStream_t s) const {
    read_floor_kernel<<<blocks, kThreads, 0, s>>>(static_cast<const uint4*>(p), static_cast<int64_t>(bytes / 16), out);
    MOE_CUDA_CHECK(cudaGetLastError());
  }
};

// One router on random logits: device buffers for every output and gradient; forward + backward.
struct Bench {
  RouterConfig cfg;
  int64_t T;
  bool bf16;
  Router router;
  int W, E, k;
  size_t esize;
  bool map;
  int64_t prob_cols, seqs;
  void *logits = nullptr, *dlogits = nullptr, *mapbuf = nullptr;
  float *probs = nullptr, *dprobs = nullptr, *bias = nullptr, *scalars = nullptr;
  int32_t *indices = nullptr, *selected = nullptr, *counts = nullptr, *selcounts = nullptr, *seqcounts = nullptr;
  int64_t* counts64 = nullptr;
  TensorView lv, bv, dv;
  RouterOutputs o;
  RouterGrads g;

  Bench(const RouterConfig& c, int64_t T_, bool bf16_, cudaStream_t stream)
      : cfg(c), T(T_), bf16(bf16_), router(c), W(router.selection_width()), E(c.num_experts), k(c.topk) {
    esize = bf16 ? 2 : 4;
    map = cfg.output_form == RoutingForm::kMap;
    prob_cols = map ? E : k;
    seqs = cfg.seq_aux_loss_coeff != 0.0f ? T / cfg.seq_length : 0;
    const DType dtype = bf16 ? DType::kBF16 : DType::kFP32;
    MOE_CUDA_CHECK(cudaMalloc(&logits, T * E * esize));
    MOE_CUDA_CHECK(cudaMalloc(&dlogits, T * E * esize));
    MOE_CUDA_CHECK(cudaMalloc(&probs, sizeof(float) * T * prob_cols));
    MOE_CUDA_CHECK(cudaMalloc(&dprobs, sizeof(float) * T * prob_cols));
    MOE_CUDA_CHECK(cudaMalloc(&bias, sizeof(float) * E));
    MOE_CUDA_CHECK(cudaMalloc(&scalars, sizeof(float) * 8));
    MOE_CUDA_CHECK(cudaMalloc(&selected, sizeof(int32_t) * T * W));
    MOE_CUDA_CHECK(cudaMalloc(&counts, sizeof(int32_t) * E));
    MOE_CUDA_CHECK(cudaMalloc(&counts64, sizeof(int64_t) * E));
    MOE_CUDA_CHECK(cudaMalloc(&selcounts, sizeof(int32_t) * E));
    if (map)
      MOE_CUDA_CHECK(cudaMalloc(&mapbuf, T * E));
    else
      MOE_CUDA_CHECK(cudaMalloc(&indices, sizeof(int32_t) * T * k));
    if (seqs) MOE_CUDA_CHECK(cudaMalloc(&seqcounts, sizeof(int32_t) * seqs * E));
    if (bf16)
      bench::fill_random_bf16(logits, T * E, 42, 1.0f, stream);
    else
      bench::fill_random_fp32(static_cast<float*>(logits), T * E, 42, 1.0f, stream);
    bench::fill_random_fp32(bias, E, 7, 0.05f, stream);
    bench::fill_random_fp32(dprobs, T * prob_cols, 9, 1.0f, stream);
    const float host_scalars[8] = {0, 0, 0, 1.0f, 1.0f, 1.0f, 0, 0};  // losses, then d aux / seq / z
    MOE_CUDA_CHECK(cudaMemcpyAsync(scalars, host_scalars, sizeof host_scalars, cudaMemcpyHostToDevice, stream));
    lv = TensorView(logits, dtype, {T, E});
    if (cfg.expert_bias) bv = TensorView(bias, DType::kFP32, {E});
    if (map) {
      o.map = TensorView(mapbuf, DType::kUInt8, {T, E});
      o.probs = TensorView(probs, DType::kFP32, {T, E});
    } else {
      o.indices = TensorView(indices, DType::kInt32, {T, k});
      o.probs = TensorView(probs, DType::kFP32, {T, k});
    }
    o.selected = TensorView(selected, DType::kInt32, {T, W});
    o.selection_counts = TensorView(selcounts, DType::kInt32, {E});
    o.counts = TensorView(counts, DType::kInt32, {E});
    o.counts_int64 = TensorView(counts64, DType::kInt64, {E});
    if (seqs) o.seq_counts = TensorView(seqcounts, DType::kInt32, {seqs, E});
    if (cfg.aux_loss_coeff != 0.0f) o.aux_loss = TensorView(scalars, DType::kFP32, {1});
    if (cfg.seq_aux_loss_coeff != 0.0f) o.seq_aux_loss = TensorView(scalars + 1, DType::kFP32, {1});
    if (cfg.z_loss_coeff != 0.0f) o.z_loss = TensorView(scalars + 2, DType::kFP32, {1});
    g.d_probs = TensorView(dprobs, DType::kFP32, {T, prob_cols});
    g.d_aux_loss = TensorView(scalars + 3, DType::kFP32, {1});
    g.d_seq_aux_loss = TensorView(scalars + 4, DType::kFP32, {1});
    g.d_z_loss = TensorView(scalars + 5, DType::kFP32, {1});
    dv = TensorView(dlogits, dtype, {T, E});
  }
  ~Bench() {
    for (void* p : {logits, dlogits, mapbuf, static_cast<void*>(probs), static_cast<void*>(dprobs),
                    static_cast<void*>(bias), static_cast<void*>(scalars), static_cast<void*>(indices),
                    static_cast<void*>(selected), static_cast<void*>(counts), static_cast<void*>(counts64),
                    static_cast<void*>(selcounts), static_cast<void*>(seqcounts)})
      if (p) cudaFree(p);
  }
  void forward(uint32_t* ew, cudaStream_t s) { router.forward(lv, bv, o, ew, s); }
  void backward(cudaStream_t s) { router.backward(lv, o, g, dv, s); }
  // Every output bit (after the last forward and backward).
  uint64_t hash() {
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    uint64_t h = 1469598103934665603ull;
    if (map)
      h = hash_device(h, mapbuf, T * E);
    else
      h = hash_device(h, indices, sizeof(int32_t) * T * k);
    h = hash_device(h, probs, sizeof(float) * T * prob_cols);
    h = hash_device(h, selected, sizeof(int32_t) * T * W);
    h = hash_device(h, selcounts, sizeof(int32_t) * E);
    h = hash_device(h, counts, sizeof(int32_t) * E);
    h = hash_device(h, counts64, sizeof(int64_t) * E);
    if (seqs) h = hash_device(h, seqcounts, sizeof(int32_t) * seqs * E);
    h = hash_device(h, scalars, sizeof(float) * 3);
    h = hash_device(h, dlogits, T * E * esize);
    return h;
  }
};

// The bit-for-bit suite: every routing variant, both forms, every loss, capacity and rounding, over
// every lane layout (E from 8 to 384, E % 8 != 0 for the element loads), T not a multiple of a
// warp's rows.
int run_checksums(cudaStream_t stream, ErrorWord& ew) {
  struct Named {
    const char* name;
    std::function<void(RouterConfig&)> edit;
  };
  const std::vector<Named> kinds = {
      {"mixtral", [](RouterConfig& c) { c.normalize_topk = true; }},
      {"olmoe", [](RouterConfig&) {}},
      {"gpt_oss", [](RouterConfig& c) { c.softmax_after_topk = true; }},
      {"sigmoid", [](RouterConfig& c) { c.score = ScoreFunction::kSigmoid; c.aux_loss_coeff = 0.01f; }},
      {"bias", [](RouterConfig& c) { c.normalize_topk = true; c.expert_bias = true; c.scaling_factor = 1.5f; }},
      {"deepseek",
       [](RouterConfig& c) {
         c.score = ScoreFunction::kSigmoid;
         c.normalize_topk = true;
         c.expert_bias = true;
         c.num_groups = c.num_experts % 8 == 0 ? 8 : 1;
         c.topk_groups = c.num_groups == 8 ? 4 : 1;
         c.scaling_factor = 2.5f;
       }},
      {"groups3",  // group shapes that do not span a power of two of lanes
       [](RouterConfig& c) {
         c.normalize_topk = true;
         c.num_groups = c.num_experts % 3 == 0 ? 3 : 1;
         c.topk_groups = c.num_groups == 3 ? 2 : 1;
       }},
      {"losses",
       [](RouterConfig& c) {
         c.normalize_topk = true;
         c.aux_loss_coeff = 0.01f;
         c.z_loss_coeff = 0.001f;
       }},
      {"seqloss",
       [](RouterConfig& c) {
         c.score = ScoreFunction::kSigmoid;
         c.normalize_topk = true;
         c.seq_aux_loss_coeff = 0.001f;
         c.seq_length = 128;
       }},
      {"map", [](RouterConfig& c) { c.normalize_topk = true; c.output_form = RoutingForm::kMap; c.aux_loss_coeff = 0.01f; }},
      {"capacity", [](RouterConfig& c) { c.normalize_topk = true; c.capacity_factor = 1.0; }},
      {"position",
       [](RouterConfig& c) {
         c.capacity_factor = 0.8;
         c.drop_policy = CapacityDropPolicy::kPosition;
         c.output_form = RoutingForm::kMap;
       }},
      {"round_nearest",
       [](RouterConfig& c) {
         c.normalize_topk = true;
         c.rounding = TokenRounding::kNearest;
         c.rounding_tile = 16;
         c.output_form = RoutingForm::kMap;
       }},
      {"round_down", [](RouterConfig& c) { c.rounding = TokenRounding::kDown; c.rounding_tile = 16; }},
  };
  uint64_t all = 1469598103934665603ull;
  int n = 0;
  for (const bool bf16 : {true, false})
    for (int E : {8, 12, 16, 32, 60, 64, 96, 128, 256, 384})
      for (int k : {1, 2, 8})
        for (const Named& kind : kinds) {
          if (k > E) continue;
          RouterConfig cfg;
          cfg.num_experts = E;
          cfg.topk = k;
          kind.edit(cfg);
          const std::string name = kind.name;
          if (cfg.num_groups > 1 && k > cfg.topk_groups * (E / cfg.num_groups)) continue;
          if ((name == "deepseek" || name == "groups3") && cfg.num_groups == 1) continue;
          if (cfg.rounding == TokenRounding::kNearest && 2 * k > std::min(32, E)) continue;
          const int64_t T = cfg.seq_aux_loss_coeff != 0.0f ? 2048 : 3001;
          cfg.max_tokens = T;
          Bench b(cfg, T, bf16, stream);
          b.forward(ew.device_ptr(), stream);
          b.backward(stream);
          ew.check(stream);
          const uint64_t h = b.hash();
          all = (all ^ h) * 1099511628211ull;
          ++n;
          std::printf("checksum %-14s %4s E=%3d k=%d T=%5lld %016llx\n", kind.name, bf16 ? "bf16" : "fp32", E, k,
                      static_cast<long long>(T), static_cast<unsigned long long>(h));
        }
  std::printf("checksum all (%d routers) %016llx\n", n, static_cast<unsigned long long>(all));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fused router: forward and backward time and logits-read GB/s, beside the copy bandwidth"};
  int repeats = 20, calls = 1;
  bool warm_l2 = false, checksum = false;
  std::string dtypes = "both", only_variant;
  int64_t only_T = 0;
  int only_E = 0, only_k = 0;
  // --repeats and --calls: out-of-range values are clamped into the range (CLI::Bound), as before.
  app.add_option("--repeats", repeats, "timed graph replays per measurement (median reported; at least 1)")
      ->transform(CLI::Bound(1, std::numeric_limits<int>::max()))
      ->transform(moe::cli::decimal_integer());  // added last: a transform runs before those added earlier
  app.add_flag("--warm-l2", warm_l2, "keep the logits in L2 between timed replays (no 256 MiB flush write)");
  app.add_option("--calls", calls, "time N routers back to back in one graph, each with buffers of its own (1..64)")
      ->transform(CLI::Bound(1, 64))
      ->transform(moe::cli::decimal_integer());  // added last: a transform runs before those added earlier
  app.add_option("--dtype", dtypes, "logits types: bf16, fp32 or both")->check(CLI::IsMember({"bf16", "fp32", "both"}));
  app.add_option("--T", only_T, "only this T (default: 16384, 32768, 65536; other values allowed)")
      ->transform(moe::cli::decimal_integer());
  app.add_option("--E", only_E, "only this E (default: 8, 64, 128, 256; E >= k; deepseek: E >= 64, a multiple of 8)")
      ->transform(moe::cli::decimal_integer());
  app.add_option("--k", only_k, "only this k (default: 2, 8; other values allowed)")
      ->transform(moe::cli::decimal_integer());
  app.add_option("--variant", only_variant, "only this routing variant: mixtral, deepseek or losses");
  app.add_flag("--checksum", checksum,
               "time nothing: hash every output bit of a list of routers (to compare two builds bit for bit)");
  CLI11_PARSE(app, argc, argv);
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ErrorWord ew;
  if (checksum) return run_checksums(stream, ew);
  const double copy_gbs = bench::copy_bandwidth_gbs(stream);
  const double copy_read_gbs = copy_gbs / 2;
  const size_t flush_bytes = size_t{256} << 20;
  void* flush = nullptr;
  if (!warm_l2) MOE_CUDA_CHECK(cudaMalloc(&flush, flush_bytes));
  // Before each timed replay (outside its events): overwrite the flush buffer, evicting the logits.
  int flushes = 0;
  std::function<void()> evict_l2;
  if (flush) evict_l2 = [&] { MOE_CUDA_CHECK(cudaMemsetAsync(flush, flushes++ & 0xff, flush_bytes, stream)); };
  std::printf("device: %s\n", bench::device_description().c_str());
  std::printf("device-to-device copy bandwidth (read + write): %.0f GB/s (read %.0f GB/s)\n", copy_gbs,
              copy_read_gbs);
  std::printf("L2 %s between timed replays\n", warm_l2 ? "kept warm" : "flushed");
  if (calls > 1)
    std::printf("time per call of %d routers back to back in one graph, each with buffers of its own\n", calls);
  std::printf("\n");
  std::printf("%-9s %4s %6s %4s %3s %9s %9s %6s %6s %9s %6s %9s %9s %6s %6s %16s\n", "variant", "type", "T", "E",
              "k", "fwd us", "fwd GB/s", "%cp", "%rd", "read us", "%cp", "bwd us", "bwd GB/s", "%cp", "%rd",
              "output hash");
  const ReadFloor read_floor;

  const Variant variants[] = {
      {"mixtral", [](RouterConfig& c) { c.normalize_topk = true; }},
      {"deepseek",
       [](RouterConfig& c) {
         c.score = ScoreFunction::kSigmoid;
         c.normalize_topk = true;
         c.expert_bias = true;
         c.num_groups = 8;
         c.topk_groups = 4;
         c.scaling_factor = 2.5f;
       }},
      {"losses",
       [](RouterConfig& c) {
         c.normalize_topk = true;
         c.aux_loss_coeff = 0.01f;
         c.z_loss_coeff = 0.001f;
       }},
  };
  const std::vector<int64_t> Ts = only_T ? std::vector<int64_t>{only_T} : std::vector<int64_t>{16384, 32768, 65536};
  const std::vector<int> Es = only_E ? std::vector<int>{only_E} : std::vector<int>{8, 64, 128, 256};
  const std::vector<int> ks = only_k ? std::vector<int>{only_k} : std::vector<int>{2, 8};
  for (const bool bf16 : {true, false})
    for (int64_t T : Ts)
      for (int E : Es)
        for (int k : ks)
          for (const Variant& v : variants) {
            if (std::string(v.name) == "deepseek" && E < 64) continue;
            if (k > E) continue;
            if (dtypes != "both" && (dtypes == "bf16") != bf16) continue;
            if (!only_variant.empty() && only_variant != v.name) continue;
            RouterConfig cfg;
            cfg.num_experts = E;
            cfg.topk = k;
            cfg.max_tokens = T;
            v.edit(cfg);
            Bench b(cfg, T, bf16, stream);
            // --calls: the others run first in each graph; b's outputs are the ones hashed.
            std::vector<std::unique_ptr<Bench>> others;
            for (int i = 1; i < calls; ++i) others.push_back(std::make_unique<Bench>(cfg, T, bf16, stream));
            auto ms_per_call = [&](const std::function<void(Bench&)>& call) {
              const auto all = [&] {
                for (auto& o : others) call(*o);
                call(b);
              };
              return bench::time_cuda_graph(all, stream, 5, repeats, evict_l2).median_ms / calls;
            };
            const double f_ms = ms_per_call([&](Bench& x) { x.forward(ew.device_ptr(), stream); });
            const double b_ms = ms_per_call([&](Bench& x) { x.backward(stream); });
            const double r_ms = ms_per_call([&](Bench& x) { read_floor.read(x.logits, x.esize * T * E, stream); });
            ew.check(stream);
            const uint64_t h = b.hash();
            const double bytes = static_cast<double>(b.esize) * T * E;
            const double fg = bytes / (f_ms * 1e-3) / 1e9, bg = bytes / (b_ms * 1e-3) / 1e9;
            const double rg = bytes / (r_ms * 1e-3) / 1e9;
            std::printf("%-9s %4s %6lld %4d %3d %9.1f %9.0f %5.1f%% %5.1f%% %9.1f %5.1f%% %9.1f %9.0f %5.1f%% %5.1f%% "
                        "%016llx\n",
                        v.name, bf16 ? "bf16" : "fp32", static_cast<long long>(T), E, k, f_ms * 1e3, fg,
                        100.0 * fg / copy_gbs, 100.0 * fg / copy_read_gbs, r_ms * 1e3, 100.0 * rg / copy_gbs,
                        b_ms * 1e3, bg, 100.0 * bg / copy_gbs, 100.0 * bg / copy_read_gbs,
                        static_cast<unsigned long long>(h));
            std::fflush(stdout);
          }
  std::printf("\nbytes per row (s = 2 for bf16, 4 for fp32 logits): forward reads sE (logits) and writes 8k\n"
              "(indices + probs) + 4W (selected); backward reads sE + 12k and writes sE (d logits).\n");
  if (flush) cudaFree(flush);
  cudaStreamDestroy(stream);
  return 0;
}
