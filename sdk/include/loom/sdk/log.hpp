// Logging from a plugin. Plugins do not link the host's logger: their lines go through the
// host_api table the host hands the plugin's init, and the host writes them with the plugin's
// name. Before init (or in a unit test without a host) the lines go to stderr.
//
//   loom::sdk::log::info("loaded ", n, " images from ", path);
//
// Thread-safe as far as the host's log function is (it is).
#pragma once

#include <loom/sdk/abi.h>

#include <cstdio>
#include <sstream>
#include <string>

namespace loom::sdk {

namespace detail {
// One per plugin library (hidden visibility): set by the init that LOOM_PLUGIN emits.
inline const loom_host_api* g_host = nullptr;
inline const char* g_plugin_name = "plugin";
}  // namespace detail

/// The host services, or nullptr before init.
inline const loom_host_api* host_api() { return detail::g_host; }

namespace log {

inline void write(loom_log_level level, const std::string& message) {
  const loom_host_api* host = detail::g_host;
  if (host != nullptr && host->log != nullptr) {
    host->log(host->context, static_cast<uint32_t>(level), detail::g_plugin_name, message.c_str());
  } else if (level >= LOOM_LOG_INFO) {
    std::fprintf(stderr, "[%s] %s\n", detail::g_plugin_name, message.c_str());
  }
}

template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

template <class... Args> void debug(const Args&... a) { write(LOOM_LOG_DEBUG, concat(a...)); }
template <class... Args> void info(const Args&... a) { write(LOOM_LOG_INFO, concat(a...)); }
template <class... Args> void warn(const Args&... a) { write(LOOM_LOG_WARN, concat(a...)); }
template <class... Args> void error(const Args&... a) { write(LOOM_LOG_ERROR, concat(a...)); }

}  // namespace log
}  // namespace loom::sdk
