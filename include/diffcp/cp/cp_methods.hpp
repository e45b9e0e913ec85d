// The CP methods of the drafter attention layer by name (SPEC A.2, A.4): one place that knows the
// table of methods, so the CLI (`diffcp attn --method`, `diffcp bench cp --methods`) and the
// benchmarks pick a method with a string and learn up front whether it can serve a configuration.
//
//   name      class (file)              can serve                 usual context layout
//   splitkv   SplitKVLayer (splitkv)    any P                     lpt (any balancer)
//   ulysses   UlyssesLayer (ulysses)    P | n_kv                  none (contiguous)
//   ring      RingLayer (ring)          any P                     zigzag
//   ringx     RingXLayer (ringx)        any P                     none (contiguous)
//   lvxattn   LvXAttnLayer (lvxattn)    any P                     none (contiguous)
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/cp/cp_layer.hpp"
#include "diffcp/cp/splitkv.hpp"

namespace diffcp {

// {"splitkv", "ulysses", "ring", "ringx", "lvxattn"}: the order of the paper's tables.
const std::vector<std::string>& cp_method_names();

// "" when `name` can run on P ranks with this layer shape, else the reason it cannot (e.g.
// Ulysses with P not dividing n_kv). Throws diffcp::Error listing the names for an unknown name.
// No communication: call it on every rank before constructing a layer.
std::string cp_unsupported_reason(const std::string& name, const AttnLayerConfig& cfg, int P);

// The balancer name (balance/balancer.hpp) that lays the context out the way the method is
// usually run: "lpt" for splitkv, "zigzag" for ring, "none" (contiguous) for the others.
std::string cp_method_default_layout(const std::string& name);

// Constructs the layer. Collective for ulysses, ring and ringx (their constructors all-gather the
// ranks' chunk lists): every rank of `cp` must call it with the same name. Throws diffcp::Error
// before any communication for an unknown name or when cp_unsupported_reason is not empty.
// shard.P and shard.p must match `cp`. splitkv takes `splitkv` (the others ignore it).
std::unique_ptr<CpAttentionLayer> make_cp_layer(const std::string& name, Communicator& cp, const AttnLayerConfig& cfg,
                                                CpShard shard, const SplitKVOptions& splitkv = {});

}  // namespace diffcp
