// Argument checks of EpTransport::all_to_all and all_to_all_v shared by its implementations (transport.cpp).
#pragma once

#include "moe/expert_parallel.h"

namespace moe {

// `count` exchanges at `exchanges`, each with send and recv pointers unless its blocks are empty;
// throws moe::Error naming the argument.
void check_exchanges(const EpExchange* exchanges, int count);
// `count` variable-size exchanges of a group of P ranks: the four size / offset arrays given, and
// send (recv) pointers wherever a send (receive) moves bytes.
void check_var_exchanges(const EpVarExchange* exchanges, int count, int P);

}  // namespace moe
