#include "diffcp/dit/usp.hpp"

#include <algorithm>

#include "diffcp/core/error.hpp"

namespace diffcp {

UspDegrees resolve_usp_degrees(int P, std::int64_t heads, std::optional<int> ulysses, std::optional<int> ring) {
  const char* ulysses_what = "`ulysses_degree`";
  const char* ring_what = "`ring_degree`";
  DIFFCP_CHECK(P >= 1 && heads >= 1, "dit: P = ", P, " ranks, ", heads, " heads; expected >= 1 each");
  DIFFCP_CHECK(!ulysses || *ulysses >= 1, ulysses_what, " = ", ulysses.value_or(0), ", expected >= 1");
  DIFFCP_CHECK(!ring || *ring >= 1, ring_what, " = ", ring.value_or(0), ", expected >= 1");
  UspDegrees d;
  if (ulysses && ring) {
    DIFFCP_CHECK(static_cast<std::int64_t>(*ulysses) * *ring == P, ulysses_what, " U = ", *ulysses,
                 " x ", ring_what, " R = ", *ring, " = ", static_cast<std::int64_t>(*ulysses) * *ring,
                 ", expected U x R = P = ", P, " ranks");
    d = {*ulysses, *ring};
  } else if (ulysses) {
    DIFFCP_CHECK(P % *ulysses == 0, ulysses_what, " U = ", *ulysses, " does not divide P = ", P,
                 " ranks (R = P / U)");
    d = {*ulysses, P / *ulysses};
  } else if (ring) {
    DIFFCP_CHECK(P % *ring == 0, ring_what, " R = ", *ring, " does not divide P = ", P, " ranks (U = P / R)");
    d = {P / *ring, *ring};
  } else {
    for (int U = P; U >= 1; --U)
      if (P % U == 0 && heads % U == 0) {
        d = {U, P / U};
        break;
      }
  }
  DIFFCP_CHECK(heads % d.ulysses == 0, "dit: Ulysses degree U = ", d.ulysses, " does not divide the ", heads,
               " attention heads (Ulysses shards heads; P = ", P, " = U x R with R = ", d.ring,
               ": choose ", ulysses_what, " / ", ring_what, " so that U divides the heads)");
  return d;
}

int usp_ulysses_group_size(int L, int U) {
  DIFFCP_CHECK(L >= 1 && U >= 1 && (U % L == 0 || L % U == 0), "`group_size` L = ", L, " and `ulysses_degree` U = ", U,
               ": one must divide the other (Ulysses groups of U consecutive ranks either span whole groups of L or lie"
               " inside one)");
  return std::min(L, U);
}

bool ring_next_in_group(int p, int U, int R, int L) {
  const int P = U * R;
  DIFFCP_CHECK(U >= 1 && R >= 1 && L >= 1 && p >= 0 && p < P, "ring_next_in_group: rank ", p, " with U = ", U,
               ", R = ", R, ", L = ", L);
  return (p + U) % P / L == p / L;
}

UspGroups make_usp_groups(Communicator& world, int U) {
  const int P = world.size(), p = world.rank();
  DIFFCP_CHECK(U >= 1 && P % U == 0, "USP: Ulysses degree U = ", U, " does not divide P = ", P, " ranks");
  UspGroups g;
  g.ulysses = world.split(p / U, p % U, "ulysses");
  g.ring = world.split(p % U, p / U, "ring");
  return g;
}

}  // namespace diffcp
