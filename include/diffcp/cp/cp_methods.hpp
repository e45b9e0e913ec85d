// The CP methods of the drafter attention layer (SPEC A.2, A.4) as ONE descriptor table: the CLI
// (`diffcp attn --method`, `diffcp bench cp --methods`, `diffcp sim cp`), the benchmarks and the
// tests iterate cp_methods() or look a method up by name; nothing else lists the methods.
//
//   name      class (file)              can serve                 usual context layout
//   splitkv   SplitKVLayer (splitkv)    any P                     lpt (any balancer)
//   ulysses   UlyssesLayer (ulysses)    P | n_kv                  none (contiguous)
//   ring      RingLayer (ring)          any P                     zigzag
//   ringx     RingXLayer (ringx)        any P                     none (contiguous)
//   lvxattn   LvXAttnLayer (lvxattn)    any P                     none (contiguous)
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/cp/cp_layer.hpp"
#include "diffcp/cp/splitkv.hpp"

namespace diffcp {

// One id per method. Every dispatch over the methods (the simulator's costs, sim/cp.cpp) is a
// switch over it with no default: a method added here does not compile (-Werror=switch) until
// each dispatch handles it. The test cp_method_dispatch_exhaustive compiles the dispatches with
// the extra enumerator below and expects exactly that error.
enum class CpMethodId : std::uint8_t {
  splitkv,
  ulysses,
  ring,
  ringx,
  lvxattn,
#ifdef DIFFCP_TEST_UNHANDLED_CP_METHOD
  unhandled_for_test,
#endif
};

struct CpMethod {
  CpMethodId id;
  const char* name;            // "splitkv": what --method takes
  const char* title;           // "Split-KV": how tables and reports print it
  const char* default_layout;  // balancer (balance/balancer.hpp) that lays the context out as the method is usually run
  // Whether the method reads SplitKVOptions' oproj and collectives and lays its context out with
  // the user's --balancer (Split-KV); the others take their default layout and the compute dtype.
  bool splitkv_options;
  // "" when the method can run on P ranks with this layer shape, else why not (e.g. Ulysses with
  // P not dividing n_kv). No communication: every rank can ask before constructing a layer.
  std::string (*unsupported_reason)(const AttnLayerConfig& cfg, int P);
  // Constructs the layer (no check of unsupported_reason: use make()). Collective for ulysses,
  // ring and ringx (their constructors all-gather the ranks' chunk lists).
  std::unique_ptr<CpAttentionLayer> (*factory)(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard,
                                               const SplitKVOptions& splitkv);
  // The communicator operation kinds one forward + backward issues (anything else would be a sign
  // that the layer is not the method it claims; the tests assert it).
  std::span<const CommOp> ops;

  // The layer, after refusing (diffcp::Error, before any communication) a configuration
  // unsupported_reason rejects. Every rank of `cp` must call it with the same method; shard.P and
  // shard.p must match `cp`. Only splitkv reads `splitkv`.
  std::unique_ptr<CpAttentionLayer> make(Communicator& cp, const AttnLayerConfig& cfg, CpShard shard,
                                         const SplitKVOptions& splitkv = {}) const;
};

// The methods in the order of the paper's tables: splitkv, ulysses, ring, ringx, lvxattn.
std::span<const CpMethod> cp_methods();
// The method called `name`; throws diffcp::Error listing the names for an unknown one.
const CpMethod& cp_method(std::string_view name);

}  // namespace diffcp
