// A warning shared by the memory policies that re-split a global batch the user chose: one
// with few divisors (97, a prime) splits evenly only into micro-batches far below what fits,
// and the run becomes many small steps, many times slower, with only an info line to say so.
#pragma once

#include <loom/sdk/helpers.hpp>
#include <loom/sdk/log.hpp>

#include <algorithm>
#include <string>

namespace loom::memory {

/// Says so (the log names the policy) when `plan`, the even split of `global` over its ranks, has a micro-batch at most
/// half of `fits` (what the policy found would fit; `why` says it, with "{}" where the number goes: "{} fit",
/// "its memory tier allows {}"), and names the global batches near `global` that keep `fits`.
inline void warn_uneven_split(const loom::sdk::BatchPlan& plan, int64_t global, int64_t fits, const char* why) {
  const int64_t world = std::max<int64_t>(1, plan.world_size);
  fits = std::min(fits, global / world);
  if (plan.micro_batch * 2 > fits) return;
  const int64_t step = fits * world;
  const int64_t below = global / step * step, above = below + step;
  std::string reason = why;
  if (const size_t at_number = reason.find("{}"); at_number != std::string::npos) reason.replace(at_number, 2, std::to_string(fits));
  loom::sdk::log::warn("trainer.batch_size ", global, world > 1 ? " over " + std::to_string(world) + " ranks" : "",
                       " splits evenly only into micro-batches of ", plan.micro_batch, " (", plan.micro_batch, " x ",
                       plan.accumulation, " per step) where ", reason, ": each step runs as ", plan.accumulation,
                       " small ones. A batch that is a multiple of ", step, " (",
                       below > 0 ? std::to_string(below) + " or " : "", above, ") keeps micro-batch ", fits);
}

}  // namespace loom::memory
