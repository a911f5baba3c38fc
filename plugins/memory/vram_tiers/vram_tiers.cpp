// vram_tiers: the seeds' table, device memory -> micro-batch (>= 20 GB: 128, 10-20 GB: 64,
// < 10 GB: 32), configurable. With a global batch configured it keeps it and chooses the
// accumulation; without one the tier's batch becomes the global batch, as the seeds do.
#include <loom/sdk/helpers.hpp>

#include <loom/sdk/sdk.hpp>

#include "../uneven_split.hpp"

#include <algorithm>
#include <cstdio>

namespace {

struct Tier {
  int64_t min_bytes;
  int64_t micro_batch;
};

/// Memory as the tiers are written, in decimal GB ("25.3 GB", "20 GB"): one unit on every line.
std::string gb_text(int64_t bytes) {
  char text[32];
  const double gb = static_cast<double>(bytes) / 1e9;  // ("24.0 GB", "1500.0 GB"; "0.000524 GB" under a tiny cap)
  std::snprintf(text, sizeof text, gb >= 1 ? "%.1f GB" : "%.3g GB", gb);
  return text;
}

std::vector<Tier> parse_tiers(const std::string& text) {
  std::vector<Tier> tiers;
  for (const auto& item : loom::sdk::parse_list(text)) {
    const auto colon = item.find(':');
    const auto bytes = colon == std::string::npos ? std::nullopt : loom::sdk::parse_bytes(item.substr(0, colon));
    const auto batch = colon == std::string::npos ? std::nullopt : loom::sdk::parse_int(item.substr(colon + 1));
    if (!bytes || !batch)
      throw loom::sdk::Error("memory.tiers: '" + item + "' is not MEMORY:BATCH (e.g. 20GB:128)");
    if (*batch < 1)
      throw loom::sdk::Error("memory.tiers: '" + item + "' gives micro-batch " + std::to_string(*batch) +
                             "; a micro-batch is at least 1");
    // ("30:128" was 30 bytes, a tier every device reaches, for a user who meant 30 GB)
    if (const std::string size = item.substr(0, colon); *bytes > 0 && size.find_first_of("kKmMgGtTbB") == std::string::npos)
      throw loom::sdk::Error("memory.tiers: '" + item + "' gives a size without its unit, which would be " +
                             std::to_string(*bytes) + " bytes; write the unit, e.g. " +
                             size.substr(size.find_first_not_of(' ')) + "GB:" + std::to_string(*batch) +
                             " (0 alone needs none)");
    if (constexpr int64_t kMaxBatch = int64_t{1} << 24; *batch > kMaxBatch)  // (as memory.max_batch: no batch of 10^8)
      throw loom::sdk::Error("memory.tiers: '" + item + "' gives micro-batch " + std::to_string(*batch) +
                             ", above 16777216; a micro-batch that large fits on no device");
    tiers.push_back({*bytes, *batch});
  }
  if (tiers.empty()) throw loom::sdk::Error("memory.tiers is empty; e.g. 20GB:128, 10GB:64, 0:32");
  std::sort(tiers.begin(), tiers.end(), [](const Tier& a, const Tier& b) { return a.min_bytes > b.min_bytes; });
  // (two batches for one size: which one a device of that size gets would depend on the order)
  for (size_t i = 1; i < tiers.size(); ++i)
    if (tiers[i].min_bytes == tiers[i - 1].min_bytes)
      throw loom::sdk::Error("memory.tiers gives " + gb_text(tiers[i].min_bytes) + " twice (micro-batch " +
                             std::to_string(tiers[i - 1].micro_batch) + " and " + std::to_string(tiers[i].micro_batch) +
                             "); give each size once");
  return tiers;
}

class VramTiers final : public loom::sdk::MemoryPolicy {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_string("tiers", "20GB:128, 10GB:64, 0:32",
                               "MEMORY:MICRO_BATCH pairs, in any order; the largest MEMORY the device's memory (or "
                               "its cap) reaches applies"),
  };

  explicit VramTiers(const loom::sdk::Options& o) : tiers_(parse_tiers(o.get_string("tiers"))) {}

  void plan(loom::sdk::PlanContext& context) override {
    const auto stats = context.memory->stats();
    const int64_t memory = stats.limit > 0 ? std::min(stats.limit, stats.total) : stats.total;
    int64_t tier_batch = 0, tier_bytes = 0;
    for (const auto& t : tiers_)
      if (memory >= t.min_bytes) {
        tier_batch = t.micro_batch;
        tier_bytes = t.min_bytes;
        break;
      }
    if (tier_batch == 0)  // (the smallest tier's batch was taken: a device below every tier is none of them)
      throw loom::sdk::Error(std::string("vram_tiers: ") + (memory < stats.total ? "the memory this run may use (its cap), " : "the device's memory, ") + gb_text(memory) +
                             ", reaches no tier of memory.tiers (the smallest needs " +
                             gb_text(tiers_.back().min_bytes) + "); add a tier for it, e.g. 0:" +
                             std::to_string(tiers_.back().micro_batch) + " for every smaller device");
    const int64_t world = context.plan.world_size;
    std::string bound;
    if (context.global_batch_given) {
      context.plan = loom::sdk::split_global_batch(context.global_batch, world, tier_batch);
      loom::memory::warn_uneven_split(context.plan, context.global_batch, tier_batch, "its memory tier allows {}");
    } else {
      // (the accumulation the run asked for stays: the global batch is tier_batch x it x world)
      // A tier's batch past what the data holds (128 of 18 samples) left no step in an epoch, blamed
      // on trainer.batch_size, which the user never set: the data bounds it, as auto_batch's search.
      const bool bounded = context.max_micro_batch > 0 && tier_batch > context.max_micro_batch;
      context.plan = loom::sdk::BatchPlan{bounded ? context.max_micro_batch : tier_batch, context.plan.accumulation, world};
      if (bounded) bound = " (its tier's " + std::to_string(tier_batch) + ", bounded by the training split's samples)";
    }
    description_ = "vram_tiers: device memory " + gb_text(memory) + " (tier " + gb_text(tier_bytes) + ") -> " +
                   loom::sdk::plan_text(context.plan) + bound;  // the host logs it with the plan
  }

  std::string describe() const override { return description_.empty() ? "vram_tiers" : description_; }

 private:
  std::vector<Tier> tiers_;
  std::string description_;
};

}  // namespace

LOOM_PLUGIN("vram_tiers", "1.0.0",
            loom::sdk::component<VramTiers>("vram_tiers", "micro-batch by device memory tier (the seeds' table)"))
