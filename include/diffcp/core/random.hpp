// Seeded test/demo data. Same seed -> same values on every rank and every run.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace diffcp {

// n values from N(0, stddev^2), deterministic in seed.
template <typename T = float>
std::vector<T> random_normal(std::size_t n, std::uint64_t seed, double stddev = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<T> out(n);
  for (auto& x : out) x = static_cast<T>(dist(rng));
  return out;
}

}  // namespace diffcp
