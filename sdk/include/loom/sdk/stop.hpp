// Whether the user asked Loom to stop while a run sets up: for a plugin's long work there (a
// model that encodes thousands of texts as it sets up or in the memory probes' first forward),
// which the host cannot interrupt itself. Training and evaluation are stopped by the host between
// steps and batches, so outside a run's set-up this says false.
//
//   for (int64_t start = 0; start < n; start += chunk) {
//     if (loom::sdk::stop_requested()) throw loom::sdk::Error("my_model: stopped while encoding");
//     ...
//   }
//
// Where set-up throws after a stop was asked, the host reports the stop (exit 128 + the signal),
// not the plugin's failure. Lives in libloom_sdk since SDK 0.1 of this stop (a plugin that calls it
// needs a host at least as new).
#pragma once

#include <loom/sdk/error.hpp>

#include <atomic>

namespace loom::sdk {

/// True once the host received a stop signal (SIGINT, SIGTERM) while a run sets up; false
/// otherwise, and in a process without Loom's host (a plugin's own unit test).
LOOM_SDK_API bool stop_requested() noexcept;

namespace detail {
/// The host's flag (nonzero: the signal received) while a run sets up, nullptr after; not for plugins.
LOOM_SDK_API void set_stop_flag(const std::atomic<int>* flag) noexcept;
}  // namespace detail

}  // namespace loom::sdk
