// `diffcp sim dit`: the predicted denoising-step time of the FLUX-style DiT (dit/model.cpp) under
// Ulysses sequence parallelism on P ranks of a profile's machine (sim/machine.hpp), per attention
// exchange mode (dit/exchange.hpp: flat, tapa, vfirst, cocodiff).
//
// Legend: b images, T text tokens, N_img image tokens, N = T + N_img tokens per image (Wan: N = N_img,
//         its T text rows cross-attended on every rank, no exchange), P ranks,
//         n_p = N / P tokens per image on a rank, n = b n_p rows per rank (M_p), H = n_h d_h,
//         h_p = n_h / P heads per rank, hd = h_p d_h, M MLP width, C_in latent channels per token,
//         L TAPA's group (default: the ranks of a node), G = P / L groups, D = double blocks,
//         S = single blocks, D + S attention exchanges per step, f = 4 bytes (f32).
//
// Compute per rank and step (every rank alike: the tokens are sharded evenly):
//   - every GEMM of DitModel::velocity, double_block, single_block by its shape (the machine's
//     roofline gemm_ms(M, K, N)): modulation GEMVs [1, H] x [H, 6H | 3H | 2H], each stream's qkv
//     [rows, H] x [H, 3H] (as v [H, H] then q|k [H, 2H], the order V-First needs), proj [H, H],
//     MLP [H, M] and [M, H]; single blocks' linear1 [n, H] x [H, 3H + M] (v, q|k, m) and linear2
//     [n, H + M] x [H + M, H]; the embeddings (time / vector / guidance MLPs, img_in, txt_in) and
//     the final layer;
//   - attention: h_p heads over all b N queries x N keys of each image (dense: every token sees
//     every token), 4 d_h FLOPs per pair per head (attn_fwd_ms);
//   - elementwise (elementwise_ms over the bytes read + written): LayerNorm + modulate (8 B per
//     element), QK RMSNorm + RoPE (8 B over the 2H q|k columns), GELU (8 B), gated residual adds
//     (12 B), the exchange's pack / unpack copies (8 B over q|k|v and o), the Euler update.
// Communication per attention exchange (two all-to-alls: q|k|v, then o; per destination a block
// of n rows x 3 hd, resp. hd, f32):
//   flat      machine.uniform_ms of each all-to-all's (P - 1) blocks; nothing overlaps.
//   tapa      phase 1 (inside the group of L consecutive ranks, G blocks per mate), then phase 2
//             (across groups: G - 1 peers, L blocks each), one after the other (comm/tapa.hpp); each
//             phase is alpha-beta with the peers on this rank's node at the intra rate and the
//             others over the node's uplink shared by its ranks (the machine's rule).
//   vfirst    TAPA with V's phase 1 (its own message, n x hd per block) posted after the v
//             projection and hidden behind the q|k projection + QK norm + RoPE (single blocks:
//             and the MLP-input part of linear1, which project() polls through); the remainder
//             and q|k's phase 1, V's and q|k's phase 2, o's TAPA are exposed.
//   cocodiff  V-First on full steps; on selective steps (cache ratio r of CacheSchedule, k = n -
//             floor(r n) active rows): V phase 1 (full, hidden as V-First's), the L1 partials
//             all-gathered in the group, the active lists all-gathered across groups, q|k phase 1
//             and q|k|v phase 2 of the active rows only, o back at full size; plus the L1 and the
//             cache updates as elementwise work. These pieces' bytes are checked to add up to
//             vmajor_predicted_bytes (dit/vmajor.hpp: the closed form the tests assert), the only
//             source of the reported bytes.
// Group bytes: flat's per rank: (L - 1) blocks to group mates, (P - L) across; TAPA's from
// vmajor_predicted_bytes(vmajor = false). Note: both send the same (P - L) blocks across groups;
// TAPA forwards (L - 1)/L of the data inside the group and needs L x fewer inter-group messages.
// Serving features (SimDitOptions): cfg doubles a step's compute, communication and bytes (two
// passes one after the other); cfg_parallel runs one pass per half (the model above on P/2 ranks,
// L capped at P/2) and adds the velocity pair's all-gather (b I_p C_in f32 to the rank P/2 away:
// across nodes when any rank's partner is on another node); a cached step (First-Block Cache) runs the per-step
// work, the first block and its exchange, and the cache's elementwise work (56 B per image-row
// element: copies, the residual update, two L1 sums) instead of every block. The fp8 wire moves
// q|k|v and o (and V-Major's selective rows) at 1 + 4 / d_h bytes per element (e4m3 and one f32
// scale per (token, head): WireFormat) and adds the codec's elementwise work (encode 5 B, decode 5 B
// per element, both directions of both all-to-alls); the L1 partials and index lists stay as they are.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "diffcp/dit/cache_schedule.hpp"
#include "diffcp/dit/config.hpp"
#include "diffcp/dit/wire.hpp"
#include "diffcp/sim/machine.hpp"

namespace diffcp {

struct SimDitOptions {
  std::vector<std::string> modes;  // flat | tapa | vfirst | cocodiff (dit/exchange.hpp names)
  int group_size = 0;              // L; 0: the machine's ranks per node (capped at P)
  int steps = 50;                  // denoising steps
  CacheSchedule schedule;          // cocodiff's (dit/cache_schedule.hpp)
  // The serving features (issue #52, docs/dit.md):
  bool cfg = false;            // classifier-free guidance: two passes a step (a negative prompt of T tokens)
  bool cfg_parallel = false;   // the two passes at once, one per half of the ranks (needs cfg and an even P)
  Wire wire = Wire::compute;   // the exchanges' payload (dit/wire.hpp): f32, or fp8 (1 + 4 / d_h bytes per element)
  double cached_fraction = 0;  // First-Block Cache: this fraction of the steps after the first runs only the
                               // first block (a run's steps_cached / (steps - 1)); spread evenly over the run
};

// One denoising step of one mode, per rank.
struct SimDitStep {
  double step_ms = 0, compute_ms = 0, exposed_comm_ms = 0, comm_ms = 0;
  std::uint64_t bytes_intra = 0, bytes_inter = 0;  // sent inside / across TAPA groups
  std::int64_t active = 0;  // rows per rank each exchange moves across (n on full steps)
};

struct SimDitResult {
  std::string mode, reason;  // reason: why the configuration cannot run (empty: supported)
  int P = 1, L = 1, steps = 0;
  double step_ms = 0;           // median over the steps
  double total_ms = 0;          // sum over the steps
  double compute_ms = 0, exposed_comm_ms = 0, comm_ms = 0;  // means per step
  double bytes_intra_group = 0, bytes_inter_group = 0;      // per rank per step, mean over the steps
  std::uint64_t bytes_intra_total = 0, bytes_inter_total = 0;  // per rank, all steps
  double messages_inter_group = 0;  // per rank per step: point-to-point messages across groups
  std::vector<SimDitStep> per_step;  // [steps]
  bool supported() const { return reason.empty(); }
};

// Throws diffcp::Error for an invalid machine, config, schedule, steps < 1 or an unknown mode;
// a shape the modes cannot serve (P not dividing the heads or the tokens, L not dividing P) gives
// rows with `reason` set.
std::vector<SimDitResult> simulate_dit(const SimMachine& m, const DitConfig& cfg, const DitShape& shape,
                                       const SimDitOptions& opt);

}  // namespace diffcp
