// Training data of the drafter: samples (token ids + loss mask), the target model's hidden states
// of n_t layers for every token, packing into fixed-length micro-batches (samples never split),
// and anchor sampling (SPEC A.1).
//
// Two sources share one interface: SyntheticSource (the embedded default: a seeded low-entropy
// Markov chain over the vocabulary and a small frozen random "target model" of our own) and
// ShardSource (safetensors shards written by tools/extract_shards.py from a real model).
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "diffcp/drafter/config.hpp"
#include "diffcp/workload/batch.hpp"

namespace diffcp {

struct Sample {
  std::vector<std::int32_t> tokens;    // [L]
  std::vector<std::uint8_t> loss_mask;  // [L] 1 on response tokens
  std::vector<std::int32_t> greedy;    // [L] or empty: the target's greedy token for each position
                                        // (argmax of its logits after tokens [0, x)), when known
};

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual const std::vector<Sample>& train() const = 0;
  virtual const std::vector<Sample>& heldout() const = 0;
  // Target hidden states of positions [begin, end) of sample `s` of split `heldout`:
  // out [end - begin, n_t * H].
  virtual void hidden(bool heldout, std::size_t s, std::int64_t begin, std::int64_t end, float* out) const = 0;
  // The target's frozen embedding and LM head, read where they live (a mapped file, a generator):
  // no rank needs a whole copy. out [n, H] = embedding rows of tokens [n]; out [H, v1 - v0] =
  // LM head columns [v0, v1).
  virtual void embedding_rows(std::span<const std::int32_t> tokens, float* out) const = 0;
  virtual void lm_head_columns(std::int64_t v0, std::int64_t v1, float* out) const = 0;
  virtual std::string describe() const = 0;
  // Which target layers the hidden states come from and the target's depth, when the data says
  // (shards from tools/extract_shards.py do); empty / 0 otherwise.
  virtual std::vector<std::int64_t> target_layer_ids() const { return {}; }
  virtual std::int64_t target_depth() const { return 0; }
};

// Markov chain: every token has 3 likely successors (p = 0.75, 0.15, 0.1); the mask token never
// occurs in text. Target model: layer t's hidden state at position x is
// tanh([E(tok_x); E(tok_{x-1})] W_t) (a zero vector before the sample's first token). The
// embedding row of token v and the LM head column v are generated from (seed, v) when asked for,
// so a 151936-token vocabulary costs no memory. Sample lengths are uniform in [min, max].
struct SyntheticSpec {
  std::int64_t train_samples = 96, heldout_samples = 16;
  std::int64_t min_length = 96, max_length = 256;
  double prompt_fraction = 0.25;
  std::uint64_t seed = 1;
};
std::unique_ptr<DataSource> make_synthetic_source(const DrafterConfig& cfg, const SyntheticSpec& spec);

// A directory with model.safetensors (embedding [V, H] and lm_head [H, V], f32) and
// shard_*.safetensors files, each with tokens (I32 [T]), loss_mask (U8 [T]), offsets (I64 [n+1],
// sample boundaries into the T rows), hidden (F32 [T, n_t*H]) and optionally target_greedy (I32
// [T], Sample::greedy); model.safetensors' metadata may name target_layer_ids (a JSON list) and
// num_target_layers. The last `heldout` samples are held out. Every offset, dtype and shape is
// validated.
std::unique_ptr<DataSource> make_shard_source(const DrafterConfig& cfg, const std::string& dir, std::int64_t heldout);

// Greedy packing of samples (in order) into micro-batches of at most `context` tokens; a sample
// longer than `context` counts as its first `context` tokens (right-truncation: the reference's
// max_length). Each micro-batch lists sample indices.
std::vector<std::vector<std::size_t>> pack_samples(const std::vector<Sample>& samples, std::int64_t context);

// Candidate anchor positions of a sample's first `max_length` tokens: x with loss_mask[x] = 1 and
// x + B <= length.
std::int64_t anchor_candidates(const Sample& s, std::int64_t block, std::int64_t max_length);

// Anchors of one packed micro-batch (SPEC A.1): per sample (its first `max_length` tokens), up to
// `anchors` of its candidate positions drawn uniformly without replacement, sorted.
PackedBatch sample_anchors(const std::vector<Sample>& samples, const std::vector<std::size_t>& members,
                           std::int64_t anchors, std::int64_t block, std::mt19937_64& rng, std::int64_t max_length);

}  // namespace diffcp
