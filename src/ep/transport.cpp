// EpTransport's shared parts: the argument checks of every implementation's all_to_all, and the
// counts exchange.
#include "ep/exchange_check.h"
#include "moe/error.h"
#include "moe/expert_parallel.h"

namespace moe {

void check_exchanges(const EpExchange* exchanges, int count) {
  MOE_CHECK(count >= 0 && (count == 0 || exchanges != nullptr), "argument 'exchanges': expected ", count,
            " exchanges, got null");
  for (int j = 0; j < count; ++j)
    MOE_CHECK(exchanges[j].block_bytes == 0 || (exchanges[j].send != nullptr && exchanges[j].recv != nullptr),
              "argument 'exchanges[", j, "]': expected send and recv device pointers, got null");
}

void EpTransport::all_to_all_counts(const int64_t* send, int64_t* recv, cudaStream_t stream) {
  MOE_CHECK(send != nullptr && recv != nullptr, "argument 'send'/'recv' of all_to_all_counts: expected device ",
            "pointers to int64 [", ranks(), "], got null");
  const EpExchange x{send, recv, sizeof(int64_t)};
  all_to_all(&x, 1, stream);
}

}  // namespace moe
