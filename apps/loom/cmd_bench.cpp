// `loom bench configs A.ini B.ini ... --steps 100 [--repeats N]`: each configuration for a few
// steps, side by side: micro-batch, accumulation, global batch, peak memory, samples/s and the
// ratio to the first configuration (seed 004's comparison script, built in), over N interleaved
// rounds. Runs in a temporary work folder that is removed afterwards.
//
// Each configuration's run in each round is a child process (this command line again, marked by
// kBenchChildVariable, given the run's configuration as this process read it), in a process group
// of its own: a plugin that crashes (SIGSEGV), exits or hangs ends that child, and its row says
// FAILED with why, as an error does; the rows measured before stand (it ended the whole command,
// the table lost). The child writes one line per event to descriptor 100, fields separated by
// tabs (child_report.hpp):
//   progress                                      it lives: every 10 s of its set-up, then a step taken (one a second at most)
//   result MICRO ACCUMULATION WORLD PEAK RATE     the run's plan, peak memory (bytes) and samples/s
//   failed MESSAGE                                its error
// Where no child can be started, the runs are in this process, as before.
#include "child_report.hpp"
#include "cli.hpp"

#include <loom/core/child_process.hpp>
#include <loom/core/error.hpp>
#include <loom/core/log.hpp>
#include <loom/core/stop_signals.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>
#include <loom/sdk/helpers.hpp>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::cli {

namespace {

/// Set in a child's environment, "ROUND:PARENT:FILE": the round it runs, the parent's pid, and
/// the run's configuration as the parent read it (freeze), in the parent's scratch folder, which
/// holds the run. Internal to `loom bench`.
constexpr const char* kBenchChildVariable = "LOOM_INTERNAL_BENCH_CHILD";
constexpr int kBenchChildFd = core::kReportFd;
/// Seconds a child may take to its first word (LibTorch, the plugins) and between two (a step;
/// the set-up says it lives every few seconds).
constexpr double kChildLimit = 1800;

struct ChildSpec {
  int64_t round = 0;
  fs::path config;
};

/// The child's spec from kBenchChildVariable's value; checks that it is run by `loom bench`.
ChildSpec child_spec(const std::string& value) {
  struct stat st {};
  char* end = nullptr;
  const size_t a = value.find(':'), b = a == std::string::npos ? a : value.find(':', a + 1);
  ChildSpec spec{std::strtoll(value.c_str(), &end, 10), {}};
  if (b == std::string::npos || end != value.c_str() + a || spec.round < 0 || ::fstat(kBenchChildFd, &st) != 0 ||
      !S_ISFIFO(st.st_mode))
    throw Error(std::string(kBenchChildVariable) + " is set: it is internal to loom bench; unset it");
  spec.config = value.substr(b + 1);
  // A parent killed on its own (SIGKILL): this process goes too, with what a plugin started in its group.
  if (::getppid() != std::strtol(value.c_str() + a + 1, nullptr, 10)) std::_Exit(1);
  core::end_with_parent(static_cast<int>(::getppid()));
  ::fcntl(kBenchChildFd, F_SETFD, FD_CLOEXEC);  // (not inherited by the processes a plugin starts)
  ::unsetenv(kBenchChildVariable);  // (nor the variable: a `loom bench` a plugin runs is its own)
  return spec;
}

/// `config` to `file`, one setting a line (key, value and origin, child_report's fields): what a
/// child runs, as the parent read it. (Read again from the user's files, one edited during a long
/// bench was another configuration in the later rounds, or failed every row.)
void freeze(const core::Config& config, const fs::path& file) {
  std::ofstream out(file, std::ios::trunc);
  for (const std::string& key : config.keys_in_set_order()) {
    const core::ConfigValue& v = *config.find(key);
    out << escaped(key) << '\t' << escaped(v.value) << '\t' << escaped(v.origin.source) << '\t'
        << escaped(v.origin.file.string()) << '\t' << v.origin.line << '\n';
  }
  if (!out.flush()) throw Error("cannot write " + file.string() + ", a run's configuration in loom bench's scratch folder");
}

core::Config thaw(const fs::path& file) {
  std::ifstream in(file);
  if (!in) throw Error("cannot read " + file.string() + ", this run's configuration from loom bench");
  core::Config config;
  for (std::string line; std::getline(in, line);) {
    const auto f = fields(line);
    if (f.size() != 5) throw Error(file.string() + " is no configuration loom bench wrote");
    config.set(f[0], f[1], {f[2], f[3], static_cast<int>(std::strtol(f[4].c_str(), nullptr, 10))});
  }
  return config;
}

/// What one run of a configuration measured.
struct Measured {
  sdk::BatchPlan plan;
  int64_t peak = 0;
  double rate = 0;  ///< samples per second over the timed steps
};

/// One run of `config` for `steps` steps: its set-up (quiet where `quiet`), a warm-up step, then
/// the timed ones; `progress` after the set-up and each step.
Measured run_once(const core::Config& config, core::PluginRegistry& registry, int64_t steps, bool quiet,
                  const std::function<void()>& progress) {
  // (the set-up of a configuration is the same in each round: its warnings and its report
  // once, in the first, not again in every round)
  core::Resolved resolved = [&] {  // (its warnings were said as the command read the configurations: not twice)
    const core::log::Quiet said(true);
    return core::resolve_run(config, registry);
  }();
  auto silence = std::make_unique<core::log::Quiet>(quiet);
  core::Trainer trainer(std::move(resolved), registry);
  trainer.setup();
  silence.reset();
  progress();
  trainer.step_with_recovery();  // warm-up, not timed
  trainer.memory().reset_peak();
  const auto start = std::chrono::steady_clock::now();
  int64_t samples = 0;
  for (int64_t i = 1; i < steps; ++i) {
    stop_if_signalled("loom bench");
    samples += trainer.step_with_recovery().samples;
    progress();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {trainer.plan(), trainer.memory().stats().peak, static_cast<double>(samples) / seconds};
}

/// In the child: runs `config` and tells the parent what it measured, or its error. Returns the exit status.
int run_bench_child(const core::Config& config, core::PluginRegistry& registry, int64_t steps, int64_t round) {
  // While the set-up runs (a batch search, a dataset's preparation: minutes), a word every 10 s:
  // the limit is for a step that hangs, as the command had none for a set-up.
  std::atomic<bool> set_up{false};
  std::thread heartbeat([&] {
    for (int tenths = 1; !set_up.load(); ++tenths) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (tenths % 100 == 0 && !set_up.load()) tell_parent(kBenchChildFd, "progress");
    }
  });
  struct Heartbeat {  // (ended once the set-up is, however it ends)
    std::atomic<bool>& set_up;
    std::thread& thread;
    void end() {
      set_up.store(true);
      if (thread.joinable()) thread.join();
    }
    ~Heartbeat() { end(); }
  } beating{set_up, heartbeat};
  auto last = std::chrono::steady_clock::now() - std::chrono::seconds(2);
  const auto progress = [&] {
    beating.end();
    if (const auto now = std::chrono::steady_clock::now(); now - last >= std::chrono::seconds(1)) {
      tell_parent(kBenchChildFd, "progress");
      last = now;
    }
  };
  std::string failed;
  try {
    const Measured m = run_once(config, registry, steps, round > 0, progress);
    char rate[64];
    std::snprintf(rate, sizeof rate, "%.17g", m.rate);
    tell_parent(kBenchChildFd, "result\t" + std::to_string(m.plan.micro_batch) + "\t" + std::to_string(m.plan.accumulation) +
                                   "\t" + std::to_string(m.plan.world_size) + "\t" + std::to_string(m.peak) + "\t" + rate);
    return 0;
  } catch (const core::StoppedBySignal&) {
    throw;
  } catch (const std::exception& e) {
    failed = message_of(e);
  } catch (...) {  // (`throw 42;` in a plugin)
    failed = "a plugin threw a value that is not an exception (not derived from std::exception); a plugin reports a "
             "failure by throwing loom::sdk::Error";
  }
  beating.end();  // (no progress line after the failure)
  tell_parent(kBenchChildFd, "failed\t" + escaped(failed));
  return 0;
}

/// What a child's run came to: its figures, or why it has none; `started` false where no child
/// could be started (nothing ran).
struct ChildRun {
  bool started = false;
  std::optional<Measured> measured;
  std::string failed;
  bool paused = false;  ///< stopped and continued with the bench (Ctrl-Z, fg): its rate counts the pause
};

/// In the parent: the run of `config` in `round` in a child, its configuration written to
/// `frozen` first; a stop signal meanwhile ends the child and throws core::StoppedBySignal.
ChildRun run_in_child(const core::Config& config, int64_t round, const fs::path& frozen) {
  freeze(config, frozen);
  core::ChildProcess child;
  child.exe = "/proc/self/exe";
  child.args = own_arguments();
  child.environment = std::string(kBenchChildVariable) + "=" + std::to_string(round) + ":" + std::to_string(::getpid()) +
                      ":" + frozen.string();
  child.report_fd = kBenchChildFd;
  child.own_group = true;  // (a plugin's kill(0, ...) is its own; what it starts goes with it)
  child.first_limit = child.limit = kChildLimit;
  ChildRun out;
  bool answered = false;
  const core::ChildEnd end = core::run_child_process(
      child,
      [&](const std::string& line) {
        const auto f = fields(line);
        if (answered) return false;
        if (f[0] == "progress" && f.size() == 1) return true;
        if (f[0] == "failed" && f.size() == 2) {
          out.failed = f[1];
          return answered = true;
        }
        if (f[0] != "result" || f.size() != 6) return false;
        Measured m;
        char* tail = nullptr;
        m.plan.micro_batch = std::strtoll(f[1].c_str(), nullptr, 10);
        m.plan.accumulation = std::strtoll(f[2].c_str(), nullptr, 10);
        m.plan.world_size = std::strtoll(f[3].c_str(), nullptr, 10);
        m.peak = std::strtoll(f[4].c_str(), nullptr, 10);
        m.rate = std::strtod(f[5].c_str(), &tail);
        if (tail == f[5].c_str()) return false;
        out.measured = m;
        return answered = true;
      },
      [] { return core::stop_signal_received() != 0; });
  if (end.spawn_error != 0) {
    out.failed = std::strerror(end.spawn_error);
    return out;
  }
  out.started = true;
  out.paused = end.paused;
  stop_if_signalled("loom bench");
  if (end.timed_out) {
    out.measured.reset();
    out.failed = "said nothing for " + std::to_string(static_cast<int>(kChildLimit)) +
                 " s (a step or its set-up hangs?); the process running it was stopped";
  } else if (!answered || !WIFEXITED(end.status) || WEXITSTATUS(end.status) != 0) {
    out.measured.reset();  // (it crashed in its exit: its figures are of a run that did not end well)
    if (out.failed.empty()) out.failed = how_it_ended(end.status);
  }
  return out;
}

}  // namespace

int cmd_bench(const Invocation& invocation) {
  std::vector<std::string> files(invocation.args.begin(), invocation.args.end());
  if (!files.empty() && files.front() == "configs") files.erase(files.begin());
  if (files.empty()) throw Error("usage: loom bench configs A.ini B.ini ... [--steps 100] [--repeats 1] [--set ...]");
  const int64_t steps = invocation.options["steps"].as<int64_t>();
  if (steps < 2 || steps > 100000)
    throw Error("--steps must be in 2..100000 (the first step is a warm-up; a bench compares a few hundred steps)");
  core::PluginRegistry registry;
  if (const char* variable = std::getenv(kBenchChildVariable); variable != nullptr) {
    const ChildSpec child = child_spec(variable);
    core::install_stop_signals(core::OnStop::kScratch);
    try {  // (every error is its row's, told the parent: an exit status said nothing of it)
      {
        const core::log::Quiet quiet(true);  // (the parent said what the scan had to say)
        scan_plugins(registry, invocation.options, false);
      }
      return run_bench_child(thaw(child.config), registry, steps, child.round);
    } catch (const core::StoppedBySignal&) {
      throw;
    } catch (const std::exception& e) {
      tell_parent(kBenchChildFd, "failed\t" + escaped(message_of(e)));
      return 0;
    }
  }
  scan_plugins(registry, invocation.options);
  core::install_stop_signals(core::OnStop::kScratch);  // before the scratch folder: a stop from here on removes it
  const ScratchFolder scratch("loom-bench");
  const fs::path& work = scratch.path();

  const int64_t repeats = invocation.options["repeats"].as<int64_t>();
  if (repeats < 1 || repeats > 100) throw Error("--repeats must be between 1 and 100");

  // Rounds, each running every configuration once in the order given: on a shared machine
  // whose speed drifts (docs/performance.md, "The machine's two speeds") a configuration timed
  // only after another would take the other's luck; interleaved, each round's ratio to the first
  // configuration compares two runs minutes apart at most, and the median of those ratios is
  // what a noisy neighbour moves least.
  struct Row {
    std::string name;
    sdk::BatchPlan plan;
    int64_t peak = 0;
    std::vector<double> rates;
    std::string failed;  ///< why it stopped, where it did: its row says so, the others stand
  };
  // Each configuration is read once, with the user's settings over it and the bench's own, and
  // checked before the first one runs: a missing file or a wrong key in the last is found now,
  // not after the others have been timed.
  const core::Config user = config_from(invocation.options);
  // A configuration's failure names it (a set-up error of the second read as the first's).
  const auto in_configuration = [](const std::string& file, const auto& f) {
    try {
      f();
    } catch (const core::StoppedBySignal&) {
      throw;
    } catch (const std::exception& e) {
      throw Error("configuration " + file + ": " + message_of(e));
    }
  };
  std::vector<core::Config> configs;
  // A key the configurations differ in, set over all of them (`-c debug` over two models' files):
  // each ran the same, under its own name in the table (a probe).
  std::map<std::string, std::set<std::string>> own_values;
  for (const std::string& file : files) {
    core::Config& config = configs.emplace_back();
    in_configuration(file, [&] {
      config.load_file(core::find_config(file));
      for (const std::string& key : user.keys_in_set_order()) {
        const core::ConfigValue* own = config.find(key);
        own_values[key].insert(own != nullptr ? own->value : "its default");
      }
      for (const std::string& key : user.keys_in_set_order()) {  // in the user's order (Config::set_order)
        const core::ConfigValue& value = *user.find(key);
        config.set(key, value.value, value.origin);
      }
      set_scratch_run(config, "loom bench", work, steps);
      core::resolve_run(config, registry);
      config.forget_base_override_warnings();  // said once above, not again in every round
    });
  }
  const auto run_config = [&](size_t index, int64_t round) {  // (its name: one folder per run, even when two files share a name)
    core::Config config = configs[index];
    std::string stem = fs::path(files[index]).stem().string();
    for (char& ch : stem)
      if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-' && ch != '_' && ch != '.') ch = '_';
    config.set("trainer.name", std::to_string(round + 1) + "-" + std::to_string(index + 1) + "-" + stem, {"loom bench", {}, 0});
    return config;
  };
  std::vector<std::string> overridden;
  for (const std::string& key : user.keys_in_set_order())
    if (own_values[key].size() > 1)
      overridden.push_back(key + " = " + user.find(key)->value + " (theirs: " +
                           core::join(std::vector<std::string>(own_values[key].begin(), own_values[key].end()), ", ") + ")");
  if (!overridden.empty())
    core::log::warn("the command's settings (-c, --set, flags) set over every configuration what they differ in: ", core::join(overridden, "; "),
                    ". Each runs with these under its own name in the table; leave them out of the command to compare the "
                    "configurations as they are");
  std::vector<Row> rows(files.size());
  for (size_t index = 0; index < files.size(); ++index) {  // (two x.ini of other folders read as one)
    const std::string name = fs::path(files[index]).filename().string();
    const bool shared = std::count_if(files.begin(), files.end(),
                                      [&](const std::string& f) { return fs::path(f).filename() == name; }) > 1;
    rows[index].name = shared ? files[index] : name;
    // (one file given twice, to see the noise: two rows of one name)
    if (const auto twice = std::count(files.begin(), files.end(), files[index]); twice > 1)
      rows[index].name += " #" + std::to_string(std::count(files.begin(), files.begin() + static_cast<std::ptrdiff_t>(index) + 1,
                                                           files[index]));
  }
  // The table of `done` rounds (all asked for, or those before a stop).
  const auto report = [&](int64_t done) -> int {
    // (of an even count, the geometric mean of the middle two: of two rounds' ratios 0.5 and 12.9,
    // the arithmetic mean, 6.72x, stood next to medians 889 and 789 samples/s)
    const auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      const size_t n = v.size();
      return n % 2 ? v[n / 2] : std::sqrt(v[n / 2 - 1] * v[n / 2]);
    };
    std::vector<std::string> noisy;
    std::printf("\n%-28s %11s %12s %12s %12s %12s %14s %9s\n", "configuration", "micro-batch", "accumulation",
                "global batch", "peak memory", "samples/s", "range", "vs first");
    // Ratios to the first configuration, or to the first that ran where it failed (said below).
    const auto base = std::find_if(rows.begin(), rows.end(), [](const Row& r) { return r.failed.empty(); });
    for (const auto& r : rows) {
      if (!r.failed.empty()) {
        std::printf("%-28s FAILED%s: %s\n", r.name.c_str(),
                    r.rates.empty() ? "" : (" in round " + std::to_string(r.rates.size() + 1)).c_str(), r.failed.c_str());
        continue;
      }
      std::vector<double> ratios;
      for (size_t k = 0; k < r.rates.size(); ++k) ratios.push_back(r.rates[k] / base->rates[k]);
      const auto [lo, hi] = std::minmax_element(r.rates.begin(), r.rates.end());
      char range[32];
      std::snprintf(range, sizeof range, "%.0f-%.0f", *lo, *hi);
      if (*hi > 2 * *lo) noisy.push_back(r.name + " (" + range + " samples/s)");
      std::printf("%-28s %11lld %12lld %12lld %12s %12.0f %14s %8.2fx\n", r.name.c_str(),
                  static_cast<long long>(r.plan.micro_batch), static_cast<long long>(r.plan.accumulation),
                  static_cast<long long>(r.plan.global()), core::format_bytes(r.peak).c_str(), median(r.rates),
                  done > 1 ? range : "-", median(ratios));
    }
    std::printf("(%lld steps each, the first one not timed; %s; vs first: %s; peak memory allocated on the device, on "
                "CPU by Loom's allocator)\n",
                static_cast<long long>(steps),
                done > 1    ? (std::to_string(done) + " interleaved rounds, medians and their range").c_str()
                : done < repeats ? "one round, the only one finished"
                                 : "one round (--repeats N runs N interleaved rounds and gives medians)",
                done > 1 ? "the median of each round's ratio to the first configuration" : "the ratio to the first configuration");
    if (!noisy.empty())
      std::printf("(rounds more than 2x apart: %s; its figures are mostly noise: give more --steps)\n",
                  core::join(noisy, ", ").c_str());
    if (base == rows.end()) return 1;
    if (base != rows.begin()) std::printf("(the first configuration failed: vs first is against %s)\n", base->name.c_str());
    return std::any_of(rows.begin(), rows.end(), [](const Row& r) { return !r.failed.empty(); }) ? 1 : 0;
  };
  // A stop (Ctrl-C) after a round finished reports the rounds that did: minutes of timing were
  // thrown away, with a message about a run's set-up.
  int64_t rounds = 0;
  bool in_children = true;
  try {
    const auto bench_start = std::chrono::steady_clock::now();
    for (int64_t round = 0; round < repeats; ++round) {
      for (size_t index = 0; index < files.size(); ++index) {
        const std::string& file = files[index];
        if (!rows[index].failed.empty()) continue;
        core::log::info("bench     ", rows[index].name, repeats > 1 ? ", round " + std::to_string(round + 1) + " of " +
                                                                          std::to_string(repeats) : std::string(),
                        ": ", steps, " steps");
        // A configuration that fails while it runs (out of memory under its cap, a plugin's crash)
        // is a row that says so: the figures of the others, measured already, were lost with it.
        try {
          std::optional<Measured> measured;
          if (in_children) {
            ChildRun run = run_in_child(run_config(index, round), round,
                                        work / ("config-" + std::to_string(round + 1) + "-" + std::to_string(index + 1) + ".tsv"));
            if (!run.started) {
              core::log::warn("cannot start a process for a configuration's run (", run.failed, "): they run in this one, "
                              "and one whose plugin crashes ends the bench");
              in_children = false;
            } else if (!run.measured) {
              throw Error(run.failed);
            } else {
              measured = run.measured;
              if (run.paused)
                core::log::warn("bench     ", rows[index].name, repeats > 1 ? ", round " + std::to_string(round + 1) : std::string(),
                                ": paused (Ctrl-Z) while it was measured, so its rate counts the pause; run the bench "
                                "again for a true figure");
            }
          }
          if (!measured) measured = run_once(run_config(index, round), registry, steps, round > 0, [] {});
          Row& row = rows[index];
          // (later rounds' set-up is quiet: a plan other than the first round's, where free memory
          // differed, is said, or the median mixed two plans' rates unsaid; a review)
          if (round > 0 && sdk::plan_text(measured->plan) != sdk::plan_text(row.plan))
            core::log::warn("bench     ", row.name, ", round ", round + 1, ": planned ", sdk::plan_text(measured->plan),
                            " where round 1 planned ", sdk::plan_text(row.plan), " (the memory free differed); its rate is "
                            "of that plan, and the table shows round 1's");
          if (round == 0) row.plan = measured->plan;
          row.peak = std::max(row.peak, measured->peak);
          row.rates.push_back(measured->rate);
        } catch (const core::StoppedBySignal&) {
          throw;
        } catch (const std::exception& e) {
          rows[index].failed = message_of(e);
          const std::string first_line = rows[index].failed.substr(0, rows[index].failed.find('\n'));
          core::log::error("configuration ", file, ": ", rows[index].failed, " (its row says FAILED; the others run on)");
          rows[index].failed = first_line;  // (the table's row: the advice that follows was said above)
        }
      }
      rounds = round + 1;
      if (rounds < repeats) {  // (how long the rest takes: rounds of minutes ran on without a word)
        const double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - bench_start).count();
        core::log::info("bench     ", rounds, rounds == 1 ? " round" : " rounds", " of ", repeats, " in ",
                        sdk::format_duration(spent), "; about ",
                        sdk::format_duration(spent / static_cast<double>(rounds) * static_cast<double>(repeats - rounds)),
                        " more for the rest");
      }
    }
    stop_if_signalled("loom bench");  // (in the last step)
  } catch (const core::StoppedBySignal& stopped) {
    const std::string how = "loom bench: stopped by " + core::signal_name(stopped.signal);
    if (rounds == 0)
      throw core::StoppedBySignal(stopped.signal, how + " in its first round; nothing is reported, and its scratch runs are removed");
    for (Row& row : rows)  // (the round stopped in is left out; a row failed earlier keeps the rounds it ran)
      if (row.rates.size() > static_cast<size_t>(rounds)) row.rates.resize(rounds);
    report(rounds);
    core::log::warn(how, rounds < repeats ? " in round " + std::to_string(rounds + 1) + " of " + std::to_string(repeats)
                                          : std::string(" after its last round"), ": the table holds the ", rounds,
                    rounds == 1 ? " round" : " rounds", " that finished; its scratch runs are removed");
    return 128 + stopped.signal;
  }
  return report(repeats);
}

}  // namespace loom::cli
