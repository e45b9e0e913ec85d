// USP (Unified Sequence Parallelism, as xDiT and CoCoDiff's multi-node runs use it): past the
// head limit of Ulysses, P = U x R ranks run Ulysses over U consecutive ranks (it shards the heads)
// and Ring attention across the R Ulysses groups. This file is USP's one home: the degrees, the
// rank layout and its groups, and where the ring's hops land in the link groups. The Ulysses
// exchange itself is dit/exchange.hpp (any mode); the Ring attention is dit/ring_attention.hpp;
// the run's bytes are dit/run.hpp's dit_predicted_bytes.
//
// Layout: world rank p = g U + u; Ulysses group g holds ranks [g U, (g+1) U); the ring joins the
// ranks with the same u (ring rank g), its successor p + U mod P.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "diffcp/comm/communicator.hpp"

namespace diffcp {

// USP degrees: P = U x R ranks, Ulysses over U (it shards the heads), Ring over R groups.
struct UspDegrees {
  int ulysses = 1, ring = 1;  // U, R
};
// The degrees for P ranks and n_h heads from `ulysses_degree` / `ring_degree` (nullopt: not given).
// Neither given: U = the largest divisor of P that divides n_h, R = P / U; one given: the other is
// P over it. Throws diffcp::Error naming the values for a given degree < 1, one that does not divide
// P, U x R != P, or U not dividing n_h (dit/session.hpp: errors name the fields). Local: no communication.
UspDegrees resolve_usp_degrees(int P, std::int64_t heads, std::optional<int> ulysses, std::optional<int> ring);

// The group size of the Ulysses exchange under USP: min(L, U), after checking that Ulysses groups of
// U consecutive ranks and link groups of L consecutive ranks tile (L | U or U | L), so that each
// all-to-all block is either inside or across link groups. Throws naming both otherwise.
int usp_ulysses_group_size(int L, int U);

// Whether world rank p's ring successor (p + U mod P) lies in p's group of L consecutive ranks.
bool ring_next_in_group(int p, int U, int R, int L);

// The two communicators of rank p: its Ulysses group (U ranks, rank u) and its ring (R ranks, rank
// g). Collective over `world`; U must divide world.size().
struct UspGroups {
  std::unique_ptr<Communicator> ulysses, ring;
};
UspGroups make_usp_groups(Communicator& world, int U);

}  // namespace diffcp
