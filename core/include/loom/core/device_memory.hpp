// Device memory: one interface (sdk::DeviceMemory) over CUDA and CPU.
//
// CUDA: the caching allocator's statistics, cudaMemGetInfo, setMemoryFraction, emptyCache, and
// memory snapshots for pytorch.org/memory_viz.
//
// CPU: a budget allocator installed with c10::SetCPUAllocator counts the live bytes of every
// CPU tensor allocated after it is installed, keeps the peak, and throws c10::OutOfMemoryError
// past a byte budget, exactly where the CUDA allocator would. `--device-memory-limit 2GiB` makes
// the CPU behave as a device with 2 GiB, which is how every memory policy is tested in CI. What
// it cannot see: tensors made before it is installed, and memory libraries allocate on their
// own (oneDNN scratch, OpenMP stacks); see docs/memory.md.
#pragma once

#include <loom/sdk/memory_policy.hpp>

#include <filesystem>
#include <memory>
#include <string>

namespace loom::core {

/// The DeviceMemory of `device` (CPU or CUDA). On CPU the first call installs the counting
/// allocator (process-wide, for the rest of the process), and every call sets its budget to
/// `cpu_limit` (0: none): one budget per process, the newest run's.
std::unique_ptr<sdk::DeviceMemory> make_device_memory(const c10::Device& device, int64_t cpu_limit = 0);

/// Installs the CPU counting allocator if it is not yet installed; safe to call repeatedly.
void install_cpu_allocator();

/// While alive, CPU tensors this thread allocates are host memory (a dataset held in RAM), not
/// the emulated device's: the CPU budget neither counts nor limits them. On a GPU such data
/// lives in host memory too, so this keeps CPU emulation honest.
class HostMemoryScope {
 public:
  HostMemoryScope();
  ~HostMemoryScope();
  HostMemoryScope(const HostMemoryScope&) = delete;
  HostMemoryScope& operator=(const HostMemoryScope&) = delete;
};

/// Starts recording allocation history on a CUDA device (for memory snapshots). No-op elsewhere.
void start_memory_history(const c10::Device& device);

/// Writes a memory snapshot (a pickle for https://pytorch.org/memory_viz) of a CUDA device.
/// Throws loom::Error on CPU, or when the build has no CUDA.
void write_memory_snapshot(const c10::Device& device, const std::filesystem::path& path);

/// Physical memory of this machine and what the kernel reports available, in bytes.
/// "cpu", or "cuda:0 (NVIDIA H100 80GB HBM3, 85029158912 bytes)": names a device model, for caches.
std::string device_description(const c10::Device& device);

/// Both within the process's cgroup (a container's memory limit), where it sets one.
int64_t physical_memory();
int64_t available_memory();

/// The memory limit and usage of the process's cgroup (v2, or v1's memory controller) under
/// `root` (a test's fake tree); -1 where none is set or readable.
struct CgroupMemory {
  int64_t limit = -1, usage = -1;
};
CgroupMemory cgroup_memory(const std::filesystem::path& root = "/");

}  // namespace loom::core
