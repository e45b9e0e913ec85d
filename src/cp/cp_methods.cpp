#include "diffcp/cp/cp_methods.hpp"

#include "diffcp/cp/lvxattn.hpp"
#include "diffcp/cp/ring.hpp"
#include "diffcp/cp/ringx.hpp"
#include "diffcp/cp/splitkv.hpp"
#include "diffcp/cp/ulysses.hpp"

namespace diffcp {

namespace {
[[noreturn]] void unknown_method(const std::string& name) {
  std::string list;
  for (const std::string& n : cp_method_names()) list += (list.empty() ? "" : ", ") + n;
  DIFFCP_FAIL("unknown CP method '", name, "', expected one of ", list);
}
}  // namespace

const std::vector<std::string>& cp_method_names() {
  static const std::vector<std::string> names{"splitkv", "ulysses", "ring", "ringx", "lvxattn"};
  return names;
}

std::string cp_unsupported_reason(const std::string& name, const AttnLayerConfig& cfg, int P) {
  if (name == "splitkv") return "";  // any P: the collectives take any group size
  if (name == "ulysses") return UlyssesLayer::unsupported_reason(cfg, P);
  if (name == "ring") return RingLayer::unsupported_reason(cfg, P);
  if (name == "ringx") return RingXLayer::unsupported_reason(cfg, P);
  if (name == "lvxattn") return LvXAttnLayer::unsupported_reason(cfg, P);
  unknown_method(name);
}

std::string cp_method_default_layout(const std::string& name) {
  if (name == "splitkv") return "lpt";
  if (name == "ring") return "zigzag";
  if (name == "ulysses" || name == "ringx" || name == "lvxattn") return "none";
  unknown_method(name);
}

std::unique_ptr<CpAttentionLayer> make_cp_layer(const std::string& name, Communicator& cp, const AttnLayerConfig& cfg,
                                                CpShard shard, const SplitKVOptions& splitkv) {
  const std::string why = cp_unsupported_reason(name, cfg, cp.size());
  DIFFCP_CHECK(why.empty(), why);
  if (name == "splitkv") return std::make_unique<SplitKVLayer>(cp, cfg, std::move(shard), splitkv);
  if (name == "ulysses") return std::make_unique<UlyssesLayer>(cp, cfg, std::move(shard));
  if (name == "ring") return std::make_unique<RingLayer>(cp, cfg, std::move(shard));
  if (name == "ringx") return std::make_unique<RingXLayer>(cp, cfg, std::move(shard));
  return std::make_unique<LvXAttnLayer>(cp, cfg, std::move(shard));
}

}  // namespace diffcp
