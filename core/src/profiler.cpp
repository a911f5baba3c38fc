// The profiler. See profiler.hpp.
#include <loom/core/error.hpp>
#include <loom/core/profiler.hpp>
#include <loom/core/stop_signals.hpp>
#include <loom/core/text.hpp>

#include <torch/csrc/autograd/profiler_kineto.h>

#if LOOM_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <unordered_map>
#include <sys/resource.h>
#include <unistd.h>

namespace loom::core {

namespace {

namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

// The CUDA runtime calls that block the host until the device has caught up.
bool is_host_sync(const std::string& name) {
  return name == "cudaStreamSynchronize" || name == "cudaDeviceSynchronize" || name == "cudaEventSynchronize" ||
         name == "cudaMemcpy" || name == "cuStreamSynchronize" || name == "cuCtxSynchronize";
}

std::set<ActivityType> activities_for(const c10::Device& device) {
  std::set<ActivityType> out{ActivityType::CPU};
  if (device.is_cuda()) out.insert(ActivityType::CUDA);
  return out;
}

ProfilerConfig config(const ProfileOptions& options) {
  return ProfilerConfig(ProfilerState::KINETO, /*report_input_shapes=*/options.shapes, /*profile_memory=*/options.memory);
}

bool is_phase(const std::string& name) { return name.rfind("loom::", 0) == 0; }

// An allocation (bytes > 0) or a free (< 0), as the profiler records them: an instant on a thread.
bool is_memory(const std::string& name) { return name == "[memory]"; }

struct Span {
  const torch::autograd::profiler::KinetoEvent* event;
  uint64_t start, end;
};

/// "aten::mm [2048, 96], [96, 288]": the operator and its inputs' shapes ([] for a scalar or a
/// value that is not a tensor), as torch.profiler's table groups them by input shape.
std::string with_shapes(const torch::autograd::profiler::KinetoEvent& e) {
  std::string out = e.name();
  if (!e.hasShapes()) return out;
  const auto shapes = e.shapes();
  for (size_t i = 0; i < shapes.size(); ++i) {
    out += i == 0 ? " [" : ", [";
    for (size_t d = 0; d < shapes[i].size(); ++d) out += (d ? ", " : "") + std::to_string(shapes[i][d]);
    out += "]";
  }
  return out;
}

ProfileRow& add(std::map<std::string, ProfileRow>& rows, const std::string& name, double self_us, double total_us) {
  ProfileRow& row = rows[name];
  row.name = name;
  ++row.calls;
  row.self_us += self_us;
  row.total_us += total_us;
  return row;
}

template <class Key>
std::vector<ProfileRow> sorted(std::map<std::string, ProfileRow>& rows, Key key) {
  std::vector<ProfileRow> out;
  for (auto& [name, row] : rows) out.push_back(std::move(row));
  std::stable_sort(out.begin(), out.end(), [&](const ProfileRow& a, const ProfileRow& b) { return key(a) > key(b); });
  return out;
}

std::vector<ProfileRow> sorted_by_self(std::map<std::string, ProfileRow>& rows) {
  return sorted(rows, [](const ProfileRow& r) { return r.self_us; });
}

}  // namespace

Profiler::Profiler(const c10::Device& device, ProfileOptions options) : device_(device), options_(options) {
  if (torch::profiler::impl::profilerEnabled())
    throw Error("a profiler is already running in this process; one profile at a time");
  const auto activities = activities_for(device);
  // Off a GPU, Kineto's first use asks the CUDA runtime how many GPUs there are and prints
  // "ERROR: ... gpuGetDeviceCount failed with code 35" when there is no driver: a CPU profile
  // needs no GPU, so its logging is off there, unless the user set a level. (6, not torchtitan's 5:
  // the Kineto of torch 2.15 prints "USDT:... profiler_start" and "profiler_stop" at level 5.)
  if (!device.is_cuda()) ::setenv("KINETO_LOG_LEVEL", "6", /*overwrite=*/0);
  kineto::prepareProfiler(config(options_), activities);
  kineto::enableProfiler(config(options_), activities);
  running_ = true;
}

Profiler::~Profiler() {
  if (!running_) return;
  try {
    kineto::disableProfiler();
  } catch (...) {  // a destructor during unwinding: the profile is dropped
  }
}

ProfileReport Profiler::stop(const std::filesystem::path& given, bool next_free) {
  if (!running_) throw Error("the profiler was already stopped");
  running_ = false;
#if LOOM_TORCH_CUDA
  if (device_.is_cuda()) c10::cuda::device_synchronize();  // the kernels still queued belong to the profile
#endif
  const auto steps_done = std::chrono::steady_clock::now();
  std::unique_ptr<kineto::ProfilerResult> result = kineto::disableProfiler();
  if (!result) throw Error("the profiler returned no result");
  // The profiler writes <path>.tmp and renames it: given the trace's own path, it replaced a file
  // of the user's of that name. It writes under a name of this process's, renamed to the trace.
  namespace fs = std::filesystem;
  fs::path trace = given;
  const fs::path own = trace.string() + ".loom-" + std::to_string(::getpid()) + ".json";
  note_scratch_file(own.string());  // (a stop at once while it is written removes it and its .tmp: 96 MB were left)
  result->save(own.string());
  std::error_code ec;
  // (link, then unlink: a trace made at that path since the command checked it is not replaced;
  // a name Loom chose moves on to the next free one: two profiles started in one second)
  const bool written = fs::is_regular_file(own, ec);
  bool placed = written && ::link(own.c_str(), trace.c_str()) == 0;
  int error = placed ? 0 : written ? errno : EIO;  // (not written: no link ran, errno is another call's)
  // (a name given that was taken while the profile ran, by a file left as it is: the trace is not
  // thrown away, it takes the next free name, and the command still says it could not be placed)
  for (int n = 2; !placed && error == EEXIST && n < 1000; ++n) {
    trace = given.parent_path() / (given.stem().string() + "-" + std::to_string(n) + given.extension().string());
    placed = ::link(own.c_str(), trace.c_str()) == 0;
    error = placed ? 0 : errno;
  }
  if (placed) fs::remove(own, ec);
  if (!placed) trace = given;  // (the error names the path asked for, not the last name tried)
  note_scratch_file("");
  std::string trace_error;
  if (placed && !next_free && trace != given)
    trace_error = "the profiler could not write its trace to " + given.string() + ": a file of that name appeared while it ran; "
                  "it is left as it is, and the trace is " + trace.string() + " instead";
  if (!placed) {
    // (the partial file's size says what the trace needed at least, on a full disk)
    std::uintmax_t partial = 0;
    for (const fs::path& file : {own, fs::path(own.string() + ".tmp")})
      if (const auto n = fs::file_size(file, ec); !ec) partial = std::max(partial, n);
    fs::remove(own, ec);
    fs::remove(own.string() + ".tmp", ec);
    const fs::space_info space = fs::space(trace.has_parent_path() ? trace.parent_path() : fs::path("."), ec);
    // (under `ulimit -f` the file-size limit stopped it, not the disk: "73.6 GiB free there", a probe)
    rlimit size_limit{};
    const bool limited = ::getrlimit(RLIMIT_FSIZE, &size_limit) == 0 && size_limit.rlim_cur != RLIM_INFINITY &&
                         partial > 0 && partial + 65536 >= size_limit.rlim_cur;
    trace_error = "the profiler could not write its trace to " + trace.string() +
                  (error == EEXIST ? std::string(": a file of that name appeared while it ran; it is left as it is")
                   : limited       ? " (it reached the file-size limit of this process, `ulimit -f`, " +
                                   format_bytes(static_cast<int64_t>(size_limit.rlim_cur)) +
                                   ": raise it, or lift it with `ulimit -f unlimited`)"
                   : ec           ? std::string()
                                  : " (" + format_bytes(static_cast<int64_t>(space.available)) + " free there" +
                                        (partial > 0
                                             ? ", and it needed more than the " + format_bytes(static_cast<int64_t>(partial)) +
                                                   " it had written"
                                             : std::string()) + ")") +
                  "; nothing of this profile was left there";
  }

  // Self time: on each thread, CPU events nest by time; an event's self time is its duration
  // less its direct children's.
  std::unordered_map<uint64_t, std::vector<Span>> by_thread;
  std::map<std::string, ProfileRow> operators, kernels, phases;
  std::map<std::string, uint64_t> phase_first;
  ProfileReport report;
  report.memory = options_.memory;
  report.trace_error = trace_error;
  report.trace = trace;
  report.steps_done = steps_done;
  std::map<std::string, ProfileRow> syncs;
  for (const auto& e : result->events()) {
    if (is_memory(e.name())) {  // on the thread that allocated, whatever the device: nests like an operator
      if (e.nBytes() > 0) report.allocated_bytes += e.nBytes();
      by_thread[e.startThreadId()].push_back({&e, e.startNs(), e.startNs()});
      continue;
    }
    if (e.deviceType() != c10::DeviceType::CPU) {
      // Kineto mirrors each user range on the device's timeline (gpu_user_annotation): a phase
      // there spans kernels, it is not one.
      if (is_phase(e.name())) continue;
      const double us = static_cast<double>(e.durationNs()) / 1e3;
      add(kernels, e.name(), us, us);
      report.kernels_us += us;
      continue;
    }
    if (is_host_sync(e.name())) {
      const double us = static_cast<double>(e.durationNs()) / 1e3;
      add(syncs, e.name(), us, us);
      ++report.host_sync_count;
    }
    by_thread[e.startThreadId()].push_back({&e, e.startNs(), e.endNs()});
  }
  for (auto& [thread, spans] : by_thread) {
    std::sort(spans.begin(), spans.end(),
              [](const Span& a, const Span& b) { return a.start != b.start ? a.start < b.start : a.end > b.end; });
    std::vector<double> self(spans.size());
    std::vector<int64_t> allocated(spans.size()), allocations(spans.size());
    std::vector<size_t> stack;
    for (size_t i = 0; i < spans.size(); ++i) {
      // (an allocation at the very end of an operator is still its own)
      while (!stack.empty() && (spans[stack.back()].end < spans[i].start ||
                                (spans[stack.back()].end == spans[i].start && !is_memory(spans[i].event->name()))))
        stack.pop_back();
      if (is_memory(spans[i].event->name())) {
        // the innermost operator around it allocated it (a phase is not an operator)
        size_t owner = stack.size();
        while (owner > 0 && is_phase(spans[stack[owner - 1]].event->name())) --owner;
        if (owner > 0 && spans[i].event->nBytes() > 0) {
          allocated[stack[owner - 1]] += spans[i].event->nBytes();
          ++allocations[stack[owner - 1]];
        }
        continue;
      }
      const double us = static_cast<double>(spans[i].end - spans[i].start) / 1e3;
      self[i] = us;
      // A phase is not an operator: time an operator spends inside a phase stays its own.
      if (!stack.empty() && !is_phase(spans[i].event->name())) {
        size_t parent = stack.size();
        while (parent > 0 && is_phase(spans[stack[parent - 1]].event->name())) --parent;
        if (parent > 0) self[stack[parent - 1]] -= us;
      }
      stack.push_back(i);
    }
    for (size_t i = 0; i < spans.size(); ++i) {
      const std::string name = spans[i].event->name();
      if (is_memory(name)) continue;
      const double total = static_cast<double>(spans[i].end - spans[i].start) / 1e3;
      if (is_phase(name)) {
        add(phases, name, total, total);
        auto [it, inserted] = phase_first.emplace(name, spans[i].start);
        if (!inserted) it->second = std::min(it->second, spans[i].start);
      } else {
        ProfileRow& row = add(operators, options_.shapes ? with_shapes(*spans[i].event) : name, self[i], total);
        row.allocated_bytes += allocated[i];
        row.allocations += allocations[i];
        report.operators_self_us += self[i];
      }
    }
  }
  if (options_.memory) {
    std::map<std::string, ProfileRow> allocating;
    for (const auto& [name, row] : operators)
      if (row.allocated_bytes > 0) allocating.emplace(name, row);
    report.allocators = sorted(allocating, [](const ProfileRow& r) { return r.allocated_bytes; });
  }
  report.operators = sorted_by_self(operators);
  report.kernels = sorted_by_self(kernels);
  report.host_syncs = sorted_by_self(syncs);
  for (auto& [name, row] : phases) report.phases.push_back(row);
  std::sort(report.phases.begin(), report.phases.end(), [&](const ProfileRow& a, const ProfileRow& b) {
    return phase_first[a.name] < phase_first[b.name];
  });
  return report;
}

std::string format_profile(const ProfileReport& report, size_t top, int64_t steps) {
  const double n = static_cast<double>(std::max<int64_t>(1, steps));
  std::string out;
  char line[512];
  // Names with shapes get a wider column, up to 80 characters.
  int width = 52;
  for (const auto* rows : {&report.operators, &report.allocators})
    for (size_t i = 0; i < rows->size() && i < top; ++i)
      width = std::max(width, static_cast<int>(std::min<size_t>((*rows)[i].name.size(), 80)));
  auto cut = [&](const std::string& name) {
    return name.size() > static_cast<size_t>(width) ? name.substr(0, static_cast<size_t>(width) - 3) + "..." : name;
  };
  auto table = [&](const char* title, const std::vector<ProfileRow>& rows, double total, size_t limit, bool self) {
    if (rows.empty()) return;
    std::snprintf(line, sizeof line, "\n%-*s %8s %12s %8s %12s\n", width, title, "calls", self ? "self ms" : "ms", "%",
                  "ms/step");
    out += line;
    for (size_t i = 0; i < rows.size() && i < limit; ++i) {
      const ProfileRow& r = rows[i];
      const double ms = (self ? r.self_us : r.total_us) / 1e3;
      std::snprintf(line, sizeof line, "%-*s %8lld %12.2f %7.1f%% %12.3f\n", width, cut(r.name).c_str(),
                    static_cast<long long>(r.calls), ms, total > 0 ? 100.0 * ms * 1e3 / total : 0.0, ms / n);
      out += line;
    }
  };
  double step_us = 0;
  for (const auto& p : report.phases)
    if (p.name == "loom::step") step_us = p.total_us;
  table("phase (loom::*, total time; % of loom::step)", report.phases, step_us, report.phases.size(), false);
  table("operator (by self time; % of all operators' self time)", report.operators, report.operators_self_us, top, true);
  table("device kernel or copy (by time)", report.kernels, report.kernels_us, top, true);
  if (report.memory) {
    const double mib = 1024.0 * 1024.0;
    std::snprintf(line, sizeof line, "\n%-*s %8s %12s %8s %12s\n", width,
                  "operator (by memory it allocated itself; % of all allocated)", "allocs", "MiB", "%", "MiB/step");
    out += line;
    for (size_t i = 0; i < report.allocators.size() && i < top; ++i) {
      const ProfileRow& r = report.allocators[i];
      const double bytes = static_cast<double>(r.allocated_bytes);
      std::snprintf(line, sizeof line, "%-*s %8lld %12.2f %7.1f%% %12.3f\n", width, cut(r.name).c_str(),
                    static_cast<long long>(r.allocations), bytes / mib,
                    report.allocated_bytes > 0 ? 100.0 * bytes / static_cast<double>(report.allocated_bytes) : 0.0,
                    bytes / mib / n);
      out += line;
    }
    std::snprintf(line, sizeof line, "%.2f MiB allocated in %lld steps%s\n",
                  static_cast<double>(report.allocated_bytes) / mib, static_cast<long long>(steps),
                  report.allocators.empty() ? " (no allocation inside an operator)" : "");
    out += line;
  }
  if (report.host_sync_count > 0) {
    std::snprintf(line, sizeof line, "\nhost waits for the device: %lld calls in %lld steps (%.1f per step, the last one "
                  "ends the profile)\n", static_cast<long long>(report.host_sync_count), static_cast<long long>(steps),
                  static_cast<double>(report.host_sync_count) / n);
    out += line;
    for (const ProfileRow& r : report.host_syncs) {
      std::snprintf(line, sizeof line, "  %-50s %8lld %12.2f ms\n", r.name.c_str(), static_cast<long long>(r.calls),
                    r.self_us / 1e3);
      out += line;
    }
  }
  return out;
}

}  // namespace loom::core
