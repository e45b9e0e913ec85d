#include "balance/lpt.hpp"

#include <algorithm>
#include <climits>
#include <limits>
#include <numeric>

#include "core/error.hpp"

namespace diffcp {
namespace {

// Indices of `key` (all >= 0) by decreasing key, equal keys in index order: a stable LSD radix sort
// on the complemented key, 11 bits a pass, so O(n * bits(max key) / 11) without the data-dependent
// branches that make a comparison sort mispredict about every other comparison.
std::vector<int> decreasing_order(const std::vector<std::int64_t>& key) {
  constexpr int kBits = 11;
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
// tree, leaves padded to a power of two L and a full bundle's load "infinite"; after a chunk its
// bundle climbs from its leaf, meeting at each level the winner of the sibling subtree, which is
// known before the climb, so the log2 L comparisons do not wait on loads and select without a
// branch. It picks what a (load, bundle) min-heap would, for about a third of the time.
std::vector<int> lpt_bundles(const std::vector<std::int64_t>& price, int P, int J) {
  constexpr std::int64_t kFull = std::numeric_limits<std::int64_t>::max();
  const std::size_t L = pow2_at_least(static_cast<std::size_t>(P));
  std::vector<std::int64_t> load(L, kFull);
  std::fill_n(load.begin(), P, std::int64_t{0});
  std::vector<int> win(2 * L);  // [i] the lightest bundle under node i (children 2i, 2i+1; b's leaf: L + b)
  std::iota(win.begin() + static_cast<std::ptrdiff_t>(L), win.end(), 0);
  for (std::size_t i = L - 1; i >= 1; --i) win[i] = win[2 * i];  // all loads equal: the leftmost bundle
  std::vector<int> bundle(price.size()), count(static_cast<std::size_t>(P), 0);
  for (int j : decreasing_order(price)) {
    const auto b = static_cast<std::size_t>(win[1]);
    bundle[static_cast<std::size_t>(j)] = static_cast<int>(b);
    load[b] = ++count[b] == J ? kFull : load[b] + price[static_cast<std::size_t>(j)];
    int v = static_cast<int>(b);  // (w, v): the winner under node i
    std::int64_t w = load[b];
    for (std::size_t i = L + b; i > 1; i /= 2) {
      const int s = win[i ^ 1];
      const std::int64_t ws = load[static_cast<std::size_t>(s)];
      // The sibling wins if lighter, or as light and to the left (odd i); as a mask, not a branch.
      const std::int64_t sibling = (ws - static_cast<std::int64_t>(i & 1) - w) >> 63;  // all ones or 0
      v ^= (v ^ s) & static_cast<int>(sibling);
      w += (ws - w) & sibling;
      win[i / 2] = v;
    }
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
  std::vector<std::int64_t> pair_key;
  std::vector<int> pair_rank, latest(ranks, -1);  // latest: [b] b's last pair
  pair_key.reserve(chunks.size() + ranks);
  pair_rank.reserve(chunks.size() + ranks);
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
        last = static_cast<int>(pair_key.size());
        pair_key.push_back(rows * L + (L - 1 - b));
        pair_rank.push_back(static_cast<int>(q));
      }
    }
  }
  std::vector<int> rank_of_bundle(ranks, -1), bundle_of_rank(ranks, -1);
  for (int q : decreasing_order(pair_key)) {
    const auto b = static_cast<std::size_t>(L - 1 - pair_key[static_cast<std::size_t>(q)] % L);
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
