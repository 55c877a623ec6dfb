// InProcessGroup: P simulated ranks on one device (see include/moe/expert_parallel.h). Each rank
// is a host thread; an all_to_all is a host barrier at which the last rank to arrive enqueues every
// rank's block copies on the shared stream. The barrier orders enqueueing only (no device sync).
#include <condition_variable>
#include <mutex>
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

 private:
  GroupCore* group_;
  int rank_, ranks_;
};

struct GroupCore {
  int P = 0;
  mutable std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::vector<std::vector<EpExchange>> pending;  // [P] the calls of the current round
  std::vector<cudaStream_t> streams;             // [P]

  void fail_locked() {
    aborted = true;
    cv.notify_all();
  }

  // The last rank's part: every block of every exchange, s -> d, on the shared stream.
  void enqueue_copies() {
    const std::vector<EpExchange>& first = pending[0];
    for (int r = 1; r < P; ++r) {
      MOE_CHECK(pending[r].size() == first.size(), "InProcessGroup::all_to_all: rank ", r, " exchanges ",
                pending[r].size(), " buffers, rank 0 ", first.size(), ": every rank must make the same call");
      MOE_CHECK(streams[r] == streams[0], "InProcessGroup::all_to_all: rank ", r,
                " used another stream than rank 0: the simulated ranks share one stream");
      for (size_t j = 0; j < first.size(); ++j)
        MOE_CHECK(pending[r][j].block_bytes == first[j].block_bytes, "InProcessGroup::all_to_all: exchange ", j,
                  " has blocks of ", pending[r][j].block_bytes, " bytes on rank ", r, ", ", first[j].block_bytes,
                  " on rank 0");
    }
    for (size_t j = 0; j < first.size(); ++j) {
      const size_t bb = first[j].block_bytes;
      if (bb == 0) continue;
      for (int s = 0; s < P; ++s)
        for (int d = 0; d < P; ++d) {
          const char* from = static_cast<const char*>(pending[s][j].send) + d * bb;
          char* to = static_cast<char*>(pending[d][j].recv) + s * bb;
          MOE_CUDA_CHECK(cudaMemcpyAsync(to, from, bb, cudaMemcpyDeviceToDevice, streams[0]));
        }
    }
  }

  void all_to_all(int rank, const EpExchange* exchanges, int count, cudaStream_t stream) {
    std::unique_lock<std::mutex> lock(mu);
    MOE_CHECK(!aborted, "InProcessGroup::all_to_all (rank ", rank, "): the group was aborted by a failing rank");
    pending[rank].assign(exchanges, exchanges + count);
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
  group_->all_to_all(rank_, exchanges, count, stream);
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
