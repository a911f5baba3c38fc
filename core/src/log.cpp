// Host logging through spdlog. This translation unit includes no LibTorch header (see log.hpp),
// so spdlog compiles against the fmt it was built with.
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>

#include <loom/sdk/error.hpp>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <unistd.h>

namespace loom::core {

namespace {

spdlog::level::level_enum to_spdlog(uint32_t level) {
  return level <= LOOM_LOG_ERROR ? static_cast<spdlog::level::level_enum>(level) : spdlog::level::err;
}

std::shared_ptr<spdlog::logger> logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stderr_color_mt("loom");
    // On a terminal a line first clears the one it is written over: the progress callback's live
    // line, redrawn at its next update.
    l->set_pattern(std::string(::isatty(STDERR_FILENO) ? "\r\033[2K" : "") + "%^[%H:%M:%S %L]%$ %v");
    l->set_level(spdlog::level::info);
    return l;
  }();
  return instance;
}

// See log::Capture.
std::mutex capture_mutex;
std::vector<std::string>* captured = nullptr;
uint32_t capture_level = LOOM_LOG_INFO;

void keep(uint32_t level, const std::string& line) {
  std::lock_guard<std::mutex> lock(capture_mutex);
  if (captured != nullptr && level >= capture_level) captured->push_back(line);
}

/// A line as the terminal shows it: each control character but the line break and the tab a '?'
/// (without_controls). A plugin's text (its describe(), an error's message, a log line) with an
/// escape set the terminal's colours, or a carriage return wrote over Loom's own line.
std::string shown(std::string text) { return without_controls(std::move(text), '?', true); }

void plugin_log(void* /*context*/, uint32_t level, const char* plugin, const char* message) {
  if (message == nullptr) return;
  const std::string who = shown(plugin != nullptr ? std::string(plugin, ::strnlen(plugin, LOOM_MAX_NAME)) : "plugin");
  const std::string text = shown(std::string(message, ::strnlen(message, 64 * 1024)));
  keep(level, "[" + who + "] " + text);
  logger()->log(to_spdlog(level), "[{}] {}", who, text);
}

const loom_host_api kHostApi{sizeof(loom_host_api), LOOM_ABI_MAJOR, LOOM_ABI_MINOR, nullptr,
                             &plugin_log};

}  // namespace

void init_logging(const std::string& level) {
  const auto lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off")
    throw sdk::Error("log level '" + level + "' is not one of trace, debug, info, warn, error, off");
  logger()->set_level(lvl);
}

const loom_host_api* host_api() { return &kHostApi; }

namespace log {

bool enabled(loom_log_level level) { return logger()->should_log(to_spdlog(level)); }

void write(loom_log_level level, const std::string& message) {
  keep(level, message);
  logger()->log(to_spdlog(level), "{}", shown(message));
}

void flush() { logger()->flush(); }

void set_rank(int64_t rank, int64_t world_size) {
  if (world_size <= 1) return;
  const auto l = logger();
  l->set_pattern(std::string(::isatty(STDERR_FILENO) ? "\r\033[2K" : "") + "%^[%H:%M:%S %L rank " +
                 std::to_string(rank) + "]%$ %v");
  if (rank != 0 && l->level() > spdlog::level::debug && l->level() < spdlog::level::warn) l->set_level(spdlog::level::warn);
}

Quiet::Quiet(bool active) {
  if (!active || logger()->level() >= spdlog::level::err) return;
  previous_ = static_cast<int>(logger()->level());
  logger()->set_level(spdlog::level::err);
}

Quiet::~Quiet() {
  if (previous_ >= 0) logger()->set_level(static_cast<spdlog::level::level_enum>(previous_));
}

Capture::Capture(loom_log_level level) {
  std::lock_guard<std::mutex> lock(capture_mutex);
  if (captured != nullptr) throw sdk::Error("internal: a log capture is already active");
  captured = new std::vector<std::string>();
  capture_level = level;
}

Capture::~Capture() {
  std::lock_guard<std::mutex> lock(capture_mutex);
  delete captured;
  captured = nullptr;
}

std::vector<std::string> Capture::lines() const {
  std::lock_guard<std::mutex> lock(capture_mutex);
  return captured != nullptr ? *captured : std::vector<std::string>{};
}

bool Capture::contains(const std::string& text) const {
  for (const auto& line : lines())
    if (line.find(text) != std::string::npos) return true;
  return false;
}

}  // namespace log
}  // namespace loom::core
