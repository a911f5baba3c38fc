// The profiler. See profiler.hpp.
#include <loom/core/error.hpp>
#include <loom/core/profiler.hpp>

#include <torch/csrc/autograd/profiler_kineto.h>

#if LOOM_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <unordered_map>

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

ProfilerConfig config() {
  return ProfilerConfig(ProfilerState::KINETO, /*report_input_shapes=*/false, /*profile_memory=*/false);
}

bool is_phase(const std::string& name) { return name.rfind("loom::", 0) == 0; }

struct Span {
  const torch::autograd::profiler::KinetoEvent* event;
  uint64_t start, end;
};

void add(std::map<std::string, ProfileRow>& rows, const std::string& name, double self_us, double total_us) {
  ProfileRow& row = rows[name];
  row.name = name;
  ++row.calls;
  row.self_us += self_us;
  row.total_us += total_us;
}

std::vector<ProfileRow> sorted_by_self(std::map<std::string, ProfileRow>& rows) {
  std::vector<ProfileRow> out;
  for (auto& [name, row] : rows) out.push_back(std::move(row));
  std::sort(out.begin(), out.end(), [](const ProfileRow& a, const ProfileRow& b) { return a.self_us > b.self_us; });
  return out;
}

}  // namespace

Profiler::Profiler(const c10::Device& device) : device_(device) {
  if (torch::profiler::impl::profilerEnabled())
    throw Error("a profiler is already running in this process; one profile at a time");
  const auto activities = activities_for(device);
  kineto::prepareProfiler(config(), activities);
  kineto::enableProfiler(config(), activities);
  running_ = true;
}

Profiler::~Profiler() {
  if (!running_) return;
  try {
    kineto::disableProfiler();
  } catch (...) {  // a destructor during unwinding: the profile is dropped
  }
}

ProfileReport Profiler::stop(const std::filesystem::path& trace) {
  if (!running_) throw Error("the profiler was already stopped");
  running_ = false;
#if LOOM_TORCH_CUDA
  if (device_.is_cuda()) c10::cuda::device_synchronize();  // the kernels still queued belong to the profile
#endif
  std::unique_ptr<kineto::ProfilerResult> result = kineto::disableProfiler();
  if (!result) throw Error("the profiler returned no result");
  result->save(trace.string());
  if (!std::filesystem::is_regular_file(trace))
    throw Error("the profiler did not write its trace to " + trace.string());

  // Self time: on each thread, CPU events nest by time; an event's self time is its duration
  // less its direct children's.
  std::unordered_map<uint64_t, std::vector<Span>> by_thread;
  std::map<std::string, ProfileRow> operators, kernels, phases;
  std::map<std::string, uint64_t> phase_first;
  ProfileReport report;
  std::map<std::string, ProfileRow> syncs;
  for (const auto& e : result->events()) {
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
    std::vector<size_t> stack;
    for (size_t i = 0; i < spans.size(); ++i) {
      while (!stack.empty() && spans[stack.back()].end <= spans[i].start) stack.pop_back();
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
      const double total = static_cast<double>(spans[i].end - spans[i].start) / 1e3;
      if (is_phase(name)) {
        add(phases, name, total, total);
        auto [it, inserted] = phase_first.emplace(name, spans[i].start);
        if (!inserted) it->second = std::min(it->second, spans[i].start);
      } else {
        add(operators, name, self[i], total);
        report.operators_self_us += self[i];
      }
    }
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
  char line[256];
  auto table = [&](const char* title, const std::vector<ProfileRow>& rows, double total, size_t limit, bool self) {
    if (rows.empty()) return;
    std::snprintf(line, sizeof line, "\n%-52s %8s %12s %8s %12s\n", title, "calls", self ? "self ms" : "ms", "%",
                  "ms/step");
    out += line;
    for (size_t i = 0; i < rows.size() && i < limit; ++i) {
      const ProfileRow& r = rows[i];
      const double ms = (self ? r.self_us : r.total_us) / 1e3;
      std::string name = r.name.size() > 52 ? r.name.substr(0, 49) + "..." : r.name;
      std::snprintf(line, sizeof line, "%-52s %8lld %12.2f %7.1f%% %12.3f\n", name.c_str(),
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
