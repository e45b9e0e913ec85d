// Weights that fit (issue #35, dit/weights.hpp), at P = 1, 2, 3, 4, 8:
//   * the layout's gather units hold every Linear weight once, in the forward's order, the shared
//     modulation of FLUX.2 outside the blocks; the allocation equals dit_weight_bytes for every
//     storage dtype and P.
//   * bf16-stored weights: with bf16 compute bitwise the f32 weights rounded by bf16 compute (the
//     same GEMM operands); with f32 compute the image within 40 dB of the f32 run's.
//   * sharded weights equal replicated ones bitwise in every family (FLUX.1 guided, Qwen-Image with
//     a negative pass sharing the weights, FLUX.2's shared modulation, SD3's context-pre-only block),
//     both dtypes and every mode (USP too); the bytes gathered equal the closed form per forward,
//     one gather per block unit; a sharded load keeps the file's values.
//   * refusals: bf16 compute on sharded f32 weights, host_params / save of sharded weights.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include <gtest/gtest.h>

#include "diffcp/core/half.hpp"
#include "diffcp/core/random.hpp"
#include "diffcp/dit/ops.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/dit/image.hpp"
#include "diffcp/dit/metrics.hpp"
#include "diffcp/dit/run.hpp"
#include "diffcp/dit/sampler.hpp"
#include "dit_family_config.hpp"
#include "error_of.hpp"
#include "mpi_test.hpp"

namespace diffcp {
namespace {

Communicator& world() { return test::world(); }

// 24 heads (Ulysses at every tested P); two blocks of each kind the family has.
DitConfig weights_config(DitFamily family) {
  DitConfig c = test::tiny_family_config(family, 24, 96, 2, 2, 16);
  c.guidance_embed = family == DitFamily::flux1;
  return c;
}

const DitFamily kFamilies[] = {DitFamily::flux1, DitFamily::qwen_image, DitFamily::flux2, DitFamily::sd3};
const DitShape kShape{2, 96, 64, 12};

struct Inputs {
  DitConditioning cond;
  SampleOptions opt;
};

Inputs inputs(const DitConfig& cfg, DType compute = DType::f32) {
  Inputs in{prompt_conditioning(cfg, kShape, "weights that fit"),
            {flow_schedule(3, TimeSchedule::flux, kShape.image_tokens()), 4.0, {}, compute}};
  if (cfg.true_cfg()) {  // a negative prompt: the second pass reads the same (sharded) weights
    const DitConditioning neg = prompt_conditioning(cfg, DitShape{1, 16, 16, 8}, "");
    in.cond.negative_txt = neg.txt;
    in.cond.negative_pooled = cfg.has_pooled() ? neg.pooled : std::vector<float>{};
    in.cond.negative_tokens = 8;
  }
  return in;
}

DitRun sample(const DitWeights& w, const Inputs& in, ExchangeMode mode = ExchangeMode::flat, int U = 0) {
  const CacheSchedule r0{CacheScheduleKind::fixed, 0.0, 0, 0};
  const auto ex = make_attention_exchange(mode, world(), 1, r0, U);
  const auto neg = make_attention_exchange(mode, world(), 1, r0, U);
  return run_dit_sampling(world(), w, kShape, *ex, in.cond, initial_noise(w.config(), kShape, 5), in.opt, neg.get());
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(DitWeightUnits, EveryLinearOnceInForwardOrderAndBytesInClosedForm) {
  for (const DitFamily family : kFamilies) {
    SCOPED_TRACE(dit_family_name(family));
    const DitConfig cfg = weights_config(family);
    const DitLayout L(cfg);
    std::set<std::int64_t> seen;
    std::int64_t sum = 0;
    for (const DitLayout::Unit& u : L.units) {
      std::int64_t size = 0;
      for (std::size_t i = 0; i < u.w.size(); ++i) {
        EXPECT_TRUE(seen.insert(u.w[i]).second) << "matrix offset " << u.w[i] << " in two units";
        size += u.n[i];
      }
      EXPECT_EQ(size, u.size);
      sum += u.size;
    }
    EXPECT_EQ(sum, L.matrices);
    std::int64_t linear_weights = 0;
    for (const DitLayout::Tensor& t : L.tensors) linear_weights += t.linear_weight;
    EXPECT_EQ(static_cast<std::int64_t>(seen.size()), linear_weights);
    // Per double block: both streams' mod + qkv, then each stream's proj + MLP (SD3's last text
    // stream has none); per single block one unit.
    const std::int64_t pre_only = family == DitFamily::sd3 ? 1 : 0;
    EXPECT_EQ(static_cast<std::int64_t>(L.units.size()), 1 + 3 * cfg.double_blocks - pre_only + cfg.single_blocks);
    const DitLayout::DoubleBlock& b0 = L.double_blocks[0];
    EXPECT_EQ(b0.txt.qkv.unit, 1);
    EXPECT_EQ(b0.img.qkv.unit, 1);
    EXPECT_EQ(b0.txt.proj.unit, 2);
    EXPECT_EQ(b0.img.mlp2.unit, 3);
    if (family == DitFamily::flux2) {  // the shared modulation lives outside the blocks
      EXPECT_EQ(b0.img.mod.unit, 0);
      EXPECT_EQ(L.single_blocks[1].mod.unit, 0);
      EXPECT_EQ(L.double_blocks[1].txt.mod.w, b0.txt.mod.w);
    } else {
      EXPECT_EQ(b0.img.mod.unit, 1);
    }
    for (const DType storage : {DType::f32, DType::bf16})
      for (const bool shard : {false, true}) {
        const DitWeights w(cfg, storage, shard ? &world() : nullptr);
        EXPECT_EQ(w.sharded(), shard && world().size() > 1);
        EXPECT_EQ(w.bytes(), dit_weight_bytes(L, storage, w.shards()));
      }
  }
  // The closed form itself: replicated e * matrices + 4 * vectors; sharded below it once the blocks dominate.
  const DitConfig big = weights_config(DitFamily::flux1);
  const DitLayout L(big);
  EXPECT_EQ(dit_weight_bytes(L, DType::bf16, 1), 2 * L.matrices + 4 * L.vectors);
  EXPECT_EQ(dit_gather_bytes(L, DType::bf16, 1), 0);
  std::int64_t c = 0;
  for (std::size_t u = 1; u < L.units.size(); ++u) c += (L.units[u].size + 3) / 4;
  EXPECT_EQ(dit_gather_bytes(L, DType::bf16, 4), 2 * 3 * c);
}

TEST(DitWeightStorage, Bf16WeightsAreBf16ComputesOperands) {
  const DitConfig cfg = weights_config(DitFamily::flux1);
  DitWeights f32(cfg), bf16(cfg, DType::bf16);
  f32.init_random(41);
  bf16.init_random(41);
  // bf16 compute: the f32 weights rounded once per model = the bf16-stored weights: bitwise.
  const std::vector<float> a = sample(f32, inputs(cfg, DType::bf16)).latent, b = sample(bf16, inputs(cfg, DType::bf16)).latent;
  EXPECT_TRUE(bitwise_equal(a, b));
  // f32 compute with bf16 weights (GEMMs on bf16 operands, f32 attention) against the f32 run.
  const std::vector<float> ref = sample(f32, inputs(cfg)).latent, got = sample(bf16, inputs(cfg)).latent;
  const auto rgb = [&](const std::vector<float>& latent) { return latent_to_rgb(latent, cfg, kShape); };
  const double psnr = psnr_from_mse(image_mse(rgb(got), rgb(ref)));
  EXPECT_GE(psnr, 40.0);
  EXPECT_TRUE(std::isfinite(psnr)) << "bf16 weights gave exactly the f32 image: the bf16 GEMMs did not run";
  RecordProperty("bf16_weights_psnr_db", std::to_string(psnr));
}

// dense_linear (ops/backend.hpp), the bf16-weight product the DiT runs: a column slice of a wider
// weight into a column slice of a wider y, at row counts of the model's chunks and tails. The packed
// weight gives bitwise the stored one's result, and both the fp64 product of the bf16 operands to
// f32 accumulation's bound; a repacked copy goes when the weights change.
TEST(DitWeightPacking, PackedEqualsStoredAndTheFp64Product) {
  const std::int64_t K = 96, Nw = 80, c0 = 16, N = 48, ldy = 56;
  const std::vector<float> w32 = random_normal(K * Nw, 7, 0.2), bias = random_normal(Nw, 8);
  std::vector<bf16_t> W(w32.size());
  for (std::size_t i = 0; i < W.size(); ++i) W[i].bits = f32_to_bf16(w32[i]);
  ConstTensorView wv = ConstTensorView::contiguous(W.data() + c0, DType::bf16, {K, N});
  wv.stride[0] = Nw;
  const std::unique_ptr<PackedWeight> packed = cpu_backend().pack_weight(wv);
  RecordProperty("packed", packed ? "yes" : "no (this CPU's oneDNN has no native bf16 matmul)");
  for (const std::int64_t M : {1, 7, 64, 130}) {
    const std::vector<float> x = random_normal(M * K, 9 + M);
    std::vector<float> y0(M * ldy, -1.f), y1(M * ldy, -1.f);
    dit_linear(x.data(), K, M, K, W.data() + c0, Nw, N, bias.data() + c0, y0.data(), ldy);
    dit_linear(x.data(), K, M, K, W.data() + c0, Nw, N, bias.data() + c0, y1.data(), ldy, packed.get());
    EXPECT_EQ(std::memcmp(y0.data(), y1.data(), sizeof(float) * y0.size()), 0) << "M = " << M;
    for (std::int64_t r = 0; r < M; ++r) {
      for (std::int64_t j = 0; j < N; ++j) {
        double ref = bias[static_cast<std::size_t>(c0 + j)], mag = std::abs(ref);
        for (std::int64_t k = 0; k < K; ++k) {
          const double t = static_cast<double>(bf16_to_f32(f32_to_bf16(x[static_cast<std::size_t>(r * K + k)]))) *
                           bf16_to_f32(W[static_cast<std::size_t>(k * Nw + c0 + j)].bits);
          ref += t;
          mag += std::abs(t);
        }
        ASSERT_NEAR(y0[static_cast<std::size_t>(r * ldy + j)], ref, 1e-5 * mag + 1e-6) << "M = " << M << " (" << r << ", " << j << ")";
      }
      for (std::int64_t j = N; j < ldy; ++j) ASSERT_EQ(y0[static_cast<std::size_t>(r * ldy + j)], -1.f) << "wrote past ncols";
    }
  }
  // DitWeights: a packed copy per (Linear, columns), dropped by a new init.
  const DitConfig cfg = weights_config(DitFamily::flux1);
  DitWeights w(cfg, DType::bf16);
  w.init_random(3);
  const DitLinear& l = w.layout().double_blocks.at(0).img.qkv;
  const PackedWeight* a = w.packed(l, 0, l.out);
  EXPECT_EQ(a, w.packed(l, 0, l.out));
  EXPECT_EQ(w.packed_bytes() > 0, a != nullptr);
  w.init_random(4);
  EXPECT_EQ(w.packed_bytes(), 0u);
  EXPECT_THROW(w.packed(l, 8, l.out), Error);
}

TEST(DitWeightSharding, EqualsReplicatedBitwiseWithGatherBytesInClosedForm) {
  const int P = world().size();
  for (const DitFamily family : kFamilies) {
    const DitConfig cfg = weights_config(family);
    for (const DType storage : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(dit_family_name(family)) + " " + dtype_name(storage));
      DitWeights replicated(cfg, storage), sharded(cfg, storage, &world());
      replicated.init_random(43);
      sharded.init_random(43);
      const Inputs in = inputs(cfg);
      const int passes = uses_negative_pass(cfg, in.cond, in.opt) ? 2 : 1, steps = 3;
      const std::vector<float> ref = sample(replicated, in).latent;
      std::vector<ExchangeMode> modes{ExchangeMode::flat, ExchangeMode::vfirst, ExchangeMode::cocodiff};
      for (const ExchangeMode mode : modes) {
        SCOPED_TRACE(exchange_mode_name(mode));
        const std::uint64_t bytes0 = P > 1 ? sharded.gather_comm()->stats()[CommOp::recv].bytes_recv : 0;
        const std::uint64_t gathers0 = sharded.gather_stats().gathers;
        EXPECT_TRUE(bitwise_equal(sample(sharded, in, mode).latent, ref));
        if (P == 1) continue;
        const std::uint64_t forwards = static_cast<std::uint64_t>(steps * passes);
        EXPECT_EQ(sharded.gather_comm()->stats()[CommOp::recv].bytes_recv - bytes0,
                  forwards * static_cast<std::uint64_t>(dit_gather_bytes(sharded.layout(), storage, P)));
        EXPECT_EQ(sharded.gather_stats().gathers - gathers0, forwards * (sharded.layout().units.size() - 1));
      }
      if (P % 2 == 0 && P > 2 && family == DitFamily::flux1) {  // USP: the gathers run beside the ring
        EXPECT_TRUE(bitwise_equal(sample(sharded, in, ExchangeMode::flat, 2).latent,
                                  sample(replicated, in, ExchangeMode::flat, 2).latent));
      }
    }
  }
}

TEST(DitWeightSharding, LoadKeepsTheFileValuesAndShardedRefusals) {
  const DitConfig cfg = weights_config(DitFamily::flux1);
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("dit_weights_" + std::to_string(::getpid()) + "_r" + std::to_string(world().rank()) + ".safetensors"))
                               .string();
  {
    DitWeights w(cfg);
    w.init_random(47);
    w.save(path, "BF16");
  }
  DitWeights replicated(cfg, DType::bf16), sharded(cfg, DType::bf16, &world());
  replicated.load(path);
  sharded.load(path);
  std::filesystem::remove(path);
  EXPECT_TRUE(bitwise_equal(sample(sharded, inputs(cfg)).latent, sample(replicated, inputs(cfg)).latent));
  if (world().size() > 1) {
    EXPECT_NE(error_of([&] { sharded.host_params(); }).find("not `shard_weights`"), std::string::npos);
    DitWeights f32(cfg, DType::f32, &world());
    EXPECT_NE(error_of([&] { sample(f32, inputs(cfg, DType::bf16)); }).find("`weights_dtype` bf16"), std::string::npos);
  }
  EXPECT_NE(error_of([&] { DitWeights(cfg, DType::u16); }).find("expected f32 or bf16"), std::string::npos);
  world().barrier();
}

}  // namespace
}  // namespace diffcp
