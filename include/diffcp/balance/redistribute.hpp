// The once-per-step move of context-source rows to the ranks a plan chose (SPEC A.3): one
// all-to-all-v before the first drafter layer, amortised over all layers. Run it on its own
// communicator (e.g. world.split(0, rank, "redistribute")) so its bytes are counted apart from
// the per-layer bytes.
#pragma once

#include <vector>

#include "diffcp/balance/cost.hpp"
#include "diffcp/comm/communicator.hpp"

namespace diffcp {

// Collective. rows: [S_r, width] this rank's loader slice (rank r holds loader_slices(S, P)[r]).
// Returns [C_p, width]: the rows of plan.chunks_of_rank()[p], in packed order.
std::vector<float> redistribute_rows(Communicator& comm, const PackedBatch& batch, const Plan& plan,
                                     const std::vector<float>& rows, std::int64_t width);

}  // namespace diffcp
