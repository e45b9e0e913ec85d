#include "diffcp/workload/batch.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <unordered_set>
#include <filesystem>
#include <limits>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"
#include "diffcp/core/json_file.hpp"
#include "diffcp/core/json_int.hpp"

namespace diffcp {

void PackedBatch::validate() const {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  DIFFCP_CHECK(block >= 1, "block size B = ", block, ", expected B >= 1");
  DIFFCP_CHECK(anchors.size() == lengths.size(), "batch has ", lengths.size(), " sample lengths but ",
               anchors.size(), " anchor lists; expected one anchor list per sample");
  std::int64_t rows = 0, blocks = 0;
  for (std::size_t u = 0; u < lengths.size(); ++u) {
    DIFFCP_CHECK(lengths[u] >= 1, "sample ", u, " has length ", lengths[u], ", expected >= 1");
    DIFFCP_CHECK(lengths[u] <= kMax - rows, "sample ", u, " has length ", lengths[u],
                 ": the packed context S = sum of lengths exceeds 2^63 - 1");
    rows += lengths[u];
    const auto& a = anchors[u];
    blocks += static_cast<std::int64_t>(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      DIFFCP_CHECK(a[i] >= 0, "sample ", u, " anchor ", i, " = ", a[i], " is negative");
      // a + B in unsigned arithmetic for the message: both are >= 0, so it cannot wrap.
      DIFFCP_CHECK(a[i] <= lengths[u] - block, "sample ", u, " anchor ", i, " = ", a[i], ": anchor + B = ",
                   static_cast<std::uint64_t>(a[i]) + static_cast<std::uint64_t>(block), " is past the sample end ",
                   lengths[u], " (expected anchor <= length - B)");
      DIFFCP_CHECK(i == 0 || a[i - 1] < a[i], "sample ", u, " anchors not strictly increasing: anchor ",
                   i - 1, " = ", a[i - 1], " then anchor ", i, " = ", a[i]);
    }
  }
  DIFFCP_CHECK(blocks <= kMax / block, "batch has ", blocks, " blocks of B = ", block,
               ": the query rows Q = N*B exceed 2^63 - 1");
}

std::int64_t PackedBatch::context_rows() const {
  return std::accumulate(lengths.begin(), lengths.end(), std::int64_t{0});
}

std::int64_t PackedBatch::num_blocks() const {
  std::int64_t n = 0;
  for (const auto& a : anchors) n += static_cast<std::int64_t>(a.size());
  return n;
}

std::vector<std::int64_t> PackedBatch::sample_starts() const {
  std::vector<std::int64_t> s(lengths.size());
  std::exclusive_scan(lengths.begin(), lengths.end(), s.begin(), std::int64_t{0});
  return s;
}

std::vector<PackedBatch::BlockRef> PackedBatch::blocks() const {
  const auto starts = sample_starts();
  std::vector<BlockRef> out;
  out.reserve(static_cast<std::size_t>(num_blocks()));
  for (std::size_t u = 0; u < anchors.size(); ++u)
    for (std::int64_t a : anchors[u])
      out.push_back({static_cast<std::int64_t>(u), starts[u], starts[u] + a});
  return out;
}

PackedBatch make_random_batch(std::int64_t samples, std::int64_t context,
                              std::int64_t anchors_per_sample, std::int64_t block,
                              double prompt_fraction, std::uint64_t seed, std::int64_t context_max) {
  DIFFCP_CHECK(samples >= 1, "samples = ", samples, ", expected >= 1");
  DIFFCP_CHECK(block >= 1, "block size B = ", block, ", expected B >= 1");
  DIFFCP_CHECK(context >= block, "context = ", context, ", expected >= B = ", block);
  DIFFCP_CHECK(anchors_per_sample >= 0, "anchors per sample = ", anchors_per_sample, ", expected >= 0");
  DIFFCP_CHECK(prompt_fraction >= 0.0 && prompt_fraction < 1.0, "prompt fraction = ", prompt_fraction,
               ", expected in [0, 1)");
  DIFFCP_CHECK(context_max == 0 || context_max >= context, "context range [", context, ", ", context_max,
               "] is empty; expected max >= min");
  PackedBatch batch;
  batch.block = block;
  std::mt19937_64 rng(seed);
  for (std::int64_t u = 0; u < samples; ++u) {
    const std::int64_t length =
        context_max > context ? std::uniform_int_distribution<std::int64_t>(context, context_max)(rng) : context;
    const auto prompt = static_cast<std::int64_t>(std::llround(prompt_fraction * static_cast<double>(length)));
    const std::int64_t first = std::min(prompt, length - block), last = length - block;  // x in [first, last]
    const std::int64_t candidates = last - first + 1;
    DIFFCP_CHECK(anchors_per_sample <= candidates, "anchors per sample = ", anchors_per_sample, " exceeds the ",
                 candidates, " response positions x with x + B <= length (sample ", u, ": length ", length,
                 ", prompt ", prompt, ", B ", block, ")");
    batch.lengths.push_back(length);
    // Floyd's algorithm: a uniform subset without replacement in O(A) expected time.
    std::unordered_set<std::int64_t> seen;
    std::vector<std::int64_t> picked;
    for (std::int64_t j = candidates - anchors_per_sample; j < candidates; ++j) {
      std::uniform_int_distribution<std::int64_t> dist(0, j);
      const std::int64_t t = dist(rng);
      const std::int64_t x = first + (seen.insert(t).second ? t : (seen.insert(j), j));
      picked.push_back(x);
    }
    std::sort(picked.begin(), picked.end());
    batch.anchors.push_back(std::move(picked));
  }
  batch.validate();
  return batch;
}

namespace {
// A JSON integer as int64. nlohmann's get<std::int64_t>() would also accept a float and cast it
// (undefined behaviour for 1e300), so anything but an integer in range is refused here.
std::int64_t json_int(const nlohmann::json& x, const std::string& path, const std::string& what) {
  const auto v = json_int64(x);
  DIFFCP_CHECK(v.has_value(), "`anchors_file` '", path, "': ", what, " = ", x.dump(), ", expected an integer below 2^63");
  return *v;
}
}  // namespace

PackedBatch read_anchors_file(const std::string& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  DIFFCP_CHECK(!ec, "`anchors_file` '", path, "': cannot read it (", ec.message(), ")");
  DIFFCP_CHECK(size <= (64u << 20), "`anchors_file` '", path, "': ", size, " bytes, over the 64 MiB limit");
  const nlohmann::json j = read_json_file(path, "`anchors_file`");
  PackedBatch batch;
  try {
    DIFFCP_CHECK(j.is_object() && j.contains("block") && j.contains("samples") && j["samples"].is_array(),
                 "`anchors_file` '", path, "': expected {\"block\": B, \"samples\": [{\"length\": L, \"anchors\": [...]}, ...]}");
    batch.block = json_int(j["block"], path, "\"block\"");
    for (const auto& s : j["samples"]) {
      const std::string u = std::to_string(batch.lengths.size());
      DIFFCP_CHECK(s.is_object() && s.contains("length") && s.contains("anchors") && s["anchors"].is_array(),
                   "`anchors_file` '", path, "': sample ", u, " needs \"length\" and an \"anchors\" array");
      batch.lengths.push_back(json_int(s["length"], path, "sample " + u + " \"length\""));
      std::vector<std::int64_t> anchors;
      for (const auto& a : s["anchors"]) anchors.push_back(json_int(a, path, "sample " + u + " anchor"));
      batch.anchors.push_back(std::move(anchors));
    }
  } catch (const nlohmann::json::exception& e) {
    DIFFCP_FAIL("`anchors_file` '", path, "': wrong type: ", e.what());
  }
  DIFFCP_CHECK(!batch.lengths.empty(), "`anchors_file` '", path, "': no samples");
  batch.validate();
  return batch;
}

}  // namespace diffcp
