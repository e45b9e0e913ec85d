// diffcp._core: a diffusers transformer folder's DiT as a library session (dit/session.hpp) over an
// mpi4py communicator, what diffcp.diffusers calls once per transformer call.
#include "bind/common.hpp"

#include <memory>
#include <optional>

#include "diffcp/comm/mpi_communicator.hpp"
#include "diffcp/dit/diffusers.hpp"
#include "diffcp/dit/session.hpp"

namespace diffcp::py_bind {

namespace {

// The session's options from Python's keywords (diffcp.diffusers.parallelize); its errors name them.
// The weights' dtype "auto" is resolved by the caller (the torch parameters' dtype).
class DitPy {
 public:
  DitPy(const std::string& folder, MPI_Fint comm, const DitRunOptions& options, const std::string& comm_kind) {
    require_mpi("Dit");
    comm_ = make_communicator(comm_kind, MPI_Comm_f2c(comm), "python");
    const DiffusersTransformer t = open_diffusers_transformer(folder);
    const SafeTensorsSet ck(t.weights);
    DitRunConfig run(options, t.config, comm_->size(), comm_->rank(), &ck, DitFileFormat::diffusers);
    py::gil_scoped_release release;
    session_ = std::make_unique<DitSession>(*comm_, std::move(run), &ck, DitFileFormat::diffusers);
  }

  py::dict config() const {
    const DitConfig& c = session_->model();
    const DitWeights& w = session_->weights();
    py::dict d;
    d["family"] = dit_family_name(c.family);
    d["in_channels"] = c.in_channels();
    d["text_dim"] = c.text_dim;
    d["pooled_dim"] = c.pooled_dim;
    d["heads"] = c.heads;
    d["guidance_embed"] = c.guidance_embed;
    d["latent_channels"] = c.latent_channels;
    d["condition_channels"] = c.condition_channels;  // Wan I2V: the input's channels after the latent's
    d["image_dim"] = c.image_dim;                    // Wan I2V: CLIP's features (0: no image context)
    d["image_pos_tokens"] = c.image_pos_tokens;      // FLF2V's position table (0: none)
    d["weights_dtype"] = dtype_name(w.storage());
    d["shard_weights"] = w.sharded();
    d["weights_bytes_per_rank"] = w.bytes();
    d["P"] = comm_->size();
    d["ulysses_degree"] = session_->run().deg.ulysses;
    d["ring_degree"] = session_->run().deg.ring;
    d["cfg_parallel"] = session_->cfg_groups() != nullptr;
    d["step_cache"] = session_->run().step_cache.name();
    return d;
  }

  py::dict step_cache_stats() const {
    py::dict d;
    for (const auto& [key, st] : session_->step_cache_stats()) {
      py::dict e;
      e["computed"] = st.computed;
      e["cached"] = st.cached;
      e["rel_l1"] = st.rel_l1;
      d[py::str(key)] = e;
    }
    return d;
  }

  // This rank's exchange counters over every velocity call so far.
  py::dict exchange_stats() const {
    const ExchangeStats s = session_->exchange_stats();
    py::dict d;
    d["bytes_intra"] = s.bytes_intra;
    d["bytes_inter"] = s.bytes_inter;
    d["messages"] = s.messages;
    d["comm_ms"] = s.comm_ms;
    return d;
  }

  //   x: [b, N_img, C_in] every rank's full latent tokens (the same on every rank), N_img = frames (height/16) (width/16)
  //      (a video's tokens frame-major; frames 1 for an image; Wan I2V: [b, N_img, C_in + C_cond])
  //   txt: [T, text_dim] the prompt's rows (shared by the b images)   pooled: [pooled_dim] (empty without one;
  //      Wan I2V: the image context [I_ctx, image_dim])
  //   -> [b, N_img, C_in] the velocity, gathered on every rank. Collective over comm.
  py::array_t<float> velocity(const Floats& x, std::int64_t height, std::int64_t width, const Floats& txt,
                              const Floats& pooled, double t, double guidance, int pass, int step, int steps,
                              std::int64_t frames, const std::vector<double>& token_t) {
    const DitShape shape = shape_of(x, height, width, txt, pooled, frames);
    std::vector<float> out;
    {
      py::gil_scoped_release release;
      out = session_->velocity(pass, shape, host(x), host(txt), host(pooled), t, guidance, step, steps, token_t);
    }
    py::array_t<float> v({x.shape(0), x.shape(1), static_cast<py::ssize_t>(session_->model().in_channels())});
    std::copy(out.begin(), out.end(), v.mutable_data());
    return v;
  }

  // cfg_parallel: a pair of passes q = 0, 1 (x_q [b, N_img, C_in], txt_q [T_q, text_dim], pooled_q) at
  // once, pass q on half q -> [2, b, N_img, C_in] on every rank. Collective over comm. `pair_index`:
  // the pair's index within the step (each pair of a step has its own exchanges and caches).
  py::array_t<float> velocity_pair(const Floats& x0, const Floats& txt0, const Floats& pooled0, const Floats& x1,
                                   const Floats& txt1, const Floats& pooled1, std::int64_t height, std::int64_t width,
                                   double t, double guidance, int step, int steps, int pair_index, std::int64_t frames,
                                   const std::vector<double>& token_t) {
    const DitShape s0 = shape_of(x0, height, width, txt0, pooled0, frames), s1 = shape_of(x1, height, width, txt1, pooled1, frames);
    const std::vector<float> in[2][3] = {{host(x0), host(txt0), host(pooled0)}, {host(x1), host(txt1), host(pooled1)}};
    std::array<std::vector<float>, 2> v;
    {
      py::gil_scoped_release release;
      v = session_->velocity_pair(pair_index, s0, s1, {&in[0][0], &in[0][1], &in[0][2]}, {&in[1][0], &in[1][1], &in[1][2]}, t,
                                  guidance, step, steps, token_t);
    }
    py::array_t<float> out({py::ssize_t{2}, x0.shape(0), x0.shape(1), static_cast<py::ssize_t>(session_->model().in_channels())});
    std::copy(v[0].begin(), v[0].end(), out.mutable_data());
    std::copy(v[1].begin(), v[1].end(), out.mutable_data() + v[0].size());
    return out;
  }

 private:
  static std::vector<float> host(const Floats& a) { return {a.data(), a.data() + a.size()}; }
  static std::vector<std::int64_t> dims(const Floats& a) { return {a.shape(), a.shape() + a.ndim()}; }
  DitShape shape_of(const Floats& x, std::int64_t height, std::int64_t width, const Floats& txt, const Floats& pooled,
                    std::int64_t frames) const {
    return session_->velocity_shape(dims(x), height, width, dims(txt), dims(pooled), frames);
  }

  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<DitSession> session_;
};

}  // namespace

void bind_dit(py::module_& m) {
  py::class_<DitPy>(m, "Dit")
      .def(py::init([](const std::string& folder, MPI_Fint comm, const std::string& mode, std::optional<int> ulysses_degree,
                       std::optional<int> ring_degree, int group_size, const std::string& weights_dtype, bool shard_weights,
                       const std::string& dtype, double cache_ratio, bool cfg_parallel, const std::string& step_cache,
                       const std::string& wire, const std::string& comm_kind) {
             DitRunOptions o;
             o.mode = mode;
             o.ulysses_degree = ulysses_degree;
             o.ring_degree = ring_degree;
             o.group_size = group_size;
             o.weights_dtype = weights_dtype;
             o.shard_weights = shard_weights;
             o.dtype = dtype;
             o.cache_ratio = cache_ratio;
             o.cfg_parallel = cfg_parallel;
             o.step_cache = step_cache;
             o.wire = wire;
             return std::make_unique<DitPy>(folder, comm, o, comm_kind);
           }),
           py::arg("folder"), py::arg("comm_f"), py::arg("mode"), py::arg("ulysses_degree"), py::arg("ring_degree"),
           py::arg("group_size"), py::arg("weights_dtype"), py::arg("shard_weights"), py::arg("dtype"), py::arg("cache_ratio"),
           py::arg("cfg_parallel") = false, py::arg("step_cache") = "none", py::arg("wire") = "auto",
           py::arg("comm_kind") = "mpi")
      .def("config", &DitPy::config)
      .def("step_cache_stats", &DitPy::step_cache_stats)
      .def("exchange_stats", &DitPy::exchange_stats)
      .def("velocity_pair", &DitPy::velocity_pair, py::arg("x0"), py::arg("txt0"), py::arg("pooled0"), py::arg("x1"),
           py::arg("txt1"), py::arg("pooled1"), py::arg("height"), py::arg("width"), py::arg("t"), py::arg("guidance"),
           py::arg("step"), py::arg("steps"), py::arg("pair_index") = 0, py::arg("frames") = 1,
           py::arg("token_t") = std::vector<double>{})
      .def("velocity", &DitPy::velocity, py::arg("x"), py::arg("height"), py::arg("width"), py::arg("txt"), py::arg("pooled"),
           py::arg("t"), py::arg("guidance"), py::arg("pass_index"), py::arg("step"), py::arg("steps"), py::arg("frames") = 1,
           py::arg("token_t") = std::vector<double>{});
}

}  // namespace diffcp::py_bind
