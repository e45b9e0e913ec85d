#include "diffcp/sim/machine.hpp"

#include <sstream>

#include <algorithm>
#include <cmath>

#include "diffcp/core/error.hpp"

namespace diffcp {

namespace {
// Rates in the profile's units to per-millisecond ones.
double flops_per_ms(double tflops) { return tflops * 1e9; }
double bytes_per_ms(double gbit) { return gbit * 1e9 / 8 / 1e3; }
}  // namespace

void SimMachine::validate() const {
  DIFFCP_CHECK(P >= 1 && P <= (1 << 20), "sim: P = ", P, ", expected 1 <= P <= 2^20");
  DIFFCP_CHECK(R >= 1, "sim: ranks per node = ", R, ", expected >= 1");
  DIFFCP_CHECK(share > 0 && share <= 1, "sim: `rank_share` = ", share, ", expected a fraction in (0, 1]");
  DIFFCP_CHECK(cores >= 0 && cores <= P, "sim: `cores` = ", cores, ", expected 1..P = ", P, " (0: one core per rank)");
}

double SimMachine::step_work(const std::vector<double>& w) const {
  if (w.empty()) return 0;
  double mx = 0, mean = 0;
  for (const double x : w) {
    mx = std::max(mx, x);
    mean += x / static_cast<double>(w.size());
  }
  if (cores == 0 || cores >= P) return mx;
  return std::max(mx * cores / P, mean);
}

double SimMachine::rate_share() const { return share / (P > 1 ? 1.0 + profile.sync_loss : 1.0); }

double SimMachine::gemm_ms(double flops, int calls) const {
  return calls * profile.kernel_us * 1e-3 + flops / (flops_per_ms(profile.gemm_tflops) * rate_share());
}
double SimMachine::gemm_efficiency(double K, double N) const {
  const double n = std::min(K, N), h = profile.gemm_n_half;
  if (h <= 0 || n >= kGemmWideWidth) return 1.0;
  return n * (kGemmWideWidth + h) / (kGemmWideWidth * (n + h));
}

double SimMachine::gemm_ms(double M, double K, double N) const {
  const double compute = 2 * M * K * N / (flops_per_ms(profile.gemm_tflops) * gemm_efficiency(K, N) * rate_share());
  const double memory =
      profile.elementwise_gbs > 0 ? 4 * (M * K + K * N + M * N) / (profile.elementwise_gbs * 1e6 * rate_share()) : 0;
  return profile.kernel_us * 1e-3 + std::max(compute, memory);
}

double SimMachine::attn_fwd_ms(double flops, int calls) const {
  return calls * profile.kernel_us * 1e-3 + flops / (flops_per_ms(profile.rank_tflops) * rate_share());
}
double SimMachine::attn_bwd_ms(double flops, int calls) const {
  return calls * profile.kernel_us * 1e-3 + flops / (flops_per_ms(profile.attn_bwd_tflops) * rate_share());
}
double SimMachine::elementwise_ms(double bytes) const {
  return profile.elementwise_gbs > 0 ? bytes / (profile.elementwise_gbs * 1e9 / 1e3 * rate_share()) : 0.0;
}

double SimMachine::overlapped(double x, double c) const { return x + c - profile.comm_overlap * std::min(x, c); }

double SimMachine::inter_fraction() const {
  return P <= 1 || !multi_node() ? 0.0 : static_cast<double>(P - R) / static_cast<double>(P - 1);
}

double SimMachine::uniform_ms(double bytes) const {
  if (P <= 1 || bytes <= 0) return 0;
  const double inter = bytes * inter_fraction(), intra = bytes - inter;
  const double lat = (P - 1) * (multi_node() ? profile.inter_latency_us : profile.intra_latency_us) * 1e-3;
  const double ranks_on_uplink = std::min(R, P);
  return lat + std::max(intra / bytes_per_ms(profile.intra_gbit), ranks_on_uplink * inter / bytes_per_ms(profile.inter_gbit));
}

double SimMachine::hierarchical_ms(double bytes) const {
  if (!hierarchy_useful()) return uniform_ms(bytes);  // one node, or one rank per node: the flat path
  const double N = nodes(), inter = bytes * (N - 1) / (P - 1.0);
  const double intra = bytes * (R - 1.0) / (P - 1.0) + inter * (R - 1.0) / R;
  const double lat = (N - 1) * profile.inter_latency_us * 1e-3 + 2 * (R - 1) * profile.intra_latency_us * 1e-3;
  return lat + intra / bytes_per_ms(profile.intra_gbit) + R * inter / bytes_per_ms(profile.inter_gbit);
}

double SimMachine::allreduce_small_ms(double bytes) const {
  if (P <= 1 || bytes <= 0) return 0;
  const double lat = 2 * std::ceil(std::log2(static_cast<double>(P))) *
                     (multi_node() ? profile.inter_latency_us : profile.intra_latency_us) * 1e-3;
  const double bw = multi_node() ? std::min(bytes_per_ms(profile.inter_gbit), bytes_per_ms(profile.intra_gbit))
                                 : bytes_per_ms(profile.intra_gbit);
  return lat + bytes / bw;
}

double SimMachine::hop_ms(double bytes) const {
  if (P <= 1 || bytes <= 0) return 0;
  return multi_node() ? profile.inter_latency_us * 1e-3 + bytes / bytes_per_ms(profile.inter_gbit)
                      : profile.intra_latency_us * 1e-3 + bytes / bytes_per_ms(profile.intra_gbit);
}

namespace {
std::string num(double v) {  // 100, 1.25: as a person writes it
  std::ostringstream o;
  o << v;
  return o.str();
}
}  // namespace

std::vector<std::string> SimMachine::fit_warnings(std::int64_t n_q, std::int64_t n_kv, std::int64_t d_h) const {
  std::vector<std::string> out;
  const auto unmeasured = [&](const char* group) {
    const auto it = profile.measured.find(group);
    return it != profile.measured.end() && !it->second;
  };
  const auto link = [&](const char* group, const char* where, double gbit, double us) {
    out.push_back("profile '" + profile.name + "': the " + where + " link (" + num(gbit) + " Gbit/s, " +
                  num(us) + " us) was not measured by sim calibrate (defaults, or copied from the other " +
                  "level), yet this prediction at P = " + std::to_string(P) + " uses it: calibrate under mpirun with " +
                  "ranks on " + (std::string(group) == "inter_link" ? "two nodes" : "one node") +
                  " (its measured." + group + " is false)");
  };
  if (P > 1 && R > 1 && unmeasured("intra_link")) link("intra_link", "intra-node", profile.intra_gbit, profile.intra_latency_us);
  if (multi_node() && unmeasured("inter_link")) link("inter_link", "inter-node", profile.inter_gbit, profile.inter_latency_us);
  if (profile.attn_d_h > 0 && (n_q != profile.attn_n_q || n_kv != profile.attn_n_kv || d_h != profile.attn_d_h))
    out.push_back("profile '" + profile.name + "': its attention rates were measured at " + std::to_string(profile.attn_n_q) +
                  "/" + std::to_string(profile.attn_n_kv) + " heads x " + std::to_string(profile.attn_d_h) +
                  ", this workload has " + std::to_string(n_q) + "/" + std::to_string(n_kv) + " heads x " +
                  std::to_string(d_h) + " (the kernels' rate depends on the shape: calibrate with --n-q " +
                  std::to_string(n_q) + " --n-kv " + std::to_string(n_kv) + " --d-h " + std::to_string(d_h) + ")");
  return out;
}

}  // namespace diffcp
