// Shared by the in-tree memory policies: splitting a global batch into micro-batches.
#pragma once

#include <loom/sdk/types.hpp>

#include <cstdint>

namespace loom::plugins {

/// The plan with the largest micro-batch <= `limit` that divides the per-rank share of the
/// global batch evenly (so the global batch stays what it is); accumulation follows.
inline sdk::BatchPlan split_global_batch(int64_t global, int64_t world, int64_t limit) {
  const int64_t per_rank = global / world;
  int64_t micro = std::max<int64_t>(1, std::min(limit, per_rank));
  while (per_rank % micro != 0) --micro;
  return sdk::BatchPlan{micro, per_rank / micro, world};
}

inline std::string plan_text(const sdk::BatchPlan& p) {
  return "micro-batch " + std::to_string(p.micro_batch) + " x accumulation " + std::to_string(p.accumulation) +
         (p.world_size > 1 ? " x " + std::to_string(p.world_size) + " ranks" : std::string()) + " = " +
         std::to_string(p.global());
}

/// "1.5 GiB", "96.0 MiB", "512.0 KiB": a size for log lines.
inline std::string bytes_text(int64_t bytes) {
  char b[32];
  const double v = static_cast<double>(bytes);
  if (bytes >= (1LL << 30)) std::snprintf(b, sizeof b, "%.1f GiB", v / (1LL << 30));
  else if (bytes >= (1LL << 20)) std::snprintf(b, sizeof b, "%.1f MiB", v / (1LL << 20));
  else std::snprintf(b, sizeof b, "%.1f KiB", v / 1024);
  return b;
}

}  // namespace loom::plugins
