// Regression tests for what the fuzz targets (fuzz/, scripts/fuzz.sh) found in the parsers of
// outside data: each input that crashed a parser, threw something other than diffcp::Error, or
// made it allocate what the file does not hold must now be refused with a diffcp::Error naming the
// problem. The inputs are the fuzzer's (or, marked "review", found reading the code the fuzzer
// pointed at). Cases whose old failure was undefined behaviour only (a float cast out of range, a
// null memcpy) show it under the asan preset; here they check the new, explicit refusal.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "cli/commands.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/drafter/checkpoint.hpp"
#include "diffcp/drafter/data.hpp"
#include "diffcp/io/npy.hpp"
#include "diffcp/io/safetensors.hpp"
#include "diffcp/workload/batch.hpp"

namespace diffcp {
namespace {

std::string write_file(const std::string& name, const std::string& bytes) {
  const auto path = (std::filesystem::path(::testing::TempDir()) / ("fuzzed_" + name)).string();
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  return path;
}

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected a diffcp::Error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A safetensors file: 8-byte little-endian header length, header, data.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(static_cast<std::uint64_t>(header.size()) >> (8 * i));
  return out + header + data;
}

// A checkpoint as drafter/checkpoint.cpp lays it out, with a correct FNV-1a checksum, so that only
// the header and the sizes are wrong (the fuzz target fixes the checksum the same way).
std::string checkpoint_bytes(const std::string& json, const std::string& data, std::uint64_t json_len) {
  std::string b = "DIFFCPCK";
  const std::uint32_t version = 1;
  b.append(reinterpret_cast<const char*>(&version), 4);
  b.append(reinterpret_cast<const char*>(&json_len), 8);
  b += json + data;
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : b) h = (h ^ c) * 1099511628211ull;
  b.append(reinterpret_cast<const char*>(&h), 8);
  return b;
}
std::string checkpoint_bytes(const std::string& json, const std::string& data) {
  return checkpoint_bytes(json, data, json.size());
}

// ---- CLI sizes (fuzz_cli_args) ----

TEST(FuzzedCli, CountTimesSuffixOverflowIsRefused) {
  // Was: signed overflow 99999999999999 * 1048576 (UBSan), a negative or wrapped count.
  expect_error([] { cli::parse_range("99999999999999m:9", "--context"); }, "--context = '99999999999999m': too large");
  expect_error([] { cli::parse_count("9999999999999m", "--bytes"); }, "too large");
  EXPECT_EQ(cli::parse_count("8796093022207m", "--bytes"), std::int64_t{8796093022207} * 1048576);  // 2^63 - 1M
}

// The library's errors name fields in backticks; the CLI prints them as its flags (issue #68).
TEST(FuzzedCli, LibraryFieldsPrintAsFlags) {
  EXPECT_EQ(cli::cli_flags("x.cpp:3 (f): `cache_ratio` = 2 and `ulysses_degree` U; `diffcp sim calibrate`, `P`, `a`b, ``, `x"),
            "x.cpp:3 (f): --cache-ratio = 2 and --ulysses-degree U; `diffcp sim calibrate`, `P`, --ab, ``, `x");
  EXPECT_EQ(cli::cli_flags("`"), "`");
  EXPECT_EQ(cli::cli_flags(""), "");
}

// ---- .npy (fuzz_npy) ----

TEST(FuzzedNpy, NonIntegerShapeEntryIsRefused) {
  // Was: std::invalid_argument from std::stoll escaping the reader.
  const std::string bytes(
      "\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shap(:' e1, 3), }"
      "                                                          \x0a\x00\x00\xc0?\x00\x00\x00\xc0\x00\x00\x00\x00"
      "\x00\x00\x80@\x00\x00\xa0@\x00\x00 @",
      152);
  std::vector<std::int64_t> shape;
  expect_error([&] { read_npy_f32(write_file("e1.npy", bytes), shape); }, "shape entry ':' e1' is not a non-negative integer");
}

std::string npy_with_shape(const std::string& shape, std::size_t data_bytes) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string b("\x93NUMPY\x01\x00", 8);
  b += static_cast<char>(header.size() & 0xff);
  b += static_cast<char>(header.size() >> 8);
  return b + header + std::string(data_bytes, '\0');
}

TEST(FuzzedNpy, ShapesTheFileCannotHoldAreRefusedBeforeAllocating) {
  std::vector<std::int64_t> shape;
  // review: a 1 TB claim on a 16-byte file was allocated before the read found it short.
  expect_error([&] { read_npy_f32(write_file("tb.npy", npy_with_shape("(262144, 1048576)", 16)), shape); },
               "is truncated: shape entry 262144 makes more values than the file's 4");
  // review: a negative entry made the count negative (a huge size_t).
  expect_error([&] { read_npy_f32(write_file("neg.npy", npy_with_shape("(-1, 4)", 16)), shape); },
               "shape entry '-1' is not a non-negative integer");
  // review: entries whose product overflows int64.
  expect_error([&] { read_npy_f32(write_file("ovf.npy", npy_with_shape("(4294967296, 4294967296)", 16)), shape); },
               "is truncated");
  // review: a header length past the end of the file.
  expect_error([&] { read_npy_f32(write_file("hlen.npy", npy_with_shape("(1,)", 4).substr(0, 40)), shape); },
               "bytes is past the end of the 40-byte file");
  // The valid file still reads.
  EXPECT_EQ(read_npy_f32(write_file("ok.npy", npy_with_shape("(2, 2)", 16)), shape).size(), 4u);
  EXPECT_EQ(shape, (std::vector<std::int64_t>{2, 2}));
}

// ---- checkpoints (fuzz_checkpoint) ----

TEST(FuzzedCheckpoint, HeaderWithoutNParamsIsRefused) {
  // Was: nlohmann::json::out_of_range ("key 'n_params' not found") escaping load_checkpoint.
  const std::string floats(12, '\0');
  expect_error([&] { load_checkpoint(write_file("np.ck", checkpoint_bytes(R"({"-_params":1,"seed":1,"step":3})", floats))); },
               "header has no non-negative integer \"n_params\"");
  expect_error([&] { load_checkpoint(write_file("arr.ck", checkpoint_bytes("[1,2]", floats))); }, "n_params");
  expect_error([&] { load_checkpoint(write_file("neg.ck", checkpoint_bytes(R"({"n_params":-1})", floats))); }, "n_params");
  expect_error([&] { load_checkpoint(write_file("flt.ck", checkpoint_bytes(R"({"n_params":1.5})", floats))); }, "n_params");
}

TEST(FuzzedCheckpoint, ParameterCountsThatWrapAreRefused) {
  // review: 2^62 parameters: 3 * n * 4 bytes wraps to 0, so the size check passed and 2^62 floats
  // were allocated (std::bad_alloc, or ASan's allocation-size-too-big).
  expect_error([] { load_checkpoint(write_file("wrap.ck", checkpoint_bytes(R"({"n_params":4611686018427387904})", ""))); },
               "do not match 4611686018427387904 parameters");
  // review: a header length near 2^64: 20 + js_len wrapped.
  expect_error([] { load_checkpoint(write_file("jslen.ck", checkpoint_bytes("{}", "", ~std::uint64_t{0} - 15))); },
               "header length 18446744073709551600 past the end");
  // review: a directory (std::ifstream opens it and reports a size of 2^63 - 1).
  expect_error([] { load_checkpoint(::testing::TempDir()); }, "cannot open it as a file");
}

// ---- anchors files (fuzz_anchors) ----

TEST(FuzzedAnchors, NonIntegersAndOverflowsAreRefused) {
  // Was: UBSan "1e+300 is outside the range of representable values of type 'long'" (nlohmann's cast).
  expect_error([] { read_anchors_file(write_file("f.json", R"({"block": 1e300, "samples": [{"length": 1, "anchors": []}]})")); },
               "\"block\" = 1e+300, expected an integer below 2^63");
  expect_error([] { read_anchors_file(write_file("a.json", R"({"block": 1, "samples": [{"length": 4, "anchors": [0.5]}]})")); },
               "sample 0 anchor = 0.5, expected an integer");
  expect_error([] { read_anchors_file(write_file("u.json", R"({"block": 1, "samples": [{"length": 18446744073709551615, "anchors": []}]})")); },
               "sample 0 \"length\" = 18446744073709551615, expected an integer below 2^63");
  // Was: signed overflow of anchor + B (UBSan); the wrapped sum passed the check and the batch was accepted.
  expect_error([] {
    read_anchors_file(write_file("o.json", R"({"block": 4611686018427387904, "samples": [{"length": 9223372036854775807, "anchors": [9223372036854775000]}]})"));
  }, "anchor + B = 13835058055282162904 is past the sample end 9223372036854775807");
  // review: S = sum of lengths and Q = N * B past 2^63 - 1 (both computed by every user of a batch).
  expect_error([] {
    read_anchors_file(write_file("s.json", R"({"block": 1, "samples": [{"length": 9223372036854775807, "anchors": []}, {"length": 1, "anchors": []}]})"));
  }, "sample 1 has length 1: the packed context S = sum of lengths exceeds 2^63 - 1");
  expect_error([] {
    read_anchors_file(write_file("q.json", R"({"block": 4611686018427387904, "samples": [{"length": 9223372036854775807, "anchors": [0, 1]}]})"));
  }, "the query rows Q = N*B exceed 2^63 - 1");
}

// ---- safetensors (fuzz_safetensors, fuzz_shards, fuzz_dit_weights) ----

TEST(FuzzedSafetensors, FloatShapesAndOffsetsAreRefused) {
  // Was: UBSan float-cast-overflow in nlohmann's get<std::vector<std::int64_t>>() for [1e300].
  const std::string data(4, '\0');
  expect_error([&] { SafeTensors s(write_file("fs.st", safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1e300],"data_offsets":[0,4]}})", data))); },
               "tensor 'a' shape holds 1e+300, expected integers below 2^63");
  expect_error([&] { SafeTensors s(write_file("fo.st", safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}})", data))); },
               "tensor 'a' data_offsets holds 4.0, expected integers");
  expect_error([&] { SafeTensors s(write_file("so.st", safetensors_bytes(R"({"a":{"dtype":"F32","shape":7,"data_offsets":[0,4]}})", data))); },
               "tensor 'a' shape is not an array");
}

TEST(FuzzedSafetensors, EmptyTensorReadsAsEmpty) {
  // Was: memcpy(nullptr, ..., 0) for a tensor with a 0 in its shape (UBSan nonnull-attribute).
  const SafeTensors s(write_file("empty.st", safetensors_bytes(R"({"x":{"dtype":"I64","shape":[0,4],"data_offsets":[0,0]}})", "")));
  EXPECT_TRUE(s.i64("x", 2).empty());
}

// ---- the drafter's shard directory (fuzz_shards) ----

TEST(FuzzedShards, OffsetPastTheRowsIsRefused) {
  // Was: ASan heap-buffer-overflow. offsets (0, 25605, 8) over 8 token rows: each step was only
  // checked to increase, so sample 0 was copied from tokens [0, 25605).
  DrafterConfig cfg;
  cfg.vocab = 16;
  cfg.hidden = 4;
  cfg.target_layers = 2;
  cfg.mask_token = 15;
  const auto dir = std::filesystem::path(::testing::TempDir()) / "fuzzed_shards";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::vector<float> emb(64, 0.5f), hidden(64, 0.f);
  write_safetensors((dir / "model.safetensors").string(),
                    {{"embedding", "F32", {16, 4}, emb.data()}, {"lm_head", "F32", {4, 16}, emb.data()}});
  const std::vector<std::int32_t> tokens{8, 12, 0, 6, 1, 8, 8, 0};
  const std::vector<std::uint8_t> mask(8, 1);
  const std::vector<std::int64_t> offsets{0, 25605, 8};
  write_safetensors((dir / "shard_00000.safetensors").string(),
                    {{"tokens", "I32", {8}, tokens.data()},
                     {"loss_mask", "U8", {8}, mask.data()},
                     {"offsets", "I64", {3}, offsets.data()},
                     {"hidden", "F32", {8, 8}, hidden.data()}});
  expect_error([&] { make_shard_source(cfg, dir.string(), 1); },
               "offsets 0, 1 = 0, 25605: not increasing within the 8 token rows");
}

}  // namespace
}  // namespace diffcp
