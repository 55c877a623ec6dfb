// Argument checks of EpTransport::all_to_all shared by its implementations (transport.cpp).
#pragma once

#include "moe/expert_parallel.h"

namespace moe {

// `count` exchanges at `exchanges`, each with send and recv pointers unless its blocks are empty;
// throws moe::Error naming the argument.
void check_exchanges(const EpExchange* exchanges, int count);

}  // namespace moe
