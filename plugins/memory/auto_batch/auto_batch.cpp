// auto_batch: finds the largest micro-batch that fits under the device's cap, by measurement.
//
// Note [auto_batch search]
// Peak memory is close to linear in the micro-batch: peak(b) = a + k*b, where a holds the
// parameters, gradients, optimizer state and workspaces, and k the activations of one sample.
// Two probes (b = 2 and 8) fit a and k; the largest batch the fit allows under the cap is
// b_max = (cap - a) / k. The policy aims at b_max * (1 - margin/2): within `margin` of the
// largest batch (b * (1 + margin) does not fit), with headroom for what probes do not see
// (fragmentation, allocator rounding). A probe verifies the aim. Per-sample memory is not quite
// constant (on CPU it falls from ~460 to ~350 KiB between b = 8 and 512 for the default model),
// so after a verified aim the line is refitted through the two largest batches that fit and the
// aim recomputed; a failed aim bounds the search from above. It stops when the aim no longer
// grows, at most 6 probes in all. The answer is cached per (device, cap, configuration) in
// $LOOM_CACHE/auto_batch.tsv.
// Probes run forward and backward only, restore the RNG and zero the gradients: weights,
// optimizer and data order are as if no search had happened.
#include <loom/sdk/files.hpp>
#include <loom/sdk/helpers.hpp>

#include <loom/sdk/sdk.hpp>

#include "../uneven_split.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <unistd.h>

namespace fs = std::filesystem;

namespace {

constexpr int kMaxProbes = 6;

fs::path default_cache() {
  if (const char* c = std::getenv("LOOM_CACHE"); c != nullptr && *c != '\0')  // (empty: as unset)
    return fs::path(c) / "auto_batch.tsv";
  if (const char* h = std::getenv("HOME")) return fs::path(h) / ".cache" / "loom" / "auto_batch.tsv";
  return {};
}

/// One line of the cache: "key<TAB>micro-batch" (a key holds '|'s before its tab, the micro-batch is
/// positive); anything else is no answer.
std::optional<std::pair<std::string, int64_t>> parse_answer(std::string line) {
  if (!line.empty() && line.back() == '\r') line.pop_back();
  const auto tab = line.rfind('\t');
  const auto v = tab == std::string::npos ? std::nullopt : loom::sdk::parse_int(line.substr(tab + 1));
  if (!v || *v <= 0 || line.find('|') > tab) return std::nullopt;
  return std::pair{line.substr(0, tab), *v};
}

/// The cache: one "key<TAB>micro-batch" line per answer. Absent: empty. Anything but a regular
/// file of at most 16 MiB (a FIFO would block, /dev/zero never end) throws loom::sdk::Error, and
/// so does a file with lines none of which is an answer: memory.cache pointed at a user's file (a
/// config file) replaced it with the cache in silence. Other lines of a cache (one cut by a full
/// disk under an older Loom) are skipped, and go at its next write.
std::map<std::string, int64_t> read_cache(const fs::path& path) {
  std::map<std::string, int64_t> out;
  std::error_code ec;
  if (!fs::exists(path, ec)) return out;  // (a link to nothing too: the answer written replaces the link)
  std::istringstream in(loom::sdk::read_regular_file(path, int64_t{16} << 20, "auto_batch: the answer cache ", "absent"));
  std::string line;
  int64_t other = 0, first_other = 0;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.empty() || line == "\r") continue;
    if (auto answer = parse_answer(line)) out.insert_or_assign(std::move(answer->first), answer->second);
    else if (other++ == 0) first_other = number;
  }
  if (out.empty() && other > 0)
    throw loom::sdk::Error("auto_batch: " + path.string() + ":" + std::to_string(first_other) +
                           " is no answer of the cache (a key, a tab, a micro-batch), nor is any line of it: the file is "
                           "not auto_batch's cache, and Loom does not replace it");
  return out;
}

/// Replaces the cache whole or not at all (a full disk or a read-only folder leaves it as it was,
/// and throws loom::sdk::Error saying why: it had been emptied in silence).
/// A cache that would pass 8 MiB, half of what read_cache reads (it grew past that, and every run
/// then warned of its own file and cached nothing), keeps `keep`'s answer and others up to 4 MiB;
/// those dropped are searched again when asked.
void write_cache(const fs::path& path, const std::map<std::string, int64_t>& entries, const std::string& keep = "") {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  const auto line = [](const std::string& k, int64_t v) { return k + "\t" + std::to_string(v) + "\n"; };
  std::string text;
  for (const auto& [k, v] : entries) text += line(k, v);
  if (text.size() > (size_t{8} << 20)) {
    text.clear();
    if (const auto it = entries.find(keep); it != entries.end()) text = line(it->first, it->second);
    size_t dropped = 0;
    for (const auto& [k, v] : entries)
      if (k != keep && text.size() + k.size() + 22 <= (size_t{4} << 20)) text += line(k, v);
      else if (k != keep) ++dropped;
    loom::sdk::log::info("auto_batch: the answer cache ", path.string(), " would pass 8 MiB: ", dropped,
                         " answers of other configurations are dropped from it (each is searched again when asked)");
  }
  loom::sdk::write_file_durably(path, text);
}

/// A regular file over the 16 MiB read_cache reads whose first line is an answer: a cache an older
/// Loom let grow past that (write_cache now keeps it under 8 MiB). Renamed to `<path>.too-large`,
/// said, and true: the cache starts again. Anything else is left as it is.
bool set_aside_if_grown(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec) || fs::file_size(path, ec) <= (uintmax_t{16} << 20) || ec) return false;
  std::ifstream in(path, std::ios::binary);
  std::string line;
  if (!std::getline(in, line) || line.size() > 65536 || !parse_answer(line)) return false;
  const fs::path aside = path.string() + ".too-large";
  fs::rename(path, aside, ec);
  if (ec) return false;
  loom::sdk::log::warn("auto_batch: the answer cache ", path.string(), " had grown past the 16 MiB Loom reads (an older Loom "
                       "let it): set aside as ", aside.string(), " (remove it), and the cache starts again");
  return true;
}

class AutoBatch final : public loom::sdk::MemoryPolicy {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_float("margin", "0.05",
                              "aim at (1 - margin/2) of the largest batch that fits; b x (1 + margin) does not fit", "0..0.5"),
      loom::sdk::option_int("max_batch", "4096", "never choose a micro-batch above this", "1..16777216"),
      loom::sdk::option_string("cache", "", "answer cache (default $LOOM_CACHE/auto_batch.tsv); 'off' disables it"),
  };

  explicit AutoBatch(const loom::sdk::Options& o)
      : margin_(o.get_float("margin")), max_batch_(o.get_int("max_batch")), cache_(o.get_string("cache")) {
    if (!(margin_ >= 0 && margin_ <= 0.5)) throw loom::sdk::Error("memory.margin must be in [0, 0.5]");
    if (max_batch_ < 1) throw loom::sdk::Error("memory.max_batch must be at least 1");
    if (cache_.empty()) cache_ = default_cache().string();
    std::string lower = cache_;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    if (lower == "off") cache_ = "off";  // (OFF was a file of that name)
  }

  void plan(loom::sdk::PlanContext& context) override {
    if (!context.probe) throw loom::sdk::Error("auto_batch: the host offers no probe");
    const auto stats = context.memory->stats();
    const int64_t cap = stats.limit > 0 ? stats.limit : stats.total;
    const int64_t limit = std::min(max_batch_, context.max_micro_batch > 0 ? context.max_micro_batch : max_batch_);
    const std::string key = context.device_name + "|cap=" + std::to_string(cap) + "|margin=" + std::to_string(margin_) +
                            "|max=" + std::to_string(limit) + "|" + context.config_key;
    int64_t chosen = 0;
    // On the CPU without a cap the probes run under what the host has free now (the cap in the key is
    // the machine's size): an answer of an idle machine is none for a busy one, or under ulimit -v.
    const bool by_free = stats.limit <= 0 && (context.device_name == "cpu" || context.device_name.rfind("cpu:", 0) == 0);
    if (by_free && cache_ != "off")
      loom::sdk::log::debug("the CPU without a cap: the answer depends on the memory free now, and is not cached");
    if (cache_ != "off" && !by_free) {
      std::map<std::string, int64_t> entries;
      try {
        entries = read_cache(cache_);
      } catch (const loom::sdk::Error& e) {  // (not this run's failure: it searches, and leaves the file alone)
        if (set_aside_if_grown(cache_)) {
          // (a cache an older Loom grew past what it reads: every run warned of it, and cached nothing)
        } else {
          loom::sdk::log::warn(e.what(), ": the search runs without it and writes nothing there. Point memory.auto_batch.cache "
                               "at a file (or remove what is at ", cache_, "), or set it to off");
          cache_ = "off";
        }
      }
      // (an answer above the key's own max is no answer of this search: an edited or damaged line)
      if (auto it = entries.find(key); it != entries.end() && it->second <= limit) {
        chosen = it->second;
        cached_key_ = key;
        loom::sdk::log::info("micro-batch ", chosen, " from the cache ", cache_);
        description_ = "auto_batch: micro-batch " + std::to_string(chosen) + " (cached)";
      }
    }
    if (chosen == 0) {
      chosen = search(context, cap, limit);
      if (!converged_)
        loom::sdk::log::warn("the search used its ", kMaxProbes, " probes before it settled: micro-batch ", chosen,
                             " fits, a larger one may too; the answer is not cached");
      if (cache_ != "off" && !by_free && converged_) {
        try {
          auto entries = read_cache(cache_);
          entries[key] = chosen;
          write_cache(cache_, entries, key);
        } catch (const loom::sdk::Error& e) {  // (replaced since it was read, or a full disk)
          loom::sdk::log::warn(e.what(), ": the answer is not cached");
        }
      }
    }
    const int64_t world = context.plan.world_size;
    if (context.global_batch_given) {
      context.plan = loom::sdk::split_global_batch(context.global_batch, world, chosen);
      loom::memory::warn_uneven_split(context.plan, context.global_batch, chosen, "{} fit");
      if (context.plan.micro_batch != chosen)  // (the summary said "micro-batch 3" of a plan of 2 x 16)
        description_ = (description_.empty() ? "auto_batch: micro-batch " + std::to_string(chosen) : description_) +
                       " fits; planned " + std::to_string(context.plan.micro_batch) + ", which divides the batch";
    } else
      context.plan = loom::sdk::BatchPlan{chosen, context.plan.accumulation, world};  // (the run's accumulation stays)
    planned_micro_batch_ = context.plan.micro_batch;
    loom::sdk::log::info("plan ", loom::sdk::plan_text(context.plan));
  }

  std::string describe() const override { return description_.empty() ? "auto_batch" : description_; }

  /// A cached answer that ran out of memory (measured by an older Loom, or on a device that
  /// other processes now share) is taken out of the cache, so that the next run searches again;
  /// re-planning is oom_recovery's.
  /// (An evaluation's out-of-memory is not about the training micro-batch it measured: that one
  /// is halved, down to 1. Listed after oom_recovery, it is told only once that one declines,
  /// its memory.max_replans spent: the evaluation goes on halving, as it changes nothing.)
  bool on_oom(loom::sdk::OomContext& context) override {
    // An evaluation's micro-batch was never searched (evaluation may hold more than a step: a
    // recommender's item vectors): halved until it fits, as auto_batch promises a run that fits.
    // (The evaluation changes nothing but its own sums, so it starts again.)
    if (context.evaluation) {
      if (context.plan.micro_batch <= 1) return false;
      context.plan.micro_batch /= 2;
      return true;
    }
    if (cached_key_.empty() || cache_ == "off") return false;
    // (a policy after it, or a recovery before, changed the micro-batch: not the cached answer's failure)
    if (context.plan.micro_batch != planned_micro_batch_) return false;
    try {  // (the recovery goes on whatever became of the cache)
      auto entries = read_cache(cache_);
      if (entries.erase(cached_key_) > 0) {
        write_cache(cache_, entries);
        loom::sdk::log::warn("the cached micro-batch ran out of memory: its entry is removed from ", cache_,
                             "; the next run searches again");
      }
    } catch (const loom::sdk::Error& e) {
      loom::sdk::log::warn(e.what(), ": the cached micro-batch that ran out of memory stays in it");
    }
    cached_key_.clear();
    return false;
  }


 private:
  /// Peak of a probe at b, or -1 when it runs out of memory.
  int64_t probe(loom::sdk::PlanContext& context, int64_t b) {
    ++probes_;
    try {
      const int64_t peak = context.probe(b);
      loom::sdk::log::debug("probe ", probes_, " at ", b, ": peak ", peak, " bytes");
      return peak;
    } catch (const c10::OutOfMemoryError&) {
      loom::sdk::log::debug("probe ", probes_, " at ", b, ": out of memory");
      context.memory->empty_cache();
      return -1;
    }
  }

  int64_t search(loom::sdk::PlanContext& context, int64_t cap, int64_t limit) {
    probes_ = 0;
    int64_t b1 = std::min<int64_t>(2, limit), b2 = std::min<int64_t>(8, limit);
    int64_t p1 = probe(context, b1);
    if ((p1 < 0 || p1 > cap) && b1 > 1) {  // the last chance: a micro-batch of 1
      const int64_t p = probe(context, 1);
      if (p >= 0 && p <= cap) {
        converged_ = true;
        description_ = "auto_batch: micro-batch 1 (" + std::to_string(probes_) + " probes)";
        return 1;
      }
      b1 = 1;
    }
    if (p1 < 0 || p1 > cap)
      throw loom::sdk::Error("auto_batch: even a micro-batch of " + std::to_string(b1) + " does not fit under the cap of " +
                             loom::sdk::format_bytes(cap) + "; lower the model size, use AMP, or raise the cap");
    if (b2 == b1) {  // (a limit of 1 or 2: nothing more to search)
      converged_ = true;
      description_ = "auto_batch: micro-batch " + std::to_string(b1) + ", the largest allowed (" +
                     std::to_string(probes_) + " probes)";
      return b1;
    }
    int64_t p2 = probe(context, b2);
    if (p2 < 0 || p2 > cap) {  // between b1 and b2: bisect the few candidates left
      // The margin's headroom, as the line's aim leaves it: margin/2 of the room above b1's peak
      // (the bisection took the largest batch under the cap itself, at 99.75 % of it).
      const int64_t under = cap - static_cast<int64_t>(static_cast<double>(cap - p1) * margin_ / 2.0);
      int64_t lo = b1, hi = b2;
      while (hi - lo > 1 && probes_ < kMaxProbes) {
        const int64_t mid = (lo + hi) / 2;
        const int64_t p = probe(context, mid);
        (p >= 0 && p <= under ? lo : hi) = mid;
      }
      converged_ = hi - lo <= 1;
      description_ = "auto_batch: micro-batch " + std::to_string(lo) + " (" + std::to_string(probes_) + " probes)";
      return lo;
    }
    // Fit through the two largest batches that fit so far; aim, verify, refit, until the aim no
    // longer moves or the probes are spent.
    const double aim = 1.0 - margin_ / 2.0;
    int64_t best = b2, best_peak = p2;     // the largest batch measured to fit
    int64_t prev = b1, prev_peak = p1;     // the one before it
    int64_t fails_at = limit + 1;          // the smallest batch known not to fit
    converged_ = false;
    while (true) {
      const double k = static_cast<double>(best_peak - prev_peak) / static_cast<double>(best - prev);
      const double a = static_cast<double>(best_peak) - k * static_cast<double>(best);
      const double b_max = k > 0 ? (static_cast<double>(cap) - a) / k : static_cast<double>(limit);
      int64_t target = std::min<int64_t>(static_cast<int64_t>(std::floor(b_max * aim)), limit);
      // Where the line aims at or past a batch that failed, the line is wrong up there (it was
      // fitted on a flatter stretch): bisect between what fits and what failed instead, at the
      // geometric mean, since the two can be orders of magnitude apart.
      if (target >= fails_at) {
        target = static_cast<int64_t>(std::sqrt(static_cast<double>(best) * static_cast<double>(fails_at)));
        if (target <= best) target = best + 1 < fails_at ? best + 1 : best;
      }
      if (target <= best) {
        converged_ = true;
        break;
      }
      if (probes_ >= kMaxProbes) break;
      const int64_t p = probe(context, target);
      if (p >= 0 && p <= cap) {
        prev = best;
        prev_peak = best_peak;
        best = target;
        best_peak = p;
        loom::sdk::log::debug("micro-batch ", target, " fits (peak ", p, " of ", cap, " bytes)");
      } else {
        fails_at = target;
      }
    }
    const int64_t chosen = best;
    loom::sdk::log::info("micro-batch ", chosen, " fits (peak ", loom::sdk::format_bytes(best_peak), " of ",
                         loom::sdk::format_bytes(cap), "; ", probes_, " probes)");
    description_ = "auto_batch: micro-batch " + std::to_string(chosen) + " (" + std::to_string(probes_) + " probes)";
    return chosen;
  }

  double margin_;
  int64_t max_batch_;
  std::string cache_;
  std::string description_;
  int probes_ = 0;
  bool converged_ = false;  ///< the search ended on its own, not for want of probes
  std::string cached_key_;  ///< the cache's key of the answer this run took from it, if any
  int64_t planned_micro_batch_ = 0;  ///< the micro-batch of the plan it made
};

}  // namespace

LOOM_PLUGIN("auto_batch", "1.0.0",
            loom::sdk::component<AutoBatch>("auto_batch", "largest micro-batch under the cap, found by probing"))
