// InProcessGroup: P simulated ranks on one device (see include/moe/expert_parallel.h). Each rank
// is a host thread; an all_to_all (or all_to_all_v) is a host barrier at which the last rank to
// arrive checks that every rank made the same call and enqueues every rank's copies on the shared
// stream. The barrier orders enqueueing only (no device sync).
#include <condition_variable>
#include <mutex>
#include <utility>
#include <vector>

#include "device/cuda_check.h"
#include "ep/exchange_check.h"
#include "moe/error.h"
#include "moe/expert_parallel.h"

namespace moe {

namespace {

struct GroupCore;

class Endpoint final : public EpTransport {
 public:
  Endpoint(GroupCore* group, int rank, int ranks) : group_(group), rank_(rank), ranks_(ranks) {}
  int rank() const override { return rank_; }
  int ranks() const override { return ranks_; }
  void all_to_all(const EpExchange* exchanges, int count, cudaStream_t stream) override;
  void all_to_all_v(const EpVarExchange* exchanges, int count, cudaStream_t stream) override;

 private:
  GroupCore* group_;
  int rank_, ranks_;
};

// One rank's variable-size exchange, its host arrays copied (the caller's may go once it returns).
struct VarCall {
  const char* send = nullptr;
  char* recv = nullptr;
  std::vector<size_t> send_bytes, send_offsets, recv_bytes, recv_offsets;
};

// One rank's call of the current round: fixed-size blocks or per-peer sizes.
struct Call {
  bool variable = false;
  std::vector<EpExchange> fixed;
  std::vector<VarCall> var;
  size_t count() const { return variable ? var.size() : fixed.size(); }
};

struct GroupCore {
  int P = 0;
  mutable std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::vector<Call> pending;                     // [P] the calls of the current round
  std::vector<cudaStream_t> streams;             // [P]

  void fail_locked() {
    aborted = true;
    cv.notify_all();
  }

  // The last rank's part: the calls agree, then every block of every exchange, s -> d, on the
  // shared stream. Everything is checked before the first copy is enqueued.
  void enqueue_copies() {
    const Call& first = pending[0];
    for (int r = 1; r < P; ++r) {
      MOE_CHECK(pending[r].variable == first.variable, "InProcessGroup: rank ", r, " called ",
                pending[r].variable ? "all_to_all_v" : "all_to_all", ", rank 0 ",
                first.variable ? "all_to_all_v" : "all_to_all", ": every rank must make the same call");
      MOE_CHECK(pending[r].count() == first.count(), "InProcessGroup::all_to_all: rank ", r, " exchanges ",
                pending[r].count(), " buffers, rank 0 ", first.count(), ": every rank must make the same call");
      MOE_CHECK(streams[r] == streams[0], "InProcessGroup::all_to_all: rank ", r,
                " used another stream than rank 0: the simulated ranks share one stream");
      if (!first.variable)
        for (size_t j = 0; j < first.fixed.size(); ++j)
          MOE_CHECK(pending[r].fixed[j].block_bytes == first.fixed[j].block_bytes,
                    "InProcessGroup::all_to_all: exchange ", j, " has blocks of ", pending[r].fixed[j].block_bytes,
                    " bytes on rank ", r, ", ", first.fixed[j].block_bytes, " on rank 0");
    }
    if (first.variable) {
      for (size_t j = 0; j < first.var.size(); ++j)
        for (int s = 0; s < P; ++s)
          for (int d = 0; d < P; ++d)
            MOE_CHECK(pending[s].var[j].send_bytes[d] == pending[d].var[j].recv_bytes[s],
                      "InProcessGroup::all_to_all_v: exchange ", j, ": rank ", s, " sends ",
                      pending[s].var[j].send_bytes[d], " bytes to rank ", d, ", which expects ",
                      pending[d].var[j].recv_bytes[s]);
      for (size_t j = 0; j < first.var.size(); ++j)
        for (int s = 0; s < P; ++s)
          for (int d = 0; d < P; ++d) {
            const VarCall &from = pending[s].var[j], &to = pending[d].var[j];
            const size_t n = from.send_bytes[d];
            if (n == 0) continue;
            MOE_CUDA_CHECK(cudaMemcpyAsync(to.recv + to.recv_offsets[s], from.send + from.send_offsets[d], n,
                                           cudaMemcpyDeviceToDevice, streams[0]));
          }
      return;
    }
    for (size_t j = 0; j < first.fixed.size(); ++j) {
      const size_t bb = first.fixed[j].block_bytes;
      if (bb == 0) continue;
      for (int s = 0; s < P; ++s)
        for (int d = 0; d < P; ++d) {
          const char* from = static_cast<const char*>(pending[s].fixed[j].send) + d * bb;
          char* to = static_cast<char*>(pending[d].fixed[j].recv) + s * bb;
          MOE_CUDA_CHECK(cudaMemcpyAsync(to, from, bb, cudaMemcpyDeviceToDevice, streams[0]));
        }
    }
  }

  // One rank's arrival at the barrier with its call.
  void arrive(int rank, Call call, cudaStream_t stream) {
    std::unique_lock<std::mutex> lock(mu);
    MOE_CHECK(!aborted, "InProcessGroup::all_to_all (rank ", rank, "): the group was aborted by a failing rank");
    pending[rank] = std::move(call);
    streams[rank] = stream;
    if (++arrived == P) {
      try {
        enqueue_copies();
      } catch (...) {
        fail_locked();
        throw;
      }
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    const uint64_t mine = generation;
    cv.wait(lock, [&] { return generation != mine || aborted; });
    MOE_CHECK(generation != mine, "InProcessGroup::all_to_all (rank ", rank,
              "): the group was aborted by a failing rank");
  }
};

}  // namespace

struct InProcessGroup::Impl {
  GroupCore core;
  std::vector<std::unique_ptr<Endpoint>> endpoints;
};

namespace {
void Endpoint::all_to_all(const EpExchange* exchanges, int count, cudaStream_t stream) {
  check_exchanges(exchanges, count);
  Call c;
  c.fixed.assign(exchanges, exchanges + count);
  group_->arrive(rank_, std::move(c), stream);
}

void Endpoint::all_to_all_v(const EpVarExchange* exchanges, int count, cudaStream_t stream) {
  check_var_exchanges(exchanges, count, ranks_);
  Call c;
  c.variable = true;
  for (int j = 0; j < count; ++j) {
    const EpVarExchange& x = exchanges[j];
    VarCall v;
    v.send = static_cast<const char*>(x.send);
    v.recv = static_cast<char*>(x.recv);
    v.send_bytes.assign(x.send_bytes, x.send_bytes + ranks_);
    v.send_offsets.assign(x.send_offsets, x.send_offsets + ranks_);
    v.recv_bytes.assign(x.recv_bytes, x.recv_bytes + ranks_);
    v.recv_offsets.assign(x.recv_offsets, x.recv_offsets + ranks_);
    c.var.push_back(std::move(v));
  }
  group_->arrive(rank_, std::move(c), stream);
}
}  // namespace

InProcessGroup::InProcessGroup(int ranks) : impl_(std::make_unique<Impl>()) {
  MOE_CHECK(ranks >= 1, "argument 'ranks': expected >= 1, got ", ranks);
  GroupCore& g = impl_->core;
  g.P = ranks;
  g.pending.resize(ranks);
  g.streams.assign(ranks, nullptr);
  for (int r = 0; r < ranks; ++r) impl_->endpoints.push_back(std::make_unique<Endpoint>(&g, r, ranks));
}

InProcessGroup::~InProcessGroup() = default;

int InProcessGroup::ranks() const { return impl_->core.P; }

EpTransport& InProcessGroup::endpoint(int rank) {
  MOE_CHECK(rank >= 0 && rank < impl_->core.P, "argument 'rank': expected 0..", impl_->core.P - 1, ", got ", rank);
  return *impl_->endpoints[rank];
}

void InProcessGroup::abort() {
  std::lock_guard<std::mutex> lock(impl_->core.mu);
  impl_->core.fail_locked();
}

bool InProcessGroup::aborted() const {
  std::lock_guard<std::mutex> lock(impl_->core.mu);
  return impl_->core.aborted;
}

}  // namespace moe
