#include "diffcp/core/env.hpp"
#include "diffcp/sim/profile.hpp"

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "diffcp/core/error.hpp"
#include "diffcp/core/json_file.hpp"
#include "diffcp/core/json_int.hpp"

#ifndef DIFFCP_PROFILE_DIR
#define DIFFCP_PROFILE_DIR "profiles"
#endif
#ifndef DIFFCP_INSTALLED_PROFILE_DIR
#define DIFFCP_INSTALLED_PROFILE_DIR DIFFCP_PROFILE_DIR
#endif

namespace diffcp {

double gemm_n_half_from_ratio(double narrow, double rho) {
  const double W = kGemmWideWidth;
  DIFFCP_CHECK(narrow > 0 && narrow < W && std::isfinite(rho) && rho > 0, "gemm_n_half_from_ratio: width ", narrow,
               " ratio ", rho);
  if (rho >= 1) return 0;
  // rho W (narrow + h) = narrow (W + h)  =>  h (rho W - narrow) = narrow W (1 - rho)
  const double denom = rho * W - narrow;
  return denom > 0 ? narrow * W * (1 - rho) / denom : 16 * W;  // rho <= narrow / W: a rate that falls at least linearly
}

Profile Profile::from_json(const nlohmann::json& j, const std::string& source) {
  DIFFCP_CHECK(j.is_object(), "profile '", source, "': expected a JSON object");
  static const char* const kFields[] = {"name", "description", "source", "notes", "ranks_per_node", "rank_tflops",
                                        "gemm_tflops", "gemm_n_half", "attn_bwd_tflops", "elementwise_gbs", "kernel_us",
                                        "intra_gbit", "inter_gbit", "intra_latency_us", "inter_latency_us",
                                        "comm_overlap", "sync_loss", "measured", "attention_shape"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* f : kFields) known = known || it.key() == f;
    DIFFCP_CHECK(known, "profile '", source, "': unknown field '", it.key(),
                 "' (known: name description source notes ranks_per_node rank_tflops gemm_tflops gemm_n_half attn_bwd_tflops "
                 "elementwise_gbs kernel_us intra_gbit inter_gbit intra_latency_us inter_latency_us comm_overlap sync_loss measured "
                 "attention_shape)");
  }
  const auto text = [&](const char* f, bool required) {
    if (!j.contains(f)) {
      DIFFCP_CHECK(!required, "profile '", source, "': field '", f, "' is missing");
      return std::string();
    }
    DIFFCP_CHECK(j[f].is_string(), "profile '", source, "': field '", f, "' must be a string");
    return j[f].get<std::string>();
  };
  // A number > 0 (positive) or >= 0; `fallback` when absent and not required.
  const auto number = [&](const char* f, bool required, bool positive, double fallback) {
    if (!j.contains(f)) {
      DIFFCP_CHECK(!required, "profile '", source, "': field '", f, "' is missing");
      return fallback;
    }
    const double v = j[f].is_number() ? j[f].get<double>() : NAN;
    DIFFCP_CHECK(std::isfinite(v) && (positive ? v > 0 : v >= 0), "profile '", source, "': field '", f, "' = ",
                 j[f].dump(), ", expected a ", positive ? "positive" : "non-negative", " number");
    return v;
  };
  Profile p;
  p.name = text("name", true);
  p.description = text("description", false);
  p.source = text("source", false);
  p.notes = text("notes", false);
  if (j.contains("ranks_per_node")) {
    const auto r = json_int64(j["ranks_per_node"]);
    DIFFCP_CHECK(r && *r >= 1 && *r <= (1 << 20), "profile '", source, "': field 'ranks_per_node' = ",
                 j["ranks_per_node"].dump(), ", expected an integer >= 1");
    p.ranks_per_node = static_cast<int>(*r);
  }
  p.rank_tflops = number("rank_tflops", true, true, 0);
  p.gemm_tflops = number("gemm_tflops", false, true, p.rank_tflops);
  p.gemm_n_half = number("gemm_n_half", false, false, 0);
  p.attn_bwd_tflops = number("attn_bwd_tflops", false, true, p.rank_tflops);
  p.elementwise_gbs = number("elementwise_gbs", false, false, 0);
  p.kernel_us = number("kernel_us", false, false, 0);
  p.intra_gbit = number("intra_gbit", true, true, 0);
  p.inter_gbit = number("inter_gbit", true, true, 0);
  p.intra_latency_us = number("intra_latency_us", false, false, 0);
  p.inter_latency_us = number("inter_latency_us", false, false, 0);
  p.comm_overlap = number("comm_overlap", false, false, 1);
  p.sync_loss = number("sync_loss", false, false, 0);
  DIFFCP_CHECK(p.comm_overlap <= 1, "profile '", source, "': field 'comm_overlap' = ", p.comm_overlap,
               ", expected a fraction in [0, 1]");
  if (j.contains("measured")) {
    const nlohmann::json& m = j["measured"];
    DIFFCP_CHECK(m.is_object(), "profile '", source, "': field 'measured' must be an object of booleans");
    for (auto it = m.begin(); it != m.end(); ++it) {
      bool known = false;
      for (const char* g : kMeasuredGroups) known = known || it.key() == g;
      DIFFCP_CHECK(known, "profile '", source, "': measured: unknown group '", it.key(),
                   "' (known: compute intra_link inter_link comm_overlap sync_loss)");
      DIFFCP_CHECK(it.value().is_boolean(), "profile '", source, "': measured.", it.key(), " = ", it.value().dump(),
                   ", expected true or false");
      p.measured[it.key()] = it.value().get<bool>();
    }
  }
  if (j.contains("attention_shape")) {
    const nlohmann::json& a = j["attention_shape"];
    const auto dim = [&](const char* f) {
      const auto v = a.is_object() && a.contains(f) ? json_int64(a[f]) : std::nullopt;
      DIFFCP_CHECK(v && *v >= 1 && *v <= 4096, "profile '", source, "': attention_shape.", f, " = ",
                   a.is_object() && a.contains(f) ? a[f].dump() : std::string("missing"), ", expected an integer in 1..4096");
      return *v;
    };
    DIFFCP_CHECK(a.is_object() && a.size() == 3, "profile '", source, "': field 'attention_shape' = ", a.dump(),
                 ", expected {\"n_q\": .., \"n_kv\": .., \"d_h\": ..}");
    p.attn_n_q = dim("n_q");
    p.attn_n_kv = dim("n_kv");
    p.attn_d_h = dim("d_h");
  }
  return p;
}

nlohmann::json Profile::to_json() const {
  nlohmann::ordered_json j{{"name", name}};
  if (!description.empty()) j["description"] = description;
  if (!source.empty()) j["source"] = source;
  j["ranks_per_node"] = ranks_per_node;
  j["rank_tflops"] = rank_tflops;
  j["gemm_tflops"] = gemm_tflops;
  j["gemm_n_half"] = gemm_n_half;
  j["attn_bwd_tflops"] = attn_bwd_tflops;
  j["elementwise_gbs"] = elementwise_gbs;
  j["kernel_us"] = kernel_us;
  j["intra_gbit"] = intra_gbit;
  j["inter_gbit"] = inter_gbit;
  j["intra_latency_us"] = intra_latency_us;
  j["inter_latency_us"] = inter_latency_us;
  j["comm_overlap"] = comm_overlap;
  j["sync_loss"] = sync_loss;
  if (!measured.empty()) j["measured"] = measured;
  if (attn_d_h > 0) j["attention_shape"] = {{"n_q", attn_n_q}, {"n_kv", attn_n_kv}, {"d_h", attn_d_h}};
  if (!notes.empty()) j["notes"] = notes;
  return nlohmann::json(j);
}

Profile load_profile(const std::string& name_or_file) {
  std::string path = name_or_file;
  if (!std::filesystem::is_regular_file(path)) {
    // $DIFFCP_PROFILES, else the source tree's profiles/, else the installed copy.
    std::string dir = DIFFCP_INSTALLED_PROFILE_DIR;
    if (std::filesystem::is_directory(DIFFCP_PROFILE_DIR)) dir = DIFFCP_PROFILE_DIR;
    if (const auto env = env_value(EnvKnob::profiles)) dir = *env;
    path = dir + "/" + name_or_file + ".json";
  }
  DIFFCP_CHECK(std::filesystem::is_regular_file(path), "profile '", name_or_file, "': no such file, nor ", path,
               " (profiles: h100-ib, aurora, or a file from `diffcp sim calibrate`)");
  return Profile::from_json(read_json_file(path, "profile"), path);
}

}  // namespace diffcp
