// fraction_cap: caps this process's device memory at a fraction of the device (the seeds'
// --memory_fraction). On CUDA through the caching allocator's memory fraction; on CPU through
// Loom's budget allocator (of the --device-memory-limit, or of the machine's memory). Past the
// cap an allocation fails with c10::OutOfMemoryError, which oom_recovery can handle, instead of
// spilling into slow shared memory (Windows/WDDM) or starving other processes.
#include <loom/sdk/helpers.hpp>

#include <loom/sdk/sdk.hpp>

#include <algorithm>
#include <cstdio>

namespace {

class FractionCap final : public loom::sdk::MemoryPolicy {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_float("fraction", "0.9", "share of the device's memory this run may use (0 < f <= 1)", "0.01..1"),
  };

  explicit FractionCap(const loom::sdk::Options& o) : fraction_(o.get_float("fraction")) {
    if (!(fraction_ > 0 && fraction_ <= 1))
      throw loom::sdk::Error("memory.fraction = " + std::to_string(fraction_) + ": expected a number in (0, 1], e.g. 0.8");
  }

  void setup(loom::sdk::DeviceMemory& memory) override {
    // A fraction of what the run may use: the device, or a limit set before (--device-memory-limit),
    // the same on CUDA as on the CPU.
    const auto stats = memory.stats();
    total_ = stats.limit > 0 ? std::min(stats.limit, stats.total) : stats.total;
    cap_ = static_cast<int64_t>(fraction_ * static_cast<double>(total_));
    memory.set_limit(cap_);
  }

  std::string describe() const override {
    char line[256];
    std::snprintf(line, sizeof line, "fraction_cap: %.0f %% of %s = %s; %s left for the system and other processes",
                  100 * fraction_, loom::sdk::format_bytes(total_).c_str(), loom::sdk::format_bytes(cap_).c_str(),
                  loom::sdk::format_bytes(total_ - cap_).c_str());
    return line;
  }

 private:
  double fraction_;
  int64_t total_ = 0, cap_ = 0;
};

}  // namespace

LOOM_PLUGIN("fraction_cap", "1.0.0",
            loom::sdk::component<FractionCap>("fraction_cap", "cap device memory at a fraction of the device"))
