// EpTransport's shared helpers.
#include "moe/error.h"
#include "moe/expert_parallel.h"

namespace moe {

void EpTransport::all_to_all_counts(const int64_t* send, int64_t* recv, cudaStream_t stream) {
  MOE_CHECK(send != nullptr && recv != nullptr, "argument 'send'/'recv' of all_to_all_counts: expected device ",
            "pointers to int64 [", ranks(), "], got null");
  const EpExchange x{send, recv, sizeof(int64_t)};
  all_to_all(&x, 1, stream);
}

}  // namespace moe
