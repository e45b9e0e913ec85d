// diffcp._core: a DFlash drafter from its folder, drafting over an mpi4py communicator, and its draft KV cache.
#include "bind/common.hpp"

#include "diffcp/comm/mpi_communicator.hpp"
#include "diffcp/drafter/draft.hpp"
#include "diffcp/drafter/draft_cache.hpp"
#include "diffcp/drafter/hf_format.hpp"
#include "diffcp/drafter/selector.hpp"

namespace diffcp::py_bind {

namespace {

// A DFlash drafter from a DFlash-format folder (import_dflash: ours or a released one), drafting one
// block at a time over an mpi4py communicator (draft_block: Split-KV over the context; COMM_SELF
// for one process). Collective like SplitKV: every rank of the communicator calls draft together.
class DrafterPy {
 public:
  DrafterPy(const std::string& dir, MPI_Fint comm, const std::string& comm_kind) : w_(import_dflash(dir)) {
    require_mpi("Drafter");
    comm_ = make_communicator(comm_kind, MPI_Comm_f2c(comm), "python");
  }

  py::dict config() const {
    const DrafterConfig& c = w_.config;
    py::dict d;
    d["hidden_size"] = c.hidden;
    d["num_hidden_layers"] = c.layers;
    d["num_attention_heads"] = c.n_q;
    d["num_key_value_heads"] = c.n_kv;
    d["head_dim"] = c.d_h;
    d["intermediate_size"] = c.ffn;
    d["vocab_size"] = c.vocab;
    d["block_size"] = c.block;
    d["mask_token_id"] = c.mask_token;
    d["target_layer_ids"] = c.target_layer_ids;
    d["num_target_layers"] = c.target_depth;
    std::vector<std::string> types = c.layer_types;
    if (types.empty()) types.assign(static_cast<std::size_t>(c.layers), "full_attention");
    d["layer_types"] = types;
    d["sliding_window"] = c.sliding_window > 0 ? py::object(py::int_(c.sliding_window)) : py::object(py::none());
    d["is_causal"] = c.is_causal ? py::object(py::bool_(*c.is_causal)) : py::object(py::none());
    d["architecture"] = c.has_conv() ? "DFlash2DraftModel" : "DFlashDraftModel";
    if (c.has_conv()) {
      d["conv_kernel_size"] = c.conv_taps;
      d["conv_group_size"] = c.conv_group_size;
      d["selector_rank"] = c.selector_rank;
      d["selector_top_k"] = c.selector_top_k;
    }
    return d;
  }

  //   target_hidden: [ctx, n_t*H] float32   noise: [b, H] float32, 2 <= b <= block_size
  //   -> [b, H] float32: the final RMSNorm's output of the b block rows
  py::array_t<float> draft(const Floats& target_hidden, const Floats& noise) {
    const DrafterConfig& c = w_.config;
    const std::int64_t T = c.target_layers * c.hidden;
    if (target_hidden.ndim() != 2 || target_hidden.shape(1) != T || target_hidden.shape(0) < 1)
      throw py::value_error("draft: target_hidden must be [ctx >= 1, n_t*H = " + std::to_string(T) + "]");
    if (noise.ndim() != 2 || noise.shape(1) != c.hidden || noise.shape(0) < 2 || noise.shape(0) > c.block)
      throw py::value_error("draft: noise_embedding must be [b, H = " + std::to_string(c.hidden) + "] with 2 <= b <= " +
                            "block_size = " + std::to_string(c.block));
    DrafterConfig cfg = c;  // a shorter block drafts with b rows (the layout does not depend on B)
    cfg.block = noise.shape(0);
    const std::int64_t ctx = target_hidden.shape(0);
    std::vector<float> out;
    {
      py::gil_scoped_release release;
      out = draft_block(*comm_, cfg, w_.params, {target_hidden.data(), static_cast<std::size_t>(target_hidden.size())},
                        ctx, {noise.data(), static_cast<std::size_t>(noise.size())});
    }
    py::array_t<float> r({static_cast<py::ssize_t>(cfg.block), static_cast<py::ssize_t>(c.hidden)});
    std::copy(out.begin(), out.end(), r.mutable_data());
    return r;
  }

  //   hidden: [n, H] float32 (the drafted rows 1 .. b-1)  logits: [n, V] float32 (the LM head's on them)
  //   -> (path int64 [n], candidates int64 [n, K], q float32 [n, K] or None when greedy)
  py::tuple propose(const Floats& hidden, const Floats& logits, std::int64_t anchor, double temperature, std::uint64_t seed) {
    const DrafterConfig& c = w_.config;
    if (hidden.ndim() != 2 || hidden.shape(1) != c.hidden || logits.ndim() != 2 || logits.shape(0) != hidden.shape(0) ||
        logits.shape(1) != c.vocab)
      throw py::value_error("propose: hidden must be [n, H = " + std::to_string(c.hidden) + "] and logits [n, V = " +
                            std::to_string(c.vocab) + "]");
    Proposal p;
    {
      py::gil_scoped_release release;
      p = diffcp::propose(c, w_.params, {hidden.data(), static_cast<std::size_t>(hidden.size())},
                          {logits.data(), static_cast<std::size_t>(logits.size())}, static_cast<std::int32_t>(anchor),
                          temperature, seed);
    }
    const py::ssize_t n = hidden.shape(0), K = c.selector_top_k;
    py::array_t<std::int64_t> path(n), cand({n, K});
    std::copy(p.path.begin(), p.path.end(), path.mutable_data());
    std::copy(p.candidates.begin(), p.candidates.end(), cand.mutable_data());
    py::object q = py::none();
    if (!p.q.empty()) {
      py::array_t<float> qa({n, K});
      std::copy(p.q.begin(), p.q.end(), qa.mutable_data());
      q = qa;
    }
    return py::make_tuple(path, cand, q);
  }

  const DrafterWeights& weights() const { return w_; }
  Communicator& comm() { return *comm_; }

 private:
  DrafterWeights w_;
  std::unique_ptr<Communicator> comm_;
};

// The draft KV cache of one generation (drafter/draft_cache.hpp): append the target's hidden
// states of the positions it accepts, draft a block from the cached K/V. Collective over the
// drafter's communicator, as DrafterPy::draft. Keeps its drafter alive (keep_alive below).
class DraftCachePy {
 public:
  explicit DraftCachePy(DrafterPy& d) : cache_(d.comm(), d.weights().config, d.weights().params), cfg_(d.weights().config) {}

  //   target_hidden: [n >= 1, n_t*H] float32, positions [len, len + n)
  void append(const Floats& target_hidden) {
    const std::int64_t T = cfg_.target_layers * cfg_.hidden;
    if (target_hidden.ndim() != 2 || target_hidden.shape(1) != T || target_hidden.shape(0) < 1)
      throw py::value_error("append: target_hidden must be [n >= 1, n_t*H = " + std::to_string(T) + "]");
    py::gil_scoped_release release;
    cache_.append({target_hidden.data(), static_cast<std::size_t>(target_hidden.size())});
  }

  //   noise: [b, H] float32, 1 <= b <= block_size -> [b, H] float32 (as DrafterPy::draft)
  py::array_t<float> draft(const Floats& noise) {
    if (noise.ndim() != 2 || noise.shape(1) != cfg_.hidden || noise.shape(0) < 1 || noise.shape(0) > cfg_.block)
      throw py::value_error("draft: noise_embedding must be [b, H = " + std::to_string(cfg_.hidden) +
                            "] with 1 <= b <= block_size = " + std::to_string(cfg_.block));
    if (cache_.length() < 1) throw py::value_error("draft: the cache holds no context yet (append the prompt's first)");
    std::vector<float> out;
    {
      py::gil_scoped_release release;
      out = cache_.draft({noise.data(), static_cast<std::size_t>(noise.size())});
    }
    py::array_t<float> r({static_cast<py::ssize_t>(noise.shape(0)), static_cast<py::ssize_t>(cfg_.hidden)});
    std::copy(out.begin(), out.end(), r.mutable_data());
    return r;
  }

  std::int64_t length() const { return cache_.length(); }
  std::int64_t bytes() const { return cache_.bytes(); }

 private:
  DraftCache cache_;
  DrafterConfig cfg_;
};

// A diffusers transformer folder's DiT, run across the ranks of `comm` (diffcp.diffusers): the
// weights loaded once (bf16 or f32, replicated or sharded), one exchange and model per run shape
// and pass (V-Major keeps a cache per pass, as diffusers' cache_context does; so does the step
// cache, restarted at step 0). cfg_parallel: the ranks split into two halves (dit/run.hpp
// CfgGroups), the weights sharded within each half, and velocity_pair runs a CFG pair's two passes

}  // namespace

void bind_drafter(py::module_& m) {
  py::class_<DrafterPy>(m, "Drafter")
      .def(py::init<const std::string&, MPI_Fint, const std::string&>(), py::arg("dir"), py::arg("comm_f"),
           py::arg("comm_kind") = "mpi")
      .def("config", &DrafterPy::config)
      .def("draft", &DrafterPy::draft, py::arg("target_hidden"), py::arg("noise_embedding"))
      .def("propose", &DrafterPy::propose, py::arg("hidden"), py::arg("logits"), py::arg("anchor"), py::arg("temperature"),
           py::arg("seed"))
      .def("new_cache", [](DrafterPy& d) { return std::make_unique<DraftCachePy>(d); }, py::keep_alive<0, 1>());
  py::class_<DraftCachePy>(m, "DraftCache")
      .def("append", &DraftCachePy::append, py::arg("target_hidden"))
      .def("draft", &DraftCachePy::draft, py::arg("noise_embedding"))
      .def("__len__", &DraftCachePy::length)
      .def_property_readonly("bytes", &DraftCachePy::bytes);
}

}  // namespace diffcp::py_bind
