// Load balancers of the packed context over the P ranks of a Split-KV group (SPEC A.3), one file
// each, one interface: samples + anchors, P and J in; a chunk -> rank Plan out. Planning needs no
// communication (every rank has all anchors) and is deterministic, so all ranks plan alike.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "diffcp/balance/cost.hpp"

namespace diffcp {

class Balancer {
 public:
  virtual ~Balancer() = default;
  virtual const char* name() const = 0;
  // J: chunks per rank where the balancer uses it (lpt, partition; none and zigzag ignore it).
  virtual Plan plan(const PackedBatch& batch, const CostModel& cost, int P, int J) const = 0;
};

// "none" | "zigzag" | "lpt" | "partition"; throws diffcp::Error naming the choices otherwise.
std::unique_ptr<Balancer> make_balancer(const std::string& name);
const std::vector<std::string>& balancer_names();

// The packed context [0, S) cut into n chunks whose sizes differ by at most one row (chunk j is
// [j*S/n, (j+1)*S/n), so the S % n longer chunks are spread out): how S that P*J does not divide
// is handled.
std::vector<PosRange> equal_chunks(std::int64_t S, std::int64_t n);

// The layout rows are in before any plan (the data loader's): rank r holds [r*S/P, (r+1)*S/P).
std::vector<PosRange> loader_slices(std::int64_t S, int P);

void check_plan_args(const char* balancer, std::int64_t S, int P, int J);

}  // namespace diffcp
