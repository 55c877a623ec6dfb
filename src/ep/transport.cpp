// EpTransport's shared parts: the argument checks of every implementation's all_to_all and
// all_to_all_v, and the counts exchange.
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

void check_var_exchanges(const EpVarExchange* exchanges, int count, int P) {
  MOE_CHECK(count >= 0 && (count == 0 || exchanges != nullptr), "argument 'exchanges': expected ", count,
            " exchanges, got null");
  for (int j = 0; j < count; ++j) {
    const EpVarExchange& x = exchanges[j];
    MOE_CHECK(x.send_bytes && x.send_offsets && x.recv_bytes && x.recv_offsets, "argument 'exchanges[", j,
              "]': expected send_bytes, send_offsets, recv_bytes and recv_offsets, host arrays of ", P,
              " entries, got null");
    for (int p = 0; p < P; ++p) {
      MOE_CHECK(x.send_bytes[p] == 0 || x.send != nullptr, "argument 'exchanges[", j, "].send': expected a device ",
                "pointer (", x.send_bytes[p], " bytes to rank ", p, "), got null");
      MOE_CHECK(x.recv_bytes[p] == 0 || x.recv != nullptr, "argument 'exchanges[", j, "].recv': expected a device ",
                "pointer (", x.recv_bytes[p], " bytes from rank ", p, "), got null");
    }
  }
}

void EpTransport::all_to_all_counts(const int64_t* send, int64_t* recv, cudaStream_t stream) {
  MOE_CHECK(send != nullptr && recv != nullptr, "argument 'send'/'recv' of all_to_all_counts: expected device ",
            "pointers to int64 [", ranks(), "], got null");
  const EpExchange x{send, recv, sizeof(int64_t)};
  all_to_all(&x, 1, stream);
}

}  // namespace moe
