// The drafter's trainable state (parameters, gradients, AdamW moments) over the whole CP x DP
// mesh of W ranks, unit by unit (DrafterLayout::units: fc + fc_norm, each layer, final_norm).
//
//   none       every rank holds everything (16 B per parameter); gradients are all-reduced once
//              per step.
//   optimizer  ZeRO-1/2: parameters and gradients whole on every rank (8 B), moments sharded
//              (8 B / W); per step the gradients are reduce-scattered, every rank updates its
//              shard, and the parameters are all-gathered.
//   full       ZeRO-3 / FSDP: parameters, gradients and moments all sharded (16 B / W). A unit's
//              parameters are all-gathered when the forward or backward reaches it (the next
//              unit's gather is started at once, so it overlaps the current unit's compute) and
//              freed after; its gradients are reduce-scattered to their owners after its backward.
//
// Unit u of n_u parameters is split into W pieces of c_u = ceil(n_u / W) elements: rank r owns
// flat elements [begin_u + r c_u, begin_u + min((r + 1) c_u, n_u)) (the last pieces may be short
// or empty). optimizer's collectives run directly on the whole vectors (v-collectives of the
// pieces' true sizes, no padded copy); full's carry the pieces zero-padded to c_u. Elements moved per rank and
// step, with n = sum_u n_u the parameter count, N = sum_u W c_u (>= n) and A micro-batches per
// step (f32, 4 B each):
//   none:      all_reduce(n)                        sends 2 n (W-1)/W
//   optimizer: reduce_scatter_v + all_gather_v      sends 2 n (W-1)/W
//   full:      A x (2 all_gather + reduce_scatter)  sends 3 A N (W-1)/W
// (+ 16 (W-1)/W bytes for the gradient norm's all_reduce of one double in optimizer and full;
// shard_bytes_per_step below; the communicator counts the same bytes, as a mean over ranks.)
//
// Memory: every vector of the state lives in the active backend's memory (ops/buffer.hpp) and is
// touched only by ops and collectives (the mesh's device is set around each one); the host sees
// the state only through init / set_params / gather_params / save / load, unit by unit.
//
// Exactness: the update is elementwise, so every mode applies the same arithmetic to each
// element; only the gradient sums differ in order (MPI's all_reduce vs reduce_scatter, and per
// micro-batch in full mode), and the clip norm is summed per shard: equal to fp32 rounding.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "diffcp/comm/communicator.hpp"
#include "diffcp/drafter/checkpoint.hpp"
#include "diffcp/drafter/config.hpp"
#include "diffcp/drafter/optim.hpp"
#include "diffcp/ops/buffer.hpp"

namespace diffcp {

enum class ShardMode : std::uint8_t { none, optimizer, full };
ShardMode parse_shard_mode(const std::string& name);  // "none" | "optimizer" | "full"
// --shard as the trainer resolves it on `ranks` ranks (diffcp sim train predicts the same):
// "none" | "optimizer" | "full", or "auto" = full for the real shapes (real_shape: vocab > 4096)
// on more than one rank (their replicated state does not fit), optimizer for the synthetic ones
// (the parameters fit, so no per-layer gathers, but a replicated AdamW step would be the one phase
// that does not scale), none on one rank. Throws diffcp::Error naming a bad value.
ShardMode resolve_shard_mode(const std::string& name, bool real_shape, int ranks);
const char* shard_mode_name(ShardMode m);

// Bytes each rank sends per optimizer step for the model state (see the table above).
double shard_bytes_per_step(const DrafterLayout& layout, ShardMode m, int W, std::int64_t accum);

class ShardedState {
 public:
  // mesh: every rank that holds a share (the CP x DP world); unused for none.
  ShardedState(Communicator& mesh, const DrafterLayout& layout, ShardMode mode);
  ~ShardedState();
  ShardedState(const ShardedState&) = delete;
  ShardedState& operator=(const ShardedState&) = delete;

  ShardMode mode() const { return mode_; }
  const DrafterLayout& layout() const { return layout_; }
  int units() const { return static_cast<int>(layout_.units.size()); }

  // ---- one step: the model calls these per unit, forward in order 0 .. U-1, backward U-1 .. 0.
  const float* acquire(int u, bool backward);  // [n_u] the unit's parameters (device), until release(u)
  float* unit_grads(int u);                    // [n_u] (device) add this rank's gradient share into it
  void release(int u, bool backward);          // full: after backward, reduce-scatter the grads
  // The parameter gathers of one forward without the compute: a DP replica with no micro-batch
  // in a round (evaluation) still takes part in the mesh-wide gathers the others make.
  void gather_rounds_only();

  // ---- the optimizer step (collective over the mesh).
  void zero_grads();
  // Sums the gradient shares of the whole mesh to their owners, multiplies them by `scale`
  // (1 / the global loss weight) and returns the global L2 norm.
  double reduce_grads(double scale);
  // Multiplies the owned gradients by clip, applies AdamW (adam.begin_step() first) to the
  // owned parameters and, for optimizer, all-gathers the parameters.
  void apply(AdamW& adam, double lr_now, double clip);

  // ---- whole vectors.
  DeviceVector<float>& params();  // [total] (device) none | optimizer
  DeviceVector<float>& grads();   // [total] (device) none | optimizer
  std::vector<float> gather_params();  // [total] host copy on every rank (collective)
  // Initialises unit by unit in order: fill(u, out [n_u], host) writes unit u; each rank keeps
  // what it owns, so the full vector never exists.
  void init(const std::function<void(int, float*)>& fill);
  void set_params(std::span<const float> full);  // [total] host

  // ---- checkpoints (collective): the file holds full vectors, written by rank 0 unit by unit;
  // load reads this rank's slices, whatever W wrote the file.
  void save(const std::string& path, const nlohmann::json& meta);
  void load(CheckpointReader& ck);

  // Bytes this rank holds for the state now (parameters, gradients, moments, gathered units).
  std::int64_t resident_bytes() const;

 private:
  std::int64_t piece(int u) const;                 // c_u
  std::pair<std::int64_t, std::int64_t> owned(int u, int r) const;  // flat [lo, hi) of rank r's piece
  std::vector<std::size_t> piece_counts(int u) const;  // [W] the pieces' true sizes hi - lo
  float* own(const DeviceVector<float>& v, int u) const { return v.data() + own_off_[static_cast<std::size_t>(u)]; }
  void gather_unit(int u, bool async);  // full: into gathered_[u]
  // Rank 0 appends unit u of one array (resident: all of it is in `full` on every rank).
  void write_unit(CheckpointWriter* w, int u, const DeviceVector<float>* full, const DeviceVector<float>& sharded);
  Device device() const { return active_backend().device(); }

  Communicator& mesh_;
  DrafterLayout layout_;
  ShardMode mode_;
  int W_ = 1, r_ = 0;
  std::vector<std::int64_t> own_off_;  // [U + 1] offsets of the units' pieces in the owned vectors
  DeviceVector<float> params_, grads_;  // none | optimizer: [total]
  DeviceVector<float> p_own_, g_own_, m_, v_;  // owned pieces (none: m_, v_ are [total])
  struct Gathered {
    DeviceVector<float> buf;  // [W c_u]
    WorkPtr pending;
  };
  std::map<int, Gathered> gathered_;  // full: the units resident now
  DeviceVector<float> gscratch_;       // full: [W c_u] the gradient shares of the unit in backward
  double grad_norm_ = 0;
};

}  // namespace diffcp
