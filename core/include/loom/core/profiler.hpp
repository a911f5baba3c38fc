// Profiling training steps: LibTorch's Kineto profiler (the engine behind torch.profiler) around
// a stretch of the run, Loom's phases of a step as named ranges, a Chrome trace that Perfetto and
// chrome://tracing open, and the operators that cost the most by self time.
#pragma once

#include <ATen/record_function.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

/// A named range of the step ("loom::forward"): a user annotation in the trace. Costs one branch
/// when no profiler runs.
#define LOOM_PHASE(name) RECORD_USER_SCOPE("loom::" name)

namespace loom::core {

struct ProfileRow {
  std::string name;  ///< with ProfileOptions::shapes, an operator's name and its inputs' shapes
  int64_t calls = 0;
  double self_us = 0;   ///< time inside it, less the time of the operators it called
  double total_us = 0;  ///< time from its start to its end
  int64_t allocated_bytes = 0;  ///< with ProfileOptions::memory: allocated by it, not by the operators it called
  int64_t allocations = 0;
};

struct ProfileOptions {
  /// Each operator's rows split by its inputs' shapes ("aten::mm [2048, 96], [96, 288]"), and
  /// the shapes in the trace's events ("Input Dims").
  bool shapes = false;
  /// Every allocation and free on the device ("[memory]" events in the trace, Loom's CPU
  /// allocator included), and the operators that allocate the most.
  bool memory = false;
};

struct ProfileReport {
  std::vector<ProfileRow> operators;  ///< CPU operators and runtime calls, by self time, descending
  std::vector<ProfileRow> phases;     ///< Loom's ranges (loom::*), in the order of the step
  std::vector<ProfileRow> kernels;    ///< device kernels and copies, by time, descending (CUDA)
  double operators_self_us = 0;       ///< sum of the operators' self time
  double kernels_us = 0;
  /// Calls that make the host wait for the device (cudaStreamSynchronize, cudaDeviceSynchronize,
  /// cudaEventSynchronize, blocking cudaMemcpy), by name: each is a stall of the CPU that queues
  /// the next kernels. Includes the one synchronisation that ends the profile.
  std::vector<ProfileRow> host_syncs;
  int64_t host_sync_count = 0;
  /// With ProfileOptions::memory: the operators that allocated, by bytes, descending; and all
  /// bytes allocated in the profile (those outside any operator too).
  std::vector<ProfileRow> allocators;
  int64_t allocated_bytes = 0;
  bool memory = false;
  /// Why the trace could not be written, where it could not (Profiler::stop does not throw for
  /// it): the tables above stand (they were lost with it).
  std::string trace_error;
  std::filesystem::path trace;  ///< where the trace was written (stop's own, or the next free name after it)
  /// When the profiled steps were done (the device's queue drained), before the trace was read and
  /// written: a rate over the steps ends here (it counted writing the trace, 3x too low, probe).
  std::chrono::steady_clock::time_point steps_done;
};

/// Profiles from construction to stop(). One at a time per process; the device's activity
/// (CUDA kernels and copies) is recorded when `device` is a CUDA device.
class Profiler {
 public:
  explicit Profiler(const c10::Device& device, ProfileOptions options = {});
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  /// Stops, writes the Chrome trace to `trace` and returns the tables.
  /// `next_free`: where a file of the trace's name appeared while it ran, the trace takes the next
  /// free name, <stem>-2<ext>, -3, ... (a name Loom chose, not one the user gave).
  ProfileReport stop(const std::filesystem::path& trace, bool next_free = false);

 private:
  c10::Device device_;
  ProfileOptions options_;
  bool running_ = false;
};

/// The phases per step and the `top` operators (and kernels, and allocating operators), as text tables.
std::string format_profile(const ProfileReport& report, size_t top, int64_t steps);

}  // namespace loom::core
