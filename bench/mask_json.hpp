// The DFlash mask of a full_mask(batch) as JSON for the PyTorch peers (the --dump-mask of
// bench_attention and bench_device_attention, read by bench/bench_peers_torch.py and
// bench/bench_gpu_peers.py): {"block", "context_rows", "key_rows", "query_rows",
// "ctx": [[ctx_begin, ctx_end] per block]}.
#pragma once

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "diffcp/attention/mask.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/workload/batch.hpp"

namespace diffcp::bench {

inline void dump_mask_json(const PackedBatch& batch, const BlockMask& mask, const std::string& path) {
  nlohmann::json ctx = nlohmann::json::array();
  for (const MaskBlock& b : mask.blocks()) ctx.push_back({b.ctx_begin, b.ctx_end});
  std::ofstream f(path);
  f << nlohmann::json{{"block", mask.block()}, {"context_rows", batch.context_rows()}, {"key_rows", mask.key_rows()},
                      {"query_rows", batch.query_rows()}, {"ctx", ctx}}
           .dump()
    << std::endl;
  DIFFCP_CHECK(static_cast<bool>(f), "cannot write ", path);
}

}  // namespace diffcp::bench
