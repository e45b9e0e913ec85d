// libFuzzer target: the drafter's safetensors shard directory (make_shard_source, drafter/data.hpp),
// `diffcp train --data DIR`. An input is model.safetensors then up to 2 shard files, split at
// kShardSeparator (fuzz_configs.hpp); they are written into a per-process directory in /dev/shm.
// An accepted directory must serve every sample's hidden rows.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "diffcp/core/error.hpp"
#include "diffcp/drafter/data.hpp"
#include "fuzz_common.hpp"
#include "fuzz_configs.hpp"

namespace {

namespace fs = std::filesystem;

// /dev/shm/diffcp-fuzz-shards-<pid>, removed at exit; those of processes that crashed are removed
// by the next run.
const fs::path& dir() {
  static const fs::path d = [] {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/dev/shm", ec)) {
      const std::string name = e.path().filename().string(), prefix = "diffcp-fuzz-shards-";
      if (name.rfind(prefix, 0) == 0 && kill(std::atoi(name.c_str() + prefix.size()), 0) != 0 && errno == ESRCH)
        fs::remove_all(e.path(), ec);
    }
    fs::path p = fs::path("/dev/shm") / ("diffcp-fuzz-shards-" + std::to_string(getpid()));
    fs::create_directories(p);
    std::atexit([] { std::error_code ec; fs::remove_all(dir(), ec); });
    return p;
  }();
  return d;
}

void put(const fs::path& path, std::string_view bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  FUZZ_ASSERT(f.good());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const diffcp::DrafterConfig cfg = diffcp_fuzz::micro_drafter_config();
  std::string_view in(reinterpret_cast<const char*>(data), size);
  const char* names[] = {"model.safetensors", "shard_00000.safetensors", "shard_00001.safetensors"};
  int files = 0;
  for (; files < 3 && !in.empty(); ++files) {
    const auto cut = files < 2 ? in.find(diffcp_fuzz::kShardSeparator) : std::string_view::npos;
    put(dir() / names[files], in.substr(0, cut));
    in = cut == std::string_view::npos ? std::string_view{} : in.substr(cut + diffcp_fuzz::kShardSeparator.size());
  }
  for (int i = files; i < 3; ++i) fs::remove(dir() / names[i]);
  try {
    const auto src = diffcp::make_shard_source(cfg, dir().string(), diffcp_fuzz::kShardHeldout);
    {  // every embedding row and LM head column reads inside the mapped file
      std::vector<std::int32_t> all(static_cast<std::size_t>(cfg.vocab));
      for (std::size_t v = 0; v < all.size(); ++v) all[v] = static_cast<std::int32_t>(v);
      std::vector<float> table(static_cast<std::size_t>(cfg.vocab * cfg.hidden));
      src->embedding_rows(all, table.data());
      src->lm_head_columns(0, cfg.vocab, table.data());
    }
    const std::int64_t T = cfg.target_layers * cfg.hidden;
    for (bool held : {false, true}) {
      const auto& samples = held ? src->heldout() : src->train();
      for (std::size_t s = 0; s < samples.size(); ++s) {
        const auto L = static_cast<std::int64_t>(samples[s].tokens.size());
        FUZZ_ASSERT(L >= 1 && samples[s].loss_mask.size() == samples[s].tokens.size());
        std::vector<float> rows(static_cast<std::size_t>(L * T));
        src->hidden(held, s, 0, L, rows.data());
      }
    }
  } catch (const diffcp::Error&) {
  }
  return 0;
}
