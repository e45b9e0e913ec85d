// The optimizer's elementwise step as a backend op (the drafter's AdamW, drafter/optim.hpp, walks
// the decayed and undecayed spans and calls it per span). CPU: src/cpu/optim.cpp.
#pragma once

#include <cstdint>

#include "diffcp/ops/backend.hpp"

namespace diffcp {

// p, m, v: [n] updated in place from g: [n] with the constants of AdamWStepArgs (ops/backend.hpp).
void adamw_step(float* p, const float* g, float* m, float* v, std::int64_t n, const AdamWStepArgs& args);
// x: [n] in place = float(double(x) * scale); returns sum x^2 of the new x in double, index order.
double scale_sumsq(float* x, std::int64_t n, double scale);

}  // namespace diffcp
