#include "diffcp/balance/lpt.hpp"

#include <algorithm>
#include <climits>
#include <limits>
#include <numeric>

#include "diffcp/core/error.hpp"

namespace diffcp {
namespace {

// Indices of `key` (all >= 0) by decreasing key, equal keys in index order: a stable LSD radix sort
// on the complemented key, 12 bits a pass, so O(n * bits(max key) / 12) without the data-dependent
// branches on which a comparison sort mispredicts about every other comparison.
std::vector<int> decreasing_order(const std::vector<std::int64_t>& key) {
  constexpr int kBits = 12;
  constexpr std::int64_t kMask = (std::int64_t{1} << kBits) - 1;
  std::vector<int> order(key.size()), next(key.size());
  std::iota(order.begin(), order.end(), 0);
  const std::int64_t top = key.empty() ? 0 : *std::max_element(key.begin(), key.end());
  for (int shift = 0; shift < 63 && (top >> shift) > 0; shift += kBits) {
    auto digit = [&](std::int64_t k) { return static_cast<std::size_t>(kMask - ((k >> shift) & kMask)); };
    std::vector<int> start(static_cast<std::size_t>(kMask) + 2, 0);  // [d + 1] keys with digit d
    for (std::int64_t k : key) ++start[digit(k) + 1];
    std::partial_sum(start.begin(), start.end(), start.begin());
    for (int i : order) next[static_cast<std::size_t>(start[digit(key[static_cast<std::size_t>(i)])]++)] = i;
    order.swap(next);
  }
  return order;
}

std::size_t pow2_at_least(std::size_t x) {
  std::size_t L = 1;
  while (L < x) L *= 2;
  return L;
}

// LPT: [chunk] its bundle in [0, P), each chunk taken dearest first (ties: lower chunk) to the
// least-loaded bundle with fewer than J chunks (ties: lower bundle). The bundles sit in a winner
// tree of keys load*L + bundle (L: P rounded up to a power of two; a full bundle's key is
// "infinite"), so the root is the least (load, bundle), as a min-heap's top would be, and a chunk
// costs one climb of log2 L min()s from its bundle's leaf, where a heap pays a pop and a push.
std::vector<int> lpt_bundles(const std::vector<std::int64_t>& price, int P, int J) {
  constexpr std::int64_t kFull = std::numeric_limits<std::int64_t>::max();
  const auto L = static_cast<std::int64_t>(pow2_at_least(static_cast<std::size_t>(P)));
  const std::int64_t total = std::accumulate(price.begin(), price.end(), std::int64_t{0});
  DIFFCP_CHECK(total <= (kFull - L) / L, "lpt: context work ", total, " at P = ", P,
               " overflows the 64-bit (load, bundle) key; expected at most ", (kFull - L) / L);
  std::vector<std::int64_t> key(static_cast<std::size_t>(2 * L), kFull);  // [i] least key under node i; b's leaf: L + b
  std::iota(key.begin() + L, key.begin() + L + P, std::int64_t{0});      // load 0
  for (std::size_t i = static_cast<std::size_t>(L) - 1; i >= 1; --i) key[i] = std::min(key[2 * i], key[2 * i + 1]);
  std::vector<int> bundle(price.size()), count(static_cast<std::size_t>(P), 0);
  for (int j : decreasing_order(price)) {
    const std::int64_t top = key[1];
    const auto b = static_cast<std::size_t>(top & (L - 1));
    bundle[static_cast<std::size_t>(j)] = static_cast<int>(b);
    std::int64_t k = ++count[b] == J ? kFull : top + price[static_cast<std::size_t>(j)] * L;
    for (std::size_t i = static_cast<std::size_t>(L) + b; i > 1; i /= 2) {
      key[i] = k;
      k = std::min(k, key[i ^ 1]);
    }
    key[1] = k;
  }
  return bundle;
}

// Locality matching: [bundle] its rank. The rows of bundle b already on rank r (the loader's
// slices) are summed per (b, r) pair and matched greedily largest first, ties in (b, r) order;
// unmatched bundles take the remaining ranks in order. A sweep in packed order meets the ranks in
// increasing order, so b's rows on rank r add to b's latest pair or start the next. The sort key
// rows*L + (L-1-b) puts more rows first, then the lower bundle, then (index order) the lower rank;
// rows <= S/P + 1 keeps it below 2S + 4P.
std::vector<int> match_ranks(const std::vector<PosRange>& chunks, const std::vector<int>& bundle, std::int64_t S, int P) {
  const auto slices = loader_slices(S, P);
  const auto ranks = static_cast<std::size_t>(P);
  const auto L = static_cast<std::int64_t>(pow2_at_least(ranks));
  std::vector<std::int64_t> pair_key(chunks.size() + ranks);  // at most one more pair per slice boundary
  std::vector<int> pair_rank(chunks.size() + ranks), latest(ranks, -1);  // latest: [b] b's last pair
  std::size_t pairs = 0;
  for (std::size_t j = 0, r = 0; j < chunks.size(); ++j) {
    const PosRange c = chunks[j];
    const int b = bundle[j];
    while (slices[r].end <= c.begin) ++r;
    for (std::size_t q = r; q < ranks && slices[q].begin < c.end; ++q) {
      const std::int64_t rows = std::min(c.end, slices[q].end) - std::max(c.begin, slices[q].begin);
      int& last = latest[static_cast<std::size_t>(b)];
      if (last >= 0 && pair_rank[static_cast<std::size_t>(last)] == static_cast<int>(q)) {
        pair_key[static_cast<std::size_t>(last)] += rows * L;
      } else {
        last = static_cast<int>(pairs);
        pair_key[pairs] = rows * L + (L - 1 - b);
        pair_rank[pairs++] = static_cast<int>(q);
      }
    }
  }
  pair_key.resize(pairs);
  std::vector<int> rank_of_bundle(ranks, -1), bundle_of_rank(ranks, -1);
  for (int q : decreasing_order(pair_key)) {
    const auto b = static_cast<std::size_t>(L - 1 - (pair_key[static_cast<std::size_t>(q)] & (L - 1)));
    const auto r = static_cast<std::size_t>(pair_rank[static_cast<std::size_t>(q)]);
    if (rank_of_bundle[b] < 0 && bundle_of_rank[r] < 0) {
      rank_of_bundle[b] = static_cast<int>(r);
      bundle_of_rank[r] = static_cast<int>(b);
    }
  }
  std::size_t next_rank = 0;
  for (std::size_t b = 0; b < ranks; ++b) {
    if (rank_of_bundle[b] >= 0) continue;
    while (bundle_of_rank[next_rank] >= 0) ++next_rank;
    rank_of_bundle[b] = static_cast<int>(next_rank);
    bundle_of_rank[next_rank] = static_cast<int>(b);
  }
  return rank_of_bundle;
}

}  // namespace

Plan LptBalancer::plan(const PackedBatch& batch, const CostModel& cost, int P, int J) const {
  const std::int64_t S = batch.context_rows();
  check_plan_args(name(), S, P, J);
  const std::int64_t n = static_cast<std::int64_t>(P) * J;
  DIFFCP_CHECK(n <= INT_MAX, name(), ": P*J = ", n, " chunks, expected at most ", INT_MAX);
  Plan plan{name(), P, J, equal_chunks(S, n), {}};
  const std::vector<std::int64_t> price = cost.chunk_costs(plan.chunks);
  const std::vector<int> bundle = lpt_bundles(price, P, J);
  const std::vector<int> rank_of_bundle = match_ranks(plan.chunks, bundle, S, P);
  plan.rank.resize(plan.chunks.size());
  for (std::size_t j = 0; j < plan.rank.size(); ++j) plan.rank[j] = rank_of_bundle[static_cast<std::size_t>(bundle[j])];
  return plan;
}

}  // namespace diffcp
