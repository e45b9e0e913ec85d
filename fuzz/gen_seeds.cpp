// Writes the seed corpora of the fuzz targets with the project's own writers (write_safetensors,
// write_npy, save_checkpoint, DitWeights::save, make_random_batch), so the seeds are files diffcp
// really writes and follow any change of format. Usage: gen_seeds OUT_DIR; makes OUT_DIR/<target>/.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "diffcp/dit/model.hpp"
#include "diffcp/drafter/checkpoint.hpp"
#include "diffcp/drafter/config.hpp"
#include "fuzz_configs.hpp"
#include "diffcp/io/npy.hpp"
#include "diffcp/io/safetensors.hpp"
#include "diffcp/workload/batch.hpp"

namespace fs = std::filesystem;

namespace {

fs::path out;

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
void put(const std::string& target, const std::string& name, const std::string& bytes) {
  fs::create_directories(out / target);
  std::ofstream(out / target / name, std::ios::binary) << bytes;
}

// The drafter's data directory files (the layout tools/extract_shards.py writes), samples of the
// given lengths with tokens in [0, V).
std::string model_file(const diffcp::DrafterConfig& c) {
  std::vector<float> emb(static_cast<std::size_t>(c.vocab * c.hidden), 0.5f), head(emb.size(), -0.25f);
  const fs::path p = out / "tmp_model.safetensors";
  diffcp::write_safetensors(p, {{"embedding", "F32", {c.vocab, c.hidden}, emb.data()},
                                {"lm_head", "F32", {c.hidden, c.vocab}, head.data()}});
  return slurp(p);
}
std::string shard_file(const diffcp::DrafterConfig& c, const std::vector<std::int64_t>& lengths, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> tokens;
  std::vector<std::uint8_t> mask;
  std::vector<std::int64_t> offsets{0};
  for (std::int64_t L : lengths) {
    for (std::int64_t x = 0; x < L; ++x) {
      tokens.push_back(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.vocab - 1)));
      mask.push_back(x >= L / 4 ? 1 : 0);
    }
    offsets.push_back(offsets.back() + L);
  }
  const auto rows = static_cast<std::int64_t>(tokens.size()), T = c.target_layers * c.hidden;
  std::vector<float> hidden(static_cast<std::size_t>(rows * T));
  for (std::size_t i = 0; i < hidden.size(); ++i) hidden[i] = static_cast<float>(i % 7) * 0.125f;
  const fs::path p = out / "tmp_shard.safetensors";
  diffcp::write_safetensors(p, {{"tokens", "I32", {rows}, tokens.data()},
                                {"loss_mask", "U8", {rows}, mask.data()},
                                {"offsets", "I64", {static_cast<std::int64_t>(offsets.size())}, offsets.data()},
                                {"hidden", "F32", {rows, T}, hidden.data()}});
  return slurp(p);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: gen_seeds OUT_DIR\n";
    return 2;
  }
  out = argv[1];
  fs::create_directories(out);

  // safetensors: a drafter model file, a shard, a mixed file with an empty tensor.
  const diffcp::DrafterConfig dc = diffcp_fuzz::micro_drafter_config();
  const std::string model = model_file(dc), shard0 = shard_file(dc, {5, 3}, 1), shard1 = shard_file(dc, {4}, 2);
  put("safetensors", "model", model);
  put("safetensors", "shard", shard0);
  {
    const std::vector<float> a{1, 2, 3, 4, 5, 6};
    const std::vector<std::int32_t> b{7, 8, 9};
    const std::vector<std::int64_t> x{};
    const std::vector<std::uint8_t> mask{1, 0, 1};
    diffcp::write_safetensors(out / "tmp.safetensors", {{"a", "F32", {2, 3}, a.data()},
                                                        {"b", "I32", {3}, b.data()},
                                                        {"x", "I64", {0, 4}, x.data()},
                                                        {"loss_mask", "U8", {3}, mask.data()}});
    put("safetensors", "mixed", slurp(out / "tmp.safetensors"));
  }

  // shards: model.safetensors [+ separator + shard]... (fuzz_shards.cpp)
  const std::string sep(diffcp_fuzz::kShardSeparator);
  put("shards", "one_shard", model + sep + shard0);
  put("shards", "two_shards", model + sep + shard0 + sep + shard1);

  // npy: what --dump / --save-latent write (f32), and the f64 / i64 files a reader must refuse.
  {
    const std::vector<float> f{1.5f, -2.f, 0.f, 4.f, 5.f, 6.f};
    const std::vector<double> d{1, 2, 3};
    const std::vector<std::int64_t> i{1, 2, 3};
    diffcp::write_npy((out / "tmp.npy").string(), f.data(), {2, 3});
    put("npy", "f32_2x3", slurp(out / "tmp.npy"));
    diffcp::write_npy((out / "tmp.npy").string(), f.data(), {6});
    put("npy", "f32_6", slurp(out / "tmp.npy"));
    diffcp::write_npy((out / "tmp.npy").string(), f.data(), {1, 2, 1, 3});
    put("npy", "f32_1x2x1x3", slurp(out / "tmp.npy"));
    diffcp::write_npy((out / "tmp.npy").string(), d.data(), {3});
    put("npy", "f64_3", slurp(out / "tmp.npy"));
    diffcp::write_npy((out / "tmp.npy").string(), i.data(), {3});
    put("npy", "i64_3", slurp(out / "tmp.npy"));
  }

  // anchors: the workload generator's batches in the --anchors-file format (workload/batch.hpp).
  for (std::uint64_t seed : {1, 2}) {
    const diffcp::PackedBatch b = diffcp::make_random_batch(2 + seed, 64, 3, 4, 0.25, seed, 96);
    nlohmann::json j{{"block", b.block}, {"samples", nlohmann::json::array()}};
    for (std::size_t u = 0; u < b.lengths.size(); ++u)
      j["samples"].push_back({{"length", b.lengths[u]}, {"anchors", b.anchors[u]}});
    put("anchors", "random_" + std::to_string(seed) + ".json", j.dump());
  }

  // checkpoint: what the trainer saves (drafter/trainer.cpp's meta); the first byte is the fuzz
  // target's mode (1: the target rewrites the checksum, 0: as is).
  {
    const diffcp::Checkpoint ck{{{"config", dc.to_json()}, {"step", 3}, {"seed", 1}, {"adam_t", 3}, {"cp", 2}, {"dp", 1}},
                                {1.f, 2.f, 3.f, 4.f}, {.1f, .2f, .3f, .4f}, {5.f, 6.f, 7.f, 8.f}};
    diffcp::save_checkpoint((out / "tmp.ck").string(), ck);
    const std::string bytes = slurp(out / "tmp.ck");
    put("checkpoint", "trainer_fix", std::string(1, '\x01') + bytes);
    put("checkpoint", "trainer_raw", std::string(1, '\x00') + bytes);
  }

  // dit_weights: the micro DiT's random weights as DitWeights::save writes them.
  {
    diffcp::DitWeights w(diffcp_fuzz::micro_dit_config());
    w.init_random(1);
    w.save((out / "tmp_dit.safetensors").string());
    put("dit_weights", "micro", slurp(out / "tmp_dit.safetensors"));
  }

  for (const char* tmp : {"tmp_model.safetensors", "tmp_shard.safetensors", "tmp.safetensors", "tmp.npy", "tmp.ck",
                          "tmp_dit.safetensors"})
    fs::remove(out / tmp);
  std::cout << "gen_seeds: wrote the seed corpora in " << out.string() << "\n";
  return 0;
}
