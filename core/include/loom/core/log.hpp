// Host logging. spdlog writes every line; this facade keeps spdlog (and the fmt it needs, which
// clashes with the newer fmt inside LibTorch's headers) out of every translation unit but
// log.cpp. Lines are built by streaming the arguments, as plugins do through the SDK:
//
//   log::info("plan: batch ", plan.global(), " = ", plan.micro_batch, " x ", plan.accumulation);
//
// Plugins log through the host_api table, which lands here with the plugin's name.
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/log.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace loom::core {

/// Sets up the process logger: stderr, coloured when it is a terminal. `level` is one of trace,
/// debug, info, warn, error, off; anything else throws loom::Error naming the choices.
void init_logging(const std::string& level = "info");

/// The host_api table handed to every plugin's init.
const loom_host_api* host_api();

namespace log {

bool enabled(loom_log_level level);
void write(loom_log_level level, const std::string& message);
/// Writes pending lines (before the process exits or hands the terminal to a progress line).
void flush();

/// A process of a multi-process job: its lines carry "rank R" after the time, and ranks other
/// than 0 keep only warnings and errors (unless the level asked is debug or trace), so a job's
/// console reads as one run's with each rank's problems.
void set_rank(int64_t rank, int64_t world_size);

/// While alive (and active), only errors are written: the warnings of a step another process has
/// said already (the configuration's, which `loom launch` checked before starting the ranks).
class Quiet {
 public:
  explicit Quiet(bool active);
  ~Quiet();
  Quiet(const Quiet&) = delete;
  Quiet& operator=(const Quiet&) = delete;

 private:
  int previous_ = -1;  // the logger's level before, where active
};

/// While alive, also keeps every line written at `level` or above (the host's lines that pass the
/// logger's level, and every plugin's), for tests and for callers that quote a component.
/// One capture at a time per process; not thread-safe to create concurrently.
class Capture {
 public:
  explicit Capture(loom_log_level level = LOOM_LOG_INFO);
  ~Capture();
  Capture(const Capture&) = delete;
  Capture& operator=(const Capture&) = delete;
  /// The lines so far, in order ("[oom_recovery] out of memory at step 1: ...").
  std::vector<std::string> lines() const;
  /// Whether any line contains `text`.
  bool contains(const std::string& text) const;
};

template <class... Args> void trace(const Args&... a) { if (enabled(LOOM_LOG_TRACE)) write(LOOM_LOG_TRACE, sdk::log::concat(a...)); }
template <class... Args> void debug(const Args&... a) { if (enabled(LOOM_LOG_DEBUG)) write(LOOM_LOG_DEBUG, sdk::log::concat(a...)); }
template <class... Args> void info(const Args&... a) { if (enabled(LOOM_LOG_INFO)) write(LOOM_LOG_INFO, sdk::log::concat(a...)); }
template <class... Args> void warn(const Args&... a) { if (enabled(LOOM_LOG_WARN)) write(LOOM_LOG_WARN, sdk::log::concat(a...)); }
template <class... Args> void error(const Args&... a) { if (enabled(LOOM_LOG_ERROR)) write(LOOM_LOG_ERROR, sdk::log::concat(a...)); }

}  // namespace log
}  // namespace loom::core
