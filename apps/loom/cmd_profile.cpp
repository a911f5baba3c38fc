// `loom profile [-c FILE] [--steps 20] [--warmup 5] [--trace PATH] [--shapes] [--memory]`:
// training steps of the run under LibTorch's profiler: a Chrome trace (Perfetto, chrome://tracing)
// with Loom's phases as named ranges, and the time per phase and the top operators by self time
// (by input shapes with --shapes; with --memory, those that allocate the most) on the terminal. Runs
// in a temporary work folder that is removed afterwards; the run's own folder is not touched.
#include "cli.hpp"

#include <loom/core/error.hpp>
#include <loom/core/log.hpp>
#include <loom/core/stop_signals.hpp>
#include <loom/core/profiler.hpp>
#include <loom/core/trainer.hpp>

#include <cctype>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <filesystem>
#include <new>
#include <unistd.h>

namespace fs = std::filesystem;

namespace loom::cli {

namespace {

/// loom-profile-<time>.json here, or -2, -3, ... after it where a profile of the same second is
/// there (two in a script's loop: the second was refused for a --trace it was never given).
fs::path default_trace() {
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
  std::error_code ec;
  for (int n = 1; n < 1000; ++n) {
    std::string name = "loom-profile-";
    name.append(stamp);
    if (n > 1) name.append("-").append(std::to_string(n));
    name.append(".json");
    if (!fs::exists(fs::symlink_status(name, ec))) return name;
  }
  throw Error("loom profile: 999 traces named loom-profile-" + std::string(stamp) + "*.json are here; give one with --trace");
}

}  // namespace

int cmd_profile(const Invocation& invocation) {
  if (!invocation.args.empty())
    throw Error("loom profile takes no positional arguments (got '" + invocation.args[0] +
                "'); configuration files go after -c" + switch_value_hint(invocation, invocation.args[0]));
  const int64_t steps = invocation.options["steps"].as<int64_t>();
  const int64_t warmup = invocation.options["warmup"].as<int64_t>();
  const int64_t top = invocation.options["top"].as<int64_t>();
  // (the trace holds every operator of every profiled step: 1000 steps of the debug model took
  // 1.7 GB of memory and wrote 250 MB; 100000 were allowed)
  if (steps < 1 || steps > 1000)
    throw Error("--steps must be in 1..1000 (the profiled training steps: the trace holds every operator of each, and "
                "a few dozen give its averages; --warmup runs steps before it, unrecorded)");
  if (warmup < 0 || warmup > 100000) throw Error("--warmup must be in 0..100000 (steps run before profiling)");
  if (top < 1) throw Error("--top must be at least 1");
  const fs::path trace =
      invocation.options.count("trace") ? fs::path(invocation.options["trace"].as<std::string>()) : default_trace();
  // Nothing already written is replaced: a trace is a measurement someone may still need.
  std::error_code ec;
  if (trace == "-") throw Error("--trace -: the trace is written to a file, not to standard output; give its path");
  if (fs::is_directory(trace, ec))
    throw Error("--trace " + trace.string() + " is a folder; give the trace's file name, e.g. --trace " +
                (trace / "profile.json").string());
  if (fs::exists(fs::symlink_status(trace, ec)))
    throw Error("--trace " + trace.string() + (fs::is_symlink(fs::symlink_status(trace, ec)) && !fs::exists(trace, ec)
                                                   ? " is a link to nothing, which Loom does not write through"
                                                   : " already exists") + "; choose another path or remove it");
  if (trace.empty()) throw Error("--trace needs a path, e.g. --trace profile.json");
  // (Perfetto and chrome://tracing read a compressed name as compressed: plain JSON there fails)
  if (std::string ext = trace.extension().string(); [&] {
        for (char& ch : ext) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        return ext == ".gz" || ext == ".zst" || ext == ".bz2" || ext == ".xz" || ext == ".zip";
      }()) {
    fs::path plain = trace.parent_path() / trace.stem();
    if (plain.extension() != ".json") plain += ".json";
    throw Error("--trace " + trace.string() + ": Loom writes the trace as plain JSON; name it " + plain.string() +
                " (compress it afterwards if you wish)");
  }
  if (trace.has_parent_path() && !fs::is_directory(trace.parent_path()))
  {
    // (the nearest part of the path that exists says what is wrong: a file where a folder is needed)
    fs::path existing = trace.parent_path();
    while (existing.has_parent_path() && existing != existing.parent_path() && !fs::exists(existing, ec)) existing = existing.parent_path();
    throw Error("--trace " + trace.string() + ": " +
                (fs::exists(existing, ec) && !fs::is_directory(existing, ec) ? existing.string() + " is not a folder"
                                                                             : trace.parent_path().string() + ": no such folder"));
  }
  // Writable now, not found out after the profiled steps: a file of this process's beside it, made
  // and taken away again (made at the trace's own name, two profiles started together each took
  // the other's for a trace: "cannot be written (File exists)"; a flaky integration.profile).
  const fs::path probe = trace.string() + "." + std::to_string(::getpid()) + ".probe";
  if (const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644); fd >= 0) {
    ::close(fd);
    ::unlink(probe.c_str());
  } else {
    throw Error((invocation.options.count("trace") ? "--trace " + trace.string() : "the trace " + trace.string() + " (here)") +
                " cannot be written (" + std::strerror(errno) + "); " +
                (invocation.options.count("trace") ? "choose a path in a folder you can write"
                                                   : "run it in a folder you can write, or give --trace PATH"));
  }

  core::PluginRegistry registry;
  scan_plugins(registry, invocation.options);
  core::Config config = config_from(invocation.options);
  core::install_stop_signals(core::OnStop::kScratch);  // before the scratch folder: a stop from here on removes it
  const ScratchFolder work("loom-profile");
  set_scratch_run(config, "loom profile", work.path(), warmup + steps);
  config.set("trainer.name", "profile", {"loom profile", {}, 0});

  core::Trainer trainer(core::resolve_run(config, registry), registry);
  trainer.setup();
  // A long warm-up (a big model, --warmup 1000) says where it is every 10 s, not only at its end.
  auto said = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < warmup; ++i) {
    stop_if_signalled("loom profile");
    trainer.step_with_recovery();
    if (const auto now = std::chrono::steady_clock::now(); now - said >= std::chrono::seconds(10) && i + 1 < warmup) {
      core::log::info("profile   warm-up step ", i + 1, " of ", warmup);
      said = now;
    }
  }
  core::log::info("profile   ", steps, " steps after ", warmup, " warm-up steps, micro-batch ", trainer.plan().micro_batch,
                  " x ", trainer.plan().accumulation, " on ", trainer.device().str());
  core::ProfileOptions options;
  options.shapes = invocation.options["shapes"].as<bool>();
  options.memory = invocation.options["memory"].as<bool>();
  core::Profiler profiler(trainer.device(), options);
  const auto start = std::chrono::steady_clock::now();
  const int64_t recoveries_before = trainer.oom_recoveries();
  int64_t samples = 0;
  for (int64_t i = 0; i < steps; ++i) {
    stop_if_signalled("loom profile");
    try {
      samples += trainer.step_with_recovery().samples;
    } catch (const std::exception& e) {
      // (1000 steps with --memory under `ulimit -v 4G` ran out of memory at step 167, advised a
      // smaller batch: the profiler's records took it, which the warm-up steps ran without)
      if (i == 0 || (dynamic_cast<const OutOfMemory*>(&e) == nullptr && dynamic_cast<const std::bad_alloc*>(&e) == nullptr) ||
          !trainer.device().is_cpu())
        throw;
      throw Error(message_of(e) + "\nloom profile: the profiler holds a record of every operator of the " + std::to_string(i) +
                  " profiled step(s) before it" + (options.memory ? " and of each of their allocations (--memory)" : "") +
                  ", in the host's memory the steps use: fewer --steps hold less (a few dozen give the averages)");
    }
  }
  stop_if_signalled("loom profile");  // (in the last step: no trace, as the message said)
  const core::ProfileReport report = profiler.stop(trace, /*next_free=*/!invocation.options.count("trace"));
  const double seconds = std::chrono::duration<double>(report.steps_done - start).count();
  std::printf("%s", core::format_profile(report, static_cast<size_t>(top), steps).c_str());
  std::printf("\n%lld step%s, %.0f samples/s under the profiler (it slows operators down: time a run with `loom train` "
              "or `loom bench`)\n",
              static_cast<long long>(steps), steps == 1 ? "" : "s", samples / seconds);
  // (a step replayed after an out-of-memory counts its attempt's calls too: loom::step 5 of 3 steps)
  if (const int64_t replayed = trainer.oom_recoveries() - recoveries_before; replayed > 0)
    std::printf("the profiled steps ran out of memory %lld time(s) and were replayed with a smaller micro-batch: the calls "
                "and times above hold the failed attempts too; profile again with the plan they ended with (micro-batch "
                "%lld x accumulation %lld)\n",
                static_cast<long long>(replayed), static_cast<long long>(trainer.plan().micro_batch),
                static_cast<long long>(trainer.plan().accumulation));
  if (!report.trace_error.empty())  // (the tables above were lost with it)
    core::log::error(report.trace_error);
  else
    std::printf("trace: %s (open in https://ui.perfetto.dev or chrome://tracing)\n", fs::absolute(report.trace).string().c_str());
  // A stop asked for while the trace was written (seconds, for 1000 steps): the profile was done,
  // and is kept, but the command says it was stopped (it ended 0 after "stopping", a probe).
  if (const int sig = core::stop_signal_received(); sig != 0 && sig != SIGPIPE)
    throw core::StoppedBySignal(sig, "loom profile: stopped by " + core::signal_name(sig) + " as its trace was written, which it " +
                                         (report.trace_error.empty() ? "finished: the report above and the trace are whole"
                                                                     : "could not place (said above): the report above is whole"));
  return report.trace_error.empty() ? 0 : 1;
}

}  // namespace loom::cli
