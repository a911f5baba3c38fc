// Host logging through spdlog. This translation unit includes no LibTorch header (see log.hpp),
// so spdlog compiles against the fmt it was built with.
#include <loom/core/log.hpp>

#include <loom/sdk/error.hpp>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstring>

namespace loom::core {

namespace {

spdlog::level::level_enum to_spdlog(uint32_t level) {
  return level <= LOOM_LOG_ERROR ? static_cast<spdlog::level::level_enum>(level) : spdlog::level::err;
}

std::shared_ptr<spdlog::logger> logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stderr_color_mt("loom");
    l->set_pattern("%^[%H:%M:%S %L]%$ %v");
    l->set_level(spdlog::level::info);
    return l;
  }();
  return instance;
}

void plugin_log(void* /*context*/, uint32_t level, const char* plugin, const char* message) {
  if (message == nullptr) return;
  const std::string who = plugin != nullptr ? std::string(plugin, ::strnlen(plugin, LOOM_MAX_NAME)) : "plugin";
  logger()->log(to_spdlog(level), "[{}] {}", who, std::string(message, ::strnlen(message, 64 * 1024)));
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

void write(loom_log_level level, const std::string& message) { logger()->log(to_spdlog(level), "{}", message); }

void flush() { logger()->flush(); }

}  // namespace log
}  // namespace loom::core
