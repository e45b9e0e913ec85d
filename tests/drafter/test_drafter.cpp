// Drafter building blocks, single process: safetensors reading (and every malformed-file case),
// checkpoints (round trip, corruption, truncation), the optimizer schedule, packing and anchors.
#include <cmath>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "diffcp/core/error.hpp"
#include "diffcp/core/half.hpp"
#include "diffcp/drafter/checkpoint.hpp"
#include "diffcp/drafter/data.hpp"
#include "diffcp/drafter/optim.hpp"
#include "diffcp/io/safetensors.hpp"

namespace diffcp {
namespace {

std::string tmp(const std::string& name) { return (std::filesystem::path(::testing::TempDir()) / name).string(); }

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

void write_raw(const std::string& path, const std::string& header, std::size_t data_bytes) {
  std::ofstream f(path, std::ios::binary);
  const std::uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header << std::string(data_bytes, '\0');
}

TEST(SafeTensors, RoundTripAndEveryMalformedCase) {
  const std::vector<float> a{1, 2, 3, 4, 5, 6};
  const std::vector<std::int32_t> b{7, 8, 9};
  write_safetensors(tmp("ok.safetensors"), {{"a", "F32", {2, 3}, a.data()}, {"b", "I32", {3}, b.data()}});
  const SafeTensors st(tmp("ok.safetensors"));
  EXPECT_EQ(st.f32("a", 2), a);
  EXPECT_EQ(st.i32("b", 1), b);
  EXPECT_EQ(st.info("a").shape, (std::vector<std::int64_t>{2, 3}));
  expect_error([&] { st.i32("a"); }, "is F32, expected I32");
  expect_error([&] { st.f32("a", 1); }, "has rank 2, expected 1");
  expect_error([&] { st.f32("zzz"); }, "no tensor named 'zzz'");

  // Header length past the end of the file.
  {
    std::ofstream f(tmp("hlen.safetensors"), std::ios::binary);
    const std::uint64_t n = 1000;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << "{}";
  }
  expect_error([] { SafeTensors s(tmp("hlen.safetensors")); }, "header length 1000 exceeds the file");
  write_raw(tmp("json.safetensors"), "{not json", 0);
  expect_error([] { SafeTensors s(tmp("json.safetensors")); }, "not valid JSON");
  write_raw(tmp("past.safetensors"), R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8);
  expect_error([] { SafeTensors s(tmp("past.safetensors")); }, "outside the 8-byte data section");
  write_raw(tmp("shape.safetensors"), R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", 16);
  expect_error([] { SafeTensors s(tmp("shape.safetensors")); }, "spans 16 bytes but dtype F32 x shape needs 12");
  write_raw(tmp("dtype.safetensors"), R"({"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})", 1);
  expect_error([] { SafeTensors s(tmp("dtype.safetensors")); }, "unknown dtype 'Q7'");
  write_raw(tmp("overlap.safetensors"),
            R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6);
  expect_error([] { SafeTensors s(tmp("overlap.safetensors")); }, "overlap");
  // Truncated: a valid file cut short.
  std::filesystem::copy_file(tmp("ok.safetensors"), tmp("trunc.safetensors"), std::filesystem::copy_options::overwrite_existing);
  std::filesystem::resize_file(tmp("trunc.safetensors"), std::filesystem::file_size(tmp("ok.safetensors")) - 5);
  expect_error([] { SafeTensors s(tmp("trunc.safetensors")); }, "truncated");
  expect_error([] { SafeTensors s(tmp("none.safetensors")); }, "cannot open");
}

TEST(Checkpoint, RoundTripAndCorruptionIsRefused) {
  Checkpoint ck{{{"step", 3}, {"seed", 1}}, {1.f, 2.f, 3.f}, {0.1f, 0.2f, 0.3f}, {4.f, 5.f, 6.f}};
  save_checkpoint(tmp("ck.bin"), ck);
  const Checkpoint back = load_checkpoint(tmp("ck.bin"));
  EXPECT_EQ(back.params, ck.params);
  EXPECT_EQ(back.m, ck.m);
  EXPECT_EQ(back.v, ck.v);
  EXPECT_EQ(back.meta.at("step"), 3);
  EXPECT_FALSE(std::filesystem::exists(tmp("ck.bin.tmp")));  // written via temp file + rename
  {
    std::fstream f(tmp("ck.bin"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x5a');
  }
  expect_error([] { load_checkpoint(tmp("ck.bin")); }, "checksum mismatch");
  save_checkpoint(tmp("ck2.bin"), ck);
  std::filesystem::resize_file(tmp("ck2.bin"), 30);
  expect_error([] { load_checkpoint(tmp("ck2.bin")); }, "checksum mismatch");
  write_raw(tmp("notck.bin"), "hello", 40);
  expect_error([] { load_checkpoint(tmp("notck.bin")); }, "not a diffcp checkpoint");
}

TEST(Optim, CosineScheduleWithWarmupAndClipping) {
  EXPECT_NEAR(cosine_lr(1.0, 0, 100), 0.25, 1e-12);   // 4 warm-up steps: 1/4
  EXPECT_NEAR(cosine_lr(1.0, 3, 100), 1.0, 1e-12);
  EXPECT_NEAR(cosine_lr(1.0, 4, 100), 1.0, 1e-12);    // cosine starts at the peak
  EXPECT_NEAR(cosine_lr(1.0, 52, 100), 0.5, 1e-12);   // half-way through the decay
  EXPECT_LT(cosine_lr(1.0, 99, 100), 1e-3);
  EXPECT_NEAR(clip_scale(5.0, 1.0), 0.2, 1e-6);  // a gradient of norm 5 is scaled to norm 1
  EXPECT_EQ(clip_scale(0.5, 1.0), 1.0);
  // AdamW moves a parameter against its gradient by about lr; 1-D spans are not decayed.
  AdamW opt;
  opt.lr = 0.1;
  std::vector<float> p{1.f, 1.f, 1.f}, g{1.f, 1.f, -2.f}, m(3, 0.f), v(3, 0.f);
  opt.begin_step();
  opt.update(p.data(), g.data(), m.data(), v.data(), 0, 3, 0.1, {{1, 1}});
  EXPECT_NEAR(p[0], 1.f - 0.1f * (1.f + 0.1f), 1e-5);  // decayed
  EXPECT_NEAR(p[1], 1.f - 0.1f, 1e-5);                 // not decayed
  EXPECT_NEAR(p[2], 1.f + 0.1f * (1.f - 0.1f), 1e-5);
  // Elementwise: the update of a shard (elements [1, 3) of the flat vector) has the same bits.
  std::vector<float> q{1.f, 1.f, 1.f}, mq(3, 0.f), vq(3, 0.f);
  opt.update(q.data(), g.data(), mq.data(), vq.data(), 0, 1, 0.1, {{1, 1}});
  opt.update(q.data() + 1, g.data() + 1, mq.data() + 1, vq.data() + 1, 1, 2, 0.1, {{1, 1}});
  EXPECT_EQ(p, q);
  EXPECT_NEAR(p[1], 1.f - 0.1f, 1e-5);                 // not decayed
}

TEST(Data, PackingNeverSplitsSamplesAndAnchorsFollowTheSpec) {
  const DrafterConfig cfg;
  SyntheticSpec spec;
  spec.train_samples = 40;
  const auto src = make_synthetic_source(cfg, spec);
  const auto packs = pack_samples(src->train(), 512);
  std::size_t seen = 0;
  for (const auto& p : packs) {
    std::int64_t used = 0;
    for (std::size_t s : p) used += static_cast<std::int64_t>(src->train()[s].tokens.size()), ++seen;
    EXPECT_LE(used, 512);
  }
  EXPECT_EQ(seen, src->train().size());
  std::mt19937_64 rng(3);
  const PackedBatch b = sample_anchors(src->train(), packs[0], 8, cfg.block, rng, 512);
  for (std::size_t u = 0; u < b.anchors.size(); ++u) {
    const Sample& smp = src->train()[packs[0][u]];
    for (std::int64_t a : b.anchors[u]) {
      EXPECT_EQ(smp.loss_mask[static_cast<std::size_t>(a)], 1);  // a response position
      EXPECT_LE(a + cfg.block, static_cast<std::int64_t>(smp.tokens.size()));
    }
  }
  // Tokens never use the mask id.
  for (const Sample& s : src->train())
    for (std::int32_t t : s.tokens) EXPECT_NE(t, cfg.mask_token);
  expect_error([] { drafter_preset("huge"); }, "unknown preset 'huge'");
}

TEST(Data, LongSamplesAreRightTruncatedAndCandidatesCounted) {
  const DrafterConfig cfg;  // B = 8
  SyntheticSpec spec;
  spec.train_samples = 12;
  const auto src = make_synthetic_source(cfg, spec);  // lengths 96 .. 256
  const std::int64_t ctx = 64;
  const auto packs = pack_samples(src->train(), ctx);
  ASSERT_EQ(packs.size(), src->train().size());  // every sample is cut to the whole context: one per pack
  std::mt19937_64 rng(5);
  const PackedBatch b = sample_anchors(src->train(), packs[3], 4, cfg.block, rng, ctx);
  ASSERT_EQ(b.lengths, std::vector<std::int64_t>{ctx});  // the first `ctx` tokens are kept
  for (std::int64_t a : b.anchors[0]) EXPECT_LE(a + cfg.block, ctx);
  // Candidates: response positions x with x + B <= the (truncated) length.
  Sample s{{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1}, {}};
  EXPECT_EQ(anchor_candidates(s, 8, 100), 3);  // x in {2, 3, 4}: 4 + 8 <= 12
  EXPECT_EQ(anchor_candidates(s, 8, 11), 2);   // truncated to 11 tokens: x in {2, 3}
  EXPECT_EQ(anchor_candidates(s, 8, 8), 0);
}

TEST(Config, TargetLayerIdsFollowTheReference) {
  // The reference's rule round(1 + i (depth - 4) / (n - 1)): a 36-layer target, 5 features.
  EXPECT_EQ(default_target_layer_ids(36, 5), (std::vector<std::int64_t>{1, 9, 17, 25, 33}));
  EXPECT_EQ(default_target_layer_ids(36, 1), (std::vector<std::int64_t>{18}));
  DrafterConfig c;
  c.target_layer_ids = {0, 5};
  expect_error([&] { c.validate(); }, "target layer id 5 outside [0, 2)");
  c.target_layer_ids = {0};
  expect_error([&] { c.validate(); }, "1 target layer ids for 2 target layers");
  EXPECT_EQ(DrafterConfig::from_json(DrafterConfig().to_json()).to_json(), DrafterConfig().to_json());
}

}  // namespace
}  // namespace diffcp

namespace diffcp {
namespace {

TEST(Half, Bf16RoundsToNearestEvenAndF16DecodesExactly) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f), 0x3F80);         // halfway, to the even neighbour 1.0
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);     // halfway, to the even 1 + 2^-6
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);  // above halfway: up
  EXPECT_EQ(bf16_to_f32(0x3F81), 1.0f + 0x1p-7f);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  EXPECT_EQ(f32_to_bf16(-INFINITY), 0xFF80);
  EXPECT_EQ(f16_to_f32(0x3C00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xC000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x7BFF), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0001), 0x1p-24f);  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x03FF), 1023 * 0x1p-24f);
  EXPECT_EQ(f16_to_f32(0x7C00), INFINITY);
  EXPECT_TRUE(std::signbit(f16_to_f32(0x8000)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7E00)));
}

}  // namespace
}  // namespace diffcp
