// The DiT's parameters (dit/config.hpp's DitLayout) as they live on a rank: the matrices (every
// Linear weight) in f32 or bf16, the vectors (biases, norm scales, SD3's position table) in f32;
// either every rank holds all of them, or (--shard-weights) each rank holds 1/P of every block's
// matrices and the blocks' gather units (DitLayout::units) are all-gathered just before they run.
//
// Legend: P ranks sharing the weights, u a gather unit, S_u its elements, c_u = ceil(S_u / P) the
//         elements a rank holds of it, e the matrices' element size (4 f32, 2 bf16).
//
// Memory per rank (weight_bytes; DitWeights::bytes() is what is allocated):
//   replicated: e * matrices + 4 * vectors
//   sharded:    e * (S_0 + sum_{u>=1} c_u + 2 P max_{u>=1} c_u) + 4 * vectors
// (units[0], the weights outside the blocks, stays on every rank; two gather windows: the unit in
// use and the next one's gather in flight).
//
// Gathered bytes per forward (each rank receives): e * (P - 1) * sum_{u>=1} c_u (less when a model
// has at most two block units: a unit still in a window is not gathered again), as point-to-point
// messages (each rank sends its slice to the P - 1 others) counted by the weights' own
// communicator (gather_comm(): CommOp::recv).
//
// Order of use (the model, every rank alike): begin_forward() issues unit 1's gather; matrix(l)
// for the Linears of unit u in the forward's order waits for u's gather, issues u + 1's, and
// returns the window; poll() drives the gather in flight between compute chunks. One forward at a
// time (a negative prompt's model shares the weights and runs after).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/dit/config.hpp"
#include "diffcp/dit/diffusers.hpp"
#include "diffcp/io/safetensors.hpp"
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

// The model shape of a FLUX-format checkpoint, read off its tensors: H and C_in from img_in,
// text_dim from txt_in, pooled_dim from vector_in, time_dim from time_in, the depths from the
// block indices present, M from the first MLP (or linear1), d_h from a QK-norm scale (so the heads
// are H / d_h; `heads`, when given, must agree), guidance_embed from guidance_in, qkv_bias from the
// first qkv bias. Not in the tensors: the RoPE axes (flux_rope_axes(d_h): FLUX.1's [16, 56, 56] at
// d_h = 128) and theta (10000); give a --config for others. Throws naming the tensor it lacks.
DitConfig infer_dit_config(const SafeTensorsSet& ck, std::optional<std::int64_t> heads = std::nullopt);
// Checks the checkpoint's header against the model's layout, reading no data: throws one
// diffcp::Error naming every missing, extra, mistyped (not F32 / BF16 / F16) and misshapen tensor.
// `format`: the file's names (dit/diffusers.hpp); the error lists the file's names.
void check_dit_checkpoint(const DitConfig& cfg, const SafeTensorsSet& ck, DitFileFormat format = DitFileFormat::bfl);

// The bytes above for a layout: `storage` f32 or bf16, `shards` P (1: replicated).
std::int64_t dit_weight_bytes(const DitLayout& layout, DType storage, int shards);
// Bytes one rank receives per forward through the weights' all-gathers (0 when replicated).
std::int64_t dit_gather_bytes(const DitLayout& layout, DType storage, int shards);

// What the weights' all-gathers did (since construction).
struct DitGatherStats {
  std::uint64_t gathers = 0;  // units gathered
  double wait_ms = 0;         // blocked in matrix() waiting for a gather (not hidden by compute)
};

class DitWeights {
 public:
  // Zero-filled parameters in the memory of the backend active here. `storage`: the matrices' dtype
  // (f32 or bf16). `shard_over` (collective over it; may be null): with more than one rank, each
  // rank holds 1/P of every block unit, gathered over a communicator split from it (so the
  // gathers never interleave with the caller's collectives); it must outlive the weights.
  explicit DitWeights(const DitConfig& cfg, DType storage = DType::f32, Communicator* shard_over = nullptr);
  ~DitWeights();
  DitWeights(const DitWeights&) = delete;
  DitWeights& operator=(const DitWeights&) = delete;

  const DitConfig& config() const { return cfg_; }
  const DitLayout& layout() const { return layout_; }
  DType storage() const { return storage_; }
  bool sharded() const { return shards_ > 1; }
  int shards() const { return shards_; }   // P (1: replicated)
  Backend* backend() const { return vectors_.backend(); }
  std::int64_t bytes() const;  // this rank's allocation: dit_weight_bytes(layout(), storage(), shards())

  // Seeded init (same on every rank): Linear weights N(0, 1/in) (unit-variance outputs for
  // unit-variance inputs, so 50 steps of a random model stay finite), biases 0, norm scales 1;
  // rounded to bf16 when stored so.
  void init_random(std::uint64_t seed);
  // Reads every tensor of the layout from a checkpoint (one file or shards with an index JSON), as
  // F32, BF16 or F16 (converted to f32 exactly, then to the storage dtype), with the documented
  // shape. First checks the whole header: throws one diffcp::Error naming every missing, extra,
  // mistyped and misshapen tensor (a truncated or malformed file is refused by the reader). The file
  // is mapped, not read: each tensor is converted and its pages released, so loading holds the
  // parameters plus at most one tensor of the file in f32 (sharded: a rank keeps its slice of it).
  void load(const SafeTensorsSet& ck, DitFileFormat format = DitFileFormat::bfl);
  void load(const std::string& path) { load(SafeTensorsSet(path)); }
  // Writes every tensor (Linear weights transposed back to [out, in]) as `dtype`: F32, BF16 (round
  // to nearest even) or F16. Not sharded weights.
  void save(const std::string& path, const std::string& dtype = "F32") const;
  // Every parameter as f32 on the host, [layout().total]: the matrices (layout offsets), then the
  // vectors (at layout().matrices + their offsets). set_host_params is the inverse. Not sharded.
  std::vector<float> host_params() const;
  void set_host_params(const std::vector<float>& params);

  // The model's reads (device memory of backend()):
  const float* vector(std::int64_t offset) const { return vectors_.ptr<float>() + offset; }  // f32
  // Linear l's weight [l.in, l.out] in storage(), row stride l.out. Sharded block units: the
  // gather window (see the order of use above).
  const void* matrix(const DitLinear& l) const;
  const Buffer& unit(int u) const { return units_[static_cast<std::size_t>(u)]; }  // its storage (sharded: the slice)
  // f32 weights read by bf16 GEMMs (bf16 compute): Linear l's weight rounded to bf16, [l.in, l.out].
  // The rounded copy of every matrix is made once, on first use, and kept (2 * matrices bytes, shared
  // by every model on these weights). Not sharded weights.
  const bf16_t* rounded(const DitLinear& l) const;
  // Columns [c0, c0 + ncols) of l's weight as the GEMMs read it, [in, ncols] with row stride l.out:
  // bf16 when stored in bf16 or when the f32 GEMMs run in bf16 (f32_gemm_compute(), ops/gemm.hpp:
  // the rounded copy), else f32. Through matrix() (so a sharded unit's window is current).
  ConstTensorView gemm_weight(const DitLinear& l, std::int64_t c0, std::int64_t ncols) const;
  // The bf16 weight the model's GEMMs read (the storage in bf16, else the rounded copy), columns
  // [c0, c0 + ncols) of Linear l, laid out by the active backend for dense_linear
  // (ops/backend.hpp pack_weight): made on first use and kept (about 2 bytes per element,
  // packed_bytes()), dropped when the weights change. Sharded block units: packed from the gather
  // window, one slice at a time (a projection's row chunks run back to back: one packing per
  // projection, no copy of a whole unit). Null where the backend keeps weights as stored, or where
  // the GEMMs read f32 (gemm_weight); the product is the same either way.
  const PackedWeight* packed(const DitLinear& l, std::int64_t c0, std::int64_t ncols) const;
  std::size_t packed_bytes() const;
  // Packing on (default) or off (packed() null: the same results, about 2 bytes per weight element
  // less, bf16 GEMMs that lay the weights out per call: slower). Off drops the packed copies.
  void set_packing(bool on);
  void begin_forward() const;
  void poll() const;
  DitGatherStats gather_stats() const { return stats_; }
  Communicator* gather_comm() const { return comm_.get(); }  // null when replicated

 private:
  // Writes tensor t from `produce(dst)` filling its [t.size] f32 values on the host (a Linear's as
  // [in, out]): vectors straight into place, matrices converted into their unit (its slice, sharded).
  template <typename F>
  void write(const DitLayout::Tensor& t, F&& produce);
  std::int64_t slice(int u) const;  // c_u: the elements of unit u this rank holds (u >= 1 sharded), else S_u
  void issue(int u) const;           // the all-gather of block unit u into the free window
  void finish_pending() const;       // waits for the gather in flight; its window then holds its unit

  DitConfig cfg_;
  DitLayout layout_;
  DType storage_;
  int shards_ = 1, rank_ = 0;
  std::unique_ptr<Communicator> comm_;  // the gathers' communicator (sharded)
  Buffer vectors_;                      // [layout().vectors] f32
  std::vector<Buffer> units_;           // [units] storage(): S_u (replicated, and unit 0) or c_u (sharded)
  // Gather state (sharded): two windows of P max c_u; the unit each holds (-1: none) and the
  // gather in flight into one of them.
  mutable Buffer windows_[2];
  mutable int window_unit_[2] = {-1, -1};
  mutable int current_ = 0;  // the window matrix() last returned
  mutable std::vector<WorkPtr> pending_;  // the gather in flight: its receives and sends
  mutable int pending_unit_ = -1, pending_window_ = 0;
  mutable DitGatherStats stats_;
  mutable std::vector<Buffer> rounded_;  // [units] bf16, made by rounded()
  // packed(): by (unit, offset, c0, ncols); null entries: the backend declined
  using PackedKey = std::array<std::int64_t, 4>;
  mutable std::map<PackedKey, std::unique_ptr<PackedWeight>> packed_;
  // sharded block units: the last slice packed from a window (its key; window -1: none)
  mutable PackedKey window_key_{};
  mutable int window_packed_of_ = -1;
  mutable std::unique_ptr<PackedWeight> window_packed_;
  bool packing_ = true;
  void drop_packed();   // the packed copies go
  void drop_derived();  // the weights change: the rounded and packed copies go
};

}  // namespace diffcp
