// The optimizer's elementwise step as a backend op (the drafter's AdamW, drafter/optim.hpp, walks
// the decayed and undecayed spans and calls it per span). CPU: src/cpu/optim.cpp.
#pragma once

#include <cstdint>

#include "diffcp/ops/backend.hpp"

namespace diffcp {

// p, m, v: [n] updated in place from g: [n] with the constants of AdamWStepArgs (ops/backend.hpp).
void adamw_step(float* p, const float* g, float* m, float* v, std::int64_t n, const AdamWStepArgs& args);

}  // namespace diffcp
