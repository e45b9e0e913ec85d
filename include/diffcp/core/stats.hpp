// Summary statistics of timings, one definition for the library, the CLI and the benchmarks.
#pragma once

#include <vector>

namespace diffcp {

// The median: the middle value, the mean of the two middle ones for an even count (what RESULTS
// quotes and `diffcp sim` predicts). Throws diffcp::Error for an empty sample.
double median(std::vector<double> v);

}  // namespace diffcp
