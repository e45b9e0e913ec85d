#include "diffcp/cp/cp_methods.hpp"

#include "diffcp/cp/lvxattn.hpp"
#include "diffcp/cp/ring.hpp"
#include "diffcp/cp/ringx.hpp"
#include "diffcp/cp/splitkv.hpp"
#include "diffcp/cp/ulysses.hpp"

namespace diffcp {

namespace {

std::string any_P(const AttnLayerConfig&, int) { return ""; }  // the method's collectives take any group size

template <typename Layer>
std::unique_ptr<CpAttentionLayer> make_layer(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard,
                                             const SplitKVOptions& splitkv) {
  if constexpr (std::is_same_v<Layer, SplitKVLayer>) {
    return std::make_unique<SplitKVLayer>(cp, cfg, std::move(shard), splitkv);
  } else {
    return std::make_unique<Layer>(cp, cfg, std::move(shard), splitkv.compute);  // f32 or bf16
  }
}

constexpr CommOp kSplitKVOps[] = {CommOp::all_gather, CommOp::reduce_scatter, CommOp::all_reduce};
constexpr CommOp kUlyssesOps[] = {CommOp::all_to_all};
constexpr CommOp kRingOps[] = {CommOp::send, CommOp::recv};
constexpr CommOp kRingXOps[] = {CommOp::broadcast, CommOp::all_reduce, CommOp::reduce_scatter};
constexpr CommOp kLvXAttnOps[] = {CommOp::send, CommOp::recv};

const CpMethod kMethods[] = {
    {CpMethodId::splitkv, "splitkv", "Split-KV", "lpt", true, any_P, make_layer<SplitKVLayer>, kSplitKVOps},
    {CpMethodId::ulysses, "ulysses", "Ulysses", "none", false, UlyssesLayer::unsupported_reason, make_layer<UlyssesLayer>, kUlyssesOps},
    {CpMethodId::ring, "ring", "Ring", "zigzag", false, any_P, make_layer<RingLayer>, kRingOps},
    {CpMethodId::ringx, "ringx", "RingX", "none", false, any_P, make_layer<RingXLayer>, kRingXOps},
    {CpMethodId::lvxattn, "lvxattn", "LV-XAttn", "none", false, any_P, make_layer<LvXAttnLayer>, kLvXAttnOps},
};

}  // namespace

std::span<const CpMethod> cp_methods() { return kMethods; }

const CpMethod& cp_method(std::string_view name) {
  std::string list;
  for (const CpMethod& m : kMethods) {
    if (name == m.name) return m;
    list += (list.empty() ? "" : ", ") + std::string(m.name);
  }
  DIFFCP_FAIL("unknown CP method '", name, "', expected one of ", list);
}

std::unique_ptr<CpAttentionLayer> CpMethod::make(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard,
                                                 const SplitKVOptions& splitkv) const {
  const std::string why = unsupported_reason(cfg, cp.size());
  DIFFCP_CHECK(why.empty(), why);
  return factory(cp, cfg, std::move(shard), splitkv);
}

}  // namespace diffcp
