// Which CPU kernels run (ops/backend.hpp: cpu_backend, cpu_isas): the widest ISA of the build that
// this CPU has, unless DIFFCP_CPU_ISA names another. Compiled once, for the baseline ISA.
#include <cstdlib>
#include <string>
#include <vector>

#include "diffcp/core/env.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/ops/backend.hpp"

// src/CMakeLists.txt defines DIFFCP_CPU_HAVE_<ISA> for each ISA compiled in.
namespace diffcp::cpu {
#if defined(DIFFCP_CPU_HAVE_NATIVE)
namespace native { Backend& backend(); }
#endif
#if defined(DIFFCP_CPU_HAVE_AVX512)
namespace avx512 { Backend& backend(); }
#endif
#if defined(DIFFCP_CPU_HAVE_AVX2)
namespace avx2 { Backend& backend(); }
#endif
#if defined(DIFFCP_CPU_HAVE_GENERIC)
namespace generic { Backend& backend(); }
#endif
}  // namespace diffcp::cpu

namespace diffcp {

namespace {

struct IsaEntry {
  const char* name;
  Backend& (*backend)();
  bool (*cpu_has)();
};

// Whether this CPU has every feature isa.hpp's `#pragma GCC target` enables for the ISA.
[[maybe_unused]] bool x86_has(bool avx512, bool avx2) {  // unused in a DIFFCP_NATIVE build
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (avx512 && !(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")))
    return false;
  if ((avx512 || avx2) && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return false;
  return true;
#else
  return !avx512 && !avx2;
#endif
}

// Widest first: the default is the first this CPU has.
const std::vector<IsaEntry>& entries() {
  static const std::vector<IsaEntry> e = {
#if defined(DIFFCP_CPU_HAVE_NATIVE)
      {"native", cpu::native::backend, [] { return true; }},  // built for this machine (-march=native)
#endif
#if defined(DIFFCP_CPU_HAVE_AVX512)
      {"avx512", cpu::avx512::backend, [] { return x86_has(true, true); }},
#endif
#if defined(DIFFCP_CPU_HAVE_AVX2)
      {"avx2", cpu::avx2::backend, [] { return x86_has(false, true); }},
#endif
#if defined(DIFFCP_CPU_HAVE_GENERIC)
      {"generic", cpu::generic::backend, [] { return x86_has(false, false); }},
#endif
  };
  return e;
}

std::string isa_list() {
  std::string s;
  for (const CpuIsa& i : cpu_isas()) s += (s.empty() ? "" : ", ") + i.name + (i.supported ? "" : " (not on this CPU)");
  return s;
}

}  // namespace

std::vector<CpuIsa> cpu_isas() {
  std::vector<CpuIsa> out;
  for (const IsaEntry& e : entries()) out.push_back({e.name, e.cpu_has()});
  return out;
}

Backend& cpu_backend(std::string_view isa) {
  for (const IsaEntry& e : entries()) {
    if (isa != e.name) continue;
    DIFFCP_CHECK(e.cpu_has(), "CPU kernels '", isa, "': this CPU lacks the instructions; compiled in: ", isa_list());
    return e.backend();
  }
  DIFFCP_FAIL("CPU kernels '", isa, "' are not compiled in; compiled in: ", isa_list());
}

Backend& cpu_backend() {
  static Backend& chosen = [&]() -> Backend& {
    if (const auto want = env_value(EnvKnob::cpu_isa)) {
      try {
        return cpu_backend(*want);
      } catch (const Error& e) {
        DIFFCP_FAIL("DIFFCP_CPU_ISA=", *want, ": ", e.what());
      }
    }
    for (const IsaEntry& e : entries())
      if (e.cpu_has()) return e.backend();
    DIFFCP_FAIL("no CPU kernels of this build run on this CPU; compiled in: ", isa_list());
  }();
  return chosen;
}

}  // namespace diffcp
