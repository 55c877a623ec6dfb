// NcclTransport: the all-to-all over NCCL point-to-point calls, one group per all_to_all (every
// exchange's P sends and P receives, the rank itself included); all_to_all_v likewise with each
// peer's own sizes. Built only with MOE_HAVE_NCCL.
#include "ep/exchange_check.h"
#include "moe/error.h"
#include "moe/expert_parallel.h"

#ifndef MOE_HAVE_NCCL
#define MOE_HAVE_NCCL 0
#endif

#if MOE_HAVE_NCCL
#include <nccl.h>

#define MOE_NCCL_CHECK(call)                                                                              \
  do {                                                                                                    \
    ncclResult_t moe_nccl_status_ = (call);                                                               \
    if (moe_nccl_status_ != ncclSuccess)                                                                  \
      ::moe::detail::throw_error("NCCL error '", ncclGetErrorString(moe_nccl_status_), "' in ", #call,   \
                                 " at ", __FILE__, ":", __LINE__);                                        \
  } while (0)
#endif

namespace moe {

#if MOE_HAVE_NCCL
namespace {

// One NCCL group around `enqueue` (its ncclSend / ncclRecv calls): the transfers proceed together.
// The group is closed even when enqueueing throws.
template <class Enqueue>
void nccl_group(Enqueue&& enqueue) {
  MOE_NCCL_CHECK(ncclGroupStart());
  try {
    enqueue();
  } catch (...) {
    ncclGroupEnd();
    throw;
  }
  MOE_NCCL_CHECK(ncclGroupEnd());
}

}  // namespace
#endif

bool nccl_transport_available() { return MOE_HAVE_NCCL != 0; }

NcclTransport::NcclTransport(ncclComm* comm) : comm_(comm) {
#if MOE_HAVE_NCCL
  MOE_CHECK(comm != nullptr, "argument 'comm': expected an NCCL communicator, got null");
  MOE_NCCL_CHECK(ncclCommUserRank(comm, &rank_));
  MOE_NCCL_CHECK(ncclCommCount(comm, &ranks_));
#else
  detail::throw_error("NcclTransport: this build of moe-engine has no NCCL (MOE_HAVE_NCCL is 0)");
#endif
}

void NcclTransport::all_to_all(const EpExchange* exchanges, int count, cudaStream_t stream) {
  check_exchanges(exchanges, count);
#if MOE_HAVE_NCCL
  nccl_group([&] {
    for (int j = 0; j < count; ++j) {
      const size_t bb = exchanges[j].block_bytes;
      if (bb == 0) continue;
      for (int p = 0; p < ranks_; ++p) {
        MOE_NCCL_CHECK(ncclSend(static_cast<const char*>(exchanges[j].send) + p * bb, bb, ncclChar, p, comm_, stream));
        MOE_NCCL_CHECK(ncclRecv(static_cast<char*>(exchanges[j].recv) + p * bb, bb, ncclChar, p, comm_, stream));
      }
    }
  });
#else
  (void)stream;
  detail::throw_error("NcclTransport::all_to_all: this build of moe-engine has no NCCL");
#endif
}

void NcclTransport::all_to_all_v(const EpVarExchange* exchanges, int count, cudaStream_t stream) {
  check_var_exchanges(exchanges, count, ranks_);
#if MOE_HAVE_NCCL
  // One group for every exchange. A zero-byte transfer is left out; the peer leaves out its side
  // too (the sizes of a pair agree on both ranks).
  nccl_group([&] {
    for (int j = 0; j < count; ++j) {
      const EpVarExchange& x = exchanges[j];
      for (int p = 0; p < ranks_; ++p) {
        if (x.send_bytes[p] > 0)
          MOE_NCCL_CHECK(ncclSend(static_cast<const char*>(x.send) + x.send_offsets[p], x.send_bytes[p], ncclChar, p,
                                  comm_, stream));
        if (x.recv_bytes[p] > 0)
          MOE_NCCL_CHECK(
              ncclRecv(static_cast<char*>(x.recv) + x.recv_offsets[p], x.recv_bytes[p], ncclChar, p, comm_, stream));
      }
    }
  });
#else
  (void)stream;
  detail::throw_error("NcclTransport::all_to_all_v: this build of moe-engine has no NCCL");
#endif
}

}  // namespace moe
