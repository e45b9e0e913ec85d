// `diffcp backends` and the global `--backend NAME` (DIFFCP_BACKEND): which backends this build
// registers, what runs on each, and the one every computing command runs on.
#include <cstdio>

#include "cli/commands.hpp"
#include "diffcp/comm/communicator.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/ops/backend.hpp"
#include "diffcp/testing/guard_backend.hpp"
#ifdef DIFFCP_HAVE_CUDA
#include "diffcp/cuda/backend.hpp"
#endif

namespace diffcp::cli {

namespace {
// The commands whose own layer (inputs, outputs, reports) touches device memory only through the
// backend: a device backend runs them (dit: every mode and option, tested on the guard device:
// cli_dit_backend_guard, test_dit_guard; attn and bench cp: testing/layer_run.hpp's buffers,
// cli_attn_backend_guard). sim computes on the host and runs on host-memory backends only.
constexpr const char* kDeviceCommands[] = {"train", "draft", "plan", "export", "dit", "attn", "bench"};

// The CLI registers the guard device too (testing/guard_backend.hpp): a check backend on host
// pages only its own ops may touch, so `--backend guard` shows that a command keeps its data on
// the device (slow; a host loop over device memory faults). And the CUDA backend, in a build
// with it, where this machine has a device.
void register_cli_backends() {
  (void)guard_backend();
  (void)guard_async_backend();
#ifdef DIFFCP_HAVE_CUDA
  if (cuda_device_present()) (void)cuda_backend();
#endif
}

const char* role(const Backend& b) {
  if (&b == &cpu_backend()) return "the default";
  if (is_guard(b))
    return static_cast<const GuardBackend&>(b).mode() == GuardBackend::Mode::stream
               ? "a check device for tests: CUDA's stream order (slow)"
               : "a check device for tests (slow)";
  return "a device backend";
}
}  // namespace

namespace {
bool g_print_key = false;  // backends --key
}  // namespace

void add_backends_command(CLI::App& app) {
  CLI::App* sub =
      app.add_subcommand("backends", "List the compute backends of this build and machine (select one with --backend)");
  sub->add_flag("--key", g_print_key,
                "print only what determines the selected backend's result bits (its kernel_key: the CPU's kernels' "
                "version and ISA, compiler, oneDNN version and paths): the bitwise golden's machine key");
}

Backend& select_backend(const std::string& name, const std::string& command) {
  register_cli_backends();
  Backend& b = find_backend(name);
  bool device_clean = false;
  std::string which;
  for (const char* c : kDeviceCommands) {
    device_clean = device_clean || command == c;
    which += std::string(which.empty() ? "" : ", ") + "`diffcp " + c + "`";
  }
  DIFFCP_CHECK(b.device() == Device::host || device_clean, "--backend ", name, ": `diffcp ", command,
               "` runs on host-memory backends only (cpu); a device backend runs ", which);
  set_backend(b);
  return b;
}

void print_host_syncs(const char* command, std::int64_t steps) {
  if (!is_guard(active_backend())) return;
  const GuardBackend& g = static_cast<const GuardBackend&>(active_backend());
  const GuardBackend::Counters c = g.counters();
  const std::int64_t staged = Communicator::staged_reads();
  std::printf("diffcp %s: %s device: %lld host syncs in %lld steps (%lld ops), %lld of them the communicators' staging "
              "of device memory (none with NCCL), %lld the computation's\n",
              command, g.name(), static_cast<long long>(c.host_syncs), static_cast<long long>(steps), static_cast<long long>(c.ops),
              static_cast<long long>(staged), static_cast<long long>(c.host_syncs - staged));
}

int run_backends(const std::string& selected) {
  register_cli_backends();
  Backend& chosen = find_backend(selected);  // an unknown --backend is an error here too
  if (g_print_key) {
    std::printf("%s\n", chosen.kernel_key().c_str());
    return 0;
  }
  for (Backend* b : registered_backends()) {
    std::printf("%-6s device %-6s %s%s\n", b->name(), device_name(b->device()), role(*b),
                selected == b->name() ? "; selected (--backend / DIFFCP_BACKEND)" : "");
    for (DType t : {DType::f32, DType::bf16}) std::printf("       %s: %s\n", dtype_name(t), b->describe(t).c_str());
    if (b == &cpu_backend()) {
      std::printf("       instruction sets compiled in (DIFFCP_CPU_ISA):");
      for (const CpuIsa& isa : cpu_isas()) std::printf(" %s%s", isa.name.c_str(), isa.supported ? "" : " (not on this CPU)");
      std::printf("\n");
    }
  }
#ifdef DIFFCP_HAVE_CUDA
  if (std::string why; !cuda_device_present(&why)) std::printf("cuda   built in; not available here: %s\n", why.c_str());
#else
  std::printf("cuda   not built in (configure with -DDIFFCP_CUDA=ON, where nvcc is found)\n");
#endif
  return 0;
}

}  // namespace diffcp::cli
