// Device memory for CUDA and CPU. See device_memory.hpp.
#include <loom/core/device_memory.hpp>
#include <loom/core/error.hpp>
#include <loom/core/files.hpp>
#include <loom/core/text.hpp>

#include <ATen/DeviceAccelerator.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#if LOOM_TORCH_CUDA
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <sys/resource.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace loom::core {

namespace {

// Note [Freed tensors stay in the heap]
// c10::alloc_cpu is glibc's posix_memalign. glibc maps a block above its mmap threshold (128 KiB
// at first, then raised to the largest such block freed) with mmap and unmaps it when freed, and
// gives the heap's free top back to the system above the trim threshold. A training step frees
// and allocates the same activations every step: where they land above those thresholds, each
// step maps them afresh and the kernel zeroes and faults in every page. Which way a run goes
// depends on the order of its first allocations: the default job took 2163 page faults per step
// (8.4 MiB) in one run and none in the next (`/usr/bin/time` over 60 and 160 steps). Fixed
// thresholds (the largest mmap threshold glibc accepts, 32 MiB, and a trim threshold of
// 512 MiB) keep freed blocks in the heap for the next step: none in every run. Blocks of
// 32 MiB and more are still mapped. A process that sets its own (GLIBC_TUNABLES,
// MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_) keeps them.
/// Blocks of this size and more are mapped afresh from the kernel (keep_freed_blocks_in_the_heap
/// set it; 0 where the process set its own thresholds): none of them comes from the heap's freed
/// blocks, so the host's available memory is what one can have (Note [Host memory left]).
constexpr int64_t kMappedBlock = int64_t{32} << 20;
int64_t mapped_from = 0;

void keep_freed_blocks_in_the_heap() {
#if defined(__GLIBC__)
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  const bool own = std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr || std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr ||
                   (tunables != nullptr && (std::strstr(tunables, "mmap_threshold") || std::strstr(tunables, "trim_threshold")));
  if (own) return;
  ::mallopt(M_MMAP_THRESHOLD, kMappedBlock);
  ::mallopt(M_TRIM_THRESHOLD, 512 << 20);
  mapped_from = kMappedBlock;
#endif
}

bool host_can_hold(int64_t bytes, int64_t& left);

// Note [Host memory left]
// Linux lends memory it does not have (overcommit): a CPU run without --device-memory-limit whose
// model or batch is more than the host holds (gpt2_lm over a vocabulary of 10M: 20 GB of logits on
// 24 GB) got every block it asked for, and the kernel's OOM killer ended the process when the pages
// were touched: no message, no recovery. A block the kernel maps afresh that is more than the
// host's memory left (available, with free swap; the container's limit where lower) is refused
// here as an out-of-memory, which oom_recovery replans and the run otherwise names with advice.
// Smaller blocks come from the heap's freed ones, which the host's figures do not count.
[[noreturn]] void host_out_of_memory(int64_t bytes, int64_t left, const std::string& why) {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory: tried to allocate ", format_bytes(bytes), " with ",
                   left >= 0 ? format_bytes(left) : std::string("less"), " of the host's memory left", why,
                   "; lower the batch size or the model's size, or give the run --device-memory-limit to plan within it");
}

// Note [CPU budget allocator]
// Every CPU tensor's storage goes through c10::GetCPUAllocator(). This allocator replaces it
// (c10::SetCPUAllocator, priority 1): it allocates with c10::alloc_cpu like the default one,
// remembers each block's size in a header in front of it (Note [Size in a header]), counts live bytes and their peak, and throws
// c10::OutOfMemoryError when a budget would be exceeded, as the CUDA caching allocator does.
// It lives for the whole process (deleters may run at exit); a block allocated before it was
// installed keeps the default allocator's deleter and is never counted.
class BudgetAllocator final : public c10::Allocator {
 public:
  static BudgetAllocator& instance() {
    static BudgetAllocator* allocator = [] {
      keep_freed_blocks_in_the_heap();
      auto* a = new BudgetAllocator();  // never destroyed: deleters may run during exit
      c10::SetCPUAllocator(a, /*priority=*/1);
      return a;
    }();
    return *allocator;
  }

  c10::DataPtr allocate(size_t n) override {
    if (n > std::numeric_limits<size_t>::max() / 2)
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU device out of memory: tried to allocate ", n, " bytes");
    if (host_scope_depth > 0) {
      // Host memory (a dataset held in RAM, the loader's batches): not the emulated device's, not
      // counted. It has the header too, marked (kHost), so that release() -- raw_deleter(), which
      // raw_deallocate uses whatever the scope was at allocation -- frees it right.
      if (n == 0) return {nullptr, nullptr, &release, c10::Device(c10::kCPU)};
      void* base = c10::alloc_cpu(n + kHeader);
      *static_cast<size_t*>(base) = n | kHost;
      void* p = static_cast<char*>(base) + kHeader;
      return {p, p, &release, c10::Device(c10::kCPU)};
    }
    if (n == 0) return {nullptr, nullptr, &release, c10::Device(c10::kCPU)};
    const int64_t bytes = static_cast<int64_t>(n);
    // Reserve the bytes only if they fit: a compare-and-swap, so an attempt that fails never
    // shows in the count another thread checks against the budget.
    int64_t before = allocated_.load(std::memory_order_relaxed);
    do {
      const int64_t budget = budget_.load(std::memory_order_relaxed);
      if (budget > 0 && before + bytes > budget) {
        ooms_.fetch_add(1);
        TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU device out of memory (Loom's --device-memory-limit): tried to allocate ",
                         format_bytes(bytes), "; ", format_bytes(before), " of the ", format_bytes(budget),
                         " budget already in use");
      }
    } while (!allocated_.compare_exchange_weak(before, before + bytes, std::memory_order_relaxed));
    void* base = nullptr;
    try {
      if (int64_t left = 0; mapped_from > 0 && bytes >= mapped_from && !host_can_hold(bytes, left))
        host_out_of_memory(bytes, left, " (available, with free swap and the heap's freed bytes)");
      base = c10::alloc_cpu(n + kHeader);
    } catch (const c10::OutOfMemoryError&) {
      allocated_.fetch_sub(bytes, std::memory_order_relaxed);
      ooms_.fetch_add(1);
      throw;
    } catch (const c10::Error&) {  // the host itself refused the block (ulimit -v, no overcommit): an out-of-memory too
      allocated_.fetch_sub(bytes, std::memory_order_relaxed);
      ooms_.fetch_add(1);
      host_out_of_memory(bytes, -1, " (the system refused the block: a ulimit -v, or overcommit off)");
    } catch (...) {  // (a std::bad_alloc reading the host's figures: the reservation given back all the same)
      allocated_.fetch_sub(bytes, std::memory_order_relaxed);
      throw;
    }
    // Note [Size in a header]: the block's size lives in front of it, so that freeing needs no
    // lock and no map (this allocator is on every tensor's path). The data stays aligned as
    // alloc_cpu aligns (kHeader is a multiple of its alignment) and data == context, as
    // Allocator::raw_allocate requires.
    *static_cast<size_t*>(base) = n;
    void* p = static_cast<char*>(base) + kHeader;
    const int64_t now = before + bytes;
    int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    // `loom profile --memory` (the profiler's memory events, as the default CPU allocator reports them)
    if (c10::memoryProfilingEnabled())
      c10::reportMemoryUsageToProfiler(p, bytes, static_cast<size_t>(now), static_cast<size_t>(now), c10::Device(c10::kCPU));
    return {p, p, &release, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  static inline thread_local int host_scope_depth = 0;

  int64_t allocated() const { return allocated_.load(); }
  int64_t peak() const { return peak_.load(); }
  int64_t budget() const { return budget_.load(); }
  int64_t ooms() const { return ooms_.load(); }
  void set_budget(int64_t bytes) { budget_.store(bytes); }
  void reset_peak() { peak_.store(allocated_.load()); }

 private:
  static constexpr size_t kHeader = 64;
  /// The header's mark of a host block (HostMemoryScope): sizes stay far below it (allocate
  /// refuses more than half the address space).
  static constexpr size_t kHost = size_t{1} << (sizeof(size_t) * 8 - 1);
  static_assert(kHeader % c10::gAlignment == 0);

  static void release(void* p) {
    if (p == nullptr) return;
    void* base = static_cast<char*>(p) - kHeader;
    if (const size_t stored = *static_cast<size_t*>(base); (stored & kHost) != 0) {  // never counted
      c10::free_cpu(base);
      return;
    }
    const auto bytes = static_cast<int64_t>(*static_cast<size_t*>(base));
    const int64_t after = instance().allocated_.fetch_sub(bytes, std::memory_order_relaxed) - bytes;
    if (c10::memoryProfilingEnabled())
      c10::reportMemoryUsageToProfiler(p, -bytes, static_cast<size_t>(after), static_cast<size_t>(after), c10::Device(c10::kCPU));
    c10::free_cpu(base);
  }

  std::atomic<int64_t> allocated_{0}, peak_{0}, budget_{0}, ooms_{0};
};

int64_t meminfo(const char* field) {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == field) return kib * 1024;
  return -1;
}

class CpuMemory final : public sdk::DeviceMemory {
 public:
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  sdk::MemoryStats stats() const override {
    const BudgetAllocator& a = BudgetAllocator::instance();
    sdk::MemoryStats s;
    const int64_t budget = a.budget();
    s.total = budget > 0 ? budget : physical_memory();
    s.free = budget > 0 ? budget - a.allocated() : available_memory();
    s.allocated = a.allocated();
    s.reserved = a.allocated();  // no cache: what is allocated is what is held
    s.peak = a.peak();
    s.limit = budget > 0 ? budget : -1;
    s.ooms = a.ooms();
    return s;
  }
  void reset_peak() override { BudgetAllocator::instance().reset_peak(); }
  void set_limit(int64_t bytes) override { BudgetAllocator::instance().set_budget(bytes > 0 ? bytes : 0); }
  void empty_cache() override {}
};

#if LOOM_TORCH_CUDA
class CudaMemory final : public sdk::DeviceMemory {
 public:
  explicit CudaMemory(c10::Device device) : device_(device) {}
  c10::Device device() const override { return device_; }
  sdk::MemoryStats stats() const override {
    sdk::MemoryStats s;
    const auto [free, total] = at::accelerator::getMemoryInfo(device_.index());
    const auto d = at::accelerator::getDeviceStats(device_.index());
    s.total = static_cast<int64_t>(total);
    s.free = static_cast<int64_t>(free);
    s.allocated = static_cast<int64_t>(d.allocated_bytes[0].current);
    s.reserved = static_cast<int64_t>(d.reserved_bytes[0].current);
    s.peak = static_cast<int64_t>(d.allocated_bytes[0].peak);
    s.alloc_retries = static_cast<int64_t>(d.num_alloc_retries);
    s.ooms = static_cast<int64_t>(d.num_ooms);
    const double fraction = c10::cuda::CUDACachingAllocator::getMemoryFraction(device_.index());
    s.limit = fraction > 0 && fraction < 1 ? static_cast<int64_t>(fraction * static_cast<double>(total)) : -1;
    return s;
  }
  void reset_peak() override { at::accelerator::resetPeakStats(device_.index()); }
  void set_limit(int64_t bytes) override {
    const auto [free, total] = at::accelerator::getMemoryInfo(device_.index());
    (void)free;
    const double fraction = bytes > 0 ? std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total)) : 1.0;
    // The caching allocator exists only once CUDA is initialised (the first CUDA tensor does it);
    // a cap set before that is refused with "Allocator not initialized for device".
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, device_.index());
  }
  void empty_cache() override { at::accelerator::emptyCache(); }

 private:
  c10::Device device_;
};
#endif

}  // namespace

std::string device_description(const c10::Device& device) {
#if LOOM_TORCH_CUDA
  if (device.is_cuda()) {
    const auto* p = at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index());
    return device.str() + " (" + p->name + ", " + std::to_string(p->totalGlobalMem) + " bytes)";
  }
#endif
  return device.str();
}

namespace {

/// The first number in the file `path`, or -1 ("max", missing, unreadable).
int64_t number_in(const std::filesystem::path& path) {
  std::ifstream in(path);
  int64_t v = -1;
  return in >> v && v >= 0 ? v : -1;
}

}  // namespace

namespace {

/// Where the process's cgroup keeps its usage, and its limit (-1: none), found once per root.
struct CgroupFiles {
  int64_t limit = -1;
  std::filesystem::path usage, stat;
  const char* inactive = "inactive_file";
};

CgroupFiles cgroup_files(const std::filesystem::path& root) {
  // The process's group from /proc/self/cgroup: v2's "0::/job.slice/step", v1's memory controller
  // "4:memory:/slurm/job_1". The limit is the smallest of the group's and its ancestors' (a job's
  // limit holds for its steps); the usage is the group's, less the page cache the kernel reclaims
  // first (inactive_file), or the start-up report's "free" would read near 0 after reading files.
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string v2, v1;
  std::ifstream self(root / "proc/self/cgroup");
  for (std::string line; std::getline(self, line);) {
    if (line.rfind("0::", 0) == 0) v2 = line.substr(3);
    const auto colon = line.find(':');
    if (colon != std::string::npos && line.compare(colon, 8, ":memory:") == 0) v1 = line.substr(colon + 8);
  }
  const bool is_v2 = fs::exists(root / "sys/fs/cgroup/memory.max", ec) ||
                     (!v2.empty() && fs::exists(root / "sys/fs/cgroup" / fs::path(v2).relative_path() / "memory.max", ec));
  const fs::path top = is_v2 ? root / "sys/fs/cgroup" : root / "sys/fs/cgroup/memory";
  const fs::path group = top / fs::path(is_v2 ? v2 : v1).relative_path();
  const char* limit_file = is_v2 ? "memory.max" : "memory.limit_in_bytes";
  CgroupFiles f;
  // (a container sees its own group as /, whose files are at the top: the walk ends there)
  for (fs::path at = group;; at = at.parent_path()) {
    if (const int64_t limit = number_in(at / limit_file); limit >= 0 && limit < (int64_t{1} << 60))  // v1's none: 2^63 - 4096
      f.limit = f.limit < 0 ? limit : std::min(f.limit, limit);
    if (at == top || at.string().size() <= top.string().size() || !at.has_parent_path()) break;
  }
  const fs::path usage_at = fs::exists(group / limit_file, ec) ? group : top;
  f.usage = usage_at / (is_v2 ? "memory.current" : "memory.usage_in_bytes");
  f.stat = usage_at / "memory.stat";
  f.inactive = is_v2 ? "inactive_file" : "total_inactive_file";
  return f;
}

/// The group's usage less its inactive page cache; `less_active_cache`: less the active page cache
/// too (all of the cache is reclaimed before the kernel kills, which a refusal must be sure of).
int64_t usage_of(const CgroupFiles& f, bool less_active_cache = false) {
  int64_t usage = number_in(f.usage);
  std::string active = f.inactive;  // ("inactive_file" -> "active_file"; v1's "total_" kept)
  active.erase(active.find("inactive_file"), 2);
  std::ifstream stat(f.stat);
  std::string key;
  int64_t value = 0;
  while (usage > 0 && stat >> key >> value)
    if (key == f.inactive || (less_active_cache && key == active)) usage = std::max<int64_t>(0, usage - value);
  return usage;
}

/// This process's: found once (the files a CPU run's memory figures read every step are two).
const CgroupFiles& own_cgroup() {
  static const CgroupFiles files = cgroup_files("/");
  return files;
}

}  // namespace

CgroupMemory cgroup_memory(const std::filesystem::path& root) {
  const CgroupFiles f = cgroup_files(root);
  return {f.limit, usage_of(f)};
}

// A container's memory limit is the memory it has: the machine's (sysconf) would let auto_batch
// aim at what the kernel's OOM killer never lets it reach.
int64_t physical_memory() {
  const int64_t machine = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE);
  const int64_t limit = own_cgroup().limit;
  return limit > 0 ? std::min(machine, limit) : machine;
}

namespace {

/// What the host has left for a block, on the generous side where figures differ (a refusal must
/// be sure): available memory (the free pages where the kernel gives no figure) and free swap; in a
/// container, the least of that and its limit less its usage, less the page cache the kernel
/// reclaims before it kills; and the heap's freed bytes, which glibc may serve a block from.
int64_t host_memory_left() {
  const int64_t available = meminfo("MemAvailable:");
  int64_t left = (available >= 0 ? available : static_cast<int64_t>(::sysconf(_SC_AVPHYS_PAGES)) * ::sysconf(_SC_PAGESIZE)) +
                 std::max<int64_t>(0, meminfo("SwapFree:"));
  if (const CgroupFiles& own = own_cgroup(); own.limit > 0)
    if (const int64_t usage = usage_of(own, /*less_active_cache=*/true); usage >= 0)
      left = std::min(left, std::max<int64_t>(0, own.limit - usage));
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
  left += static_cast<int64_t>(::mallinfo2().fordblks);
#endif
  return left;
}

// (read at most every 200 ms where the block is under half of what was left: a step maps and
// unmaps its large blocks afresh, and each reading parses /proc/meminfo and the group's files)
std::atomic<int64_t> left_read{-1}, left_read_at{0};

bool host_can_hold(int64_t bytes, int64_t& left) {
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  left = left_read.load(std::memory_order_relaxed);
  if (left >= 0 && bytes <= left / 2 && now - left_read_at.load(std::memory_order_relaxed) < 200'000'000) {
    left_read.fetch_sub(bytes, std::memory_order_relaxed);  // (until read again: what this block takes is gone)
    return true;
  }
  left = host_memory_left();
  left_read.store(left, std::memory_order_relaxed);
  left_read_at.store(now, std::memory_order_relaxed);
  return bytes <= left;
}

}  // namespace

int64_t available_memory() {
  const int64_t v = meminfo("MemAvailable:");
  const int64_t machine = v > 0 ? v : static_cast<int64_t>(::sysconf(_SC_AVPHYS_PAGES)) * ::sysconf(_SC_PAGESIZE);
  const CgroupFiles& own = own_cgroup();
  const int64_t usage = own.limit > 0 ? usage_of(own) : -1;
  int64_t out = own.limit > 0 && usage >= 0 ? std::min(machine, std::max<int64_t>(0, own.limit - usage)) : machine;
  // `ulimit -v`: the address space left, past which the host refuses an allocation (auto_batch's
  // probe of 2.5 GiB under 6 GB was the run's error, not "does not fit"); half of it, as the heap's
  // freed blocks, threads' arenas and the loader's batches take address space beyond the tensors'
  // bytes (the batch a probe found with all of it failed at step 1)
  rlimit space{};
  if (::getrlimit(RLIMIT_AS, &space) == 0 && space.rlim_cur != RLIM_INFINITY) {
    std::ifstream in("/proc/self/status");
    for (std::string line; std::getline(in, line);)
      if (line.rfind("VmSize:", 0) == 0)
        out = std::min(out, std::max<int64_t>(0, static_cast<int64_t>(space.rlim_cur) -
                                                     std::strtoll(line.c_str() + 7, nullptr, 10) * 1024) / 2);
  }
  return out;
}

void install_cpu_allocator() { BudgetAllocator::instance(); }

HostMemoryScope::HostMemoryScope() { ++BudgetAllocator::host_scope_depth; }
HostMemoryScope::~HostMemoryScope() { --BudgetAllocator::host_scope_depth; }

std::unique_ptr<sdk::DeviceMemory> make_device_memory(const c10::Device& device, int64_t cpu_limit) {
  if (device.is_cpu()) {
    install_cpu_allocator();
    // The budget is process-wide, like the allocator: the newest run's limit (or none) holds.
    auto memory = std::make_unique<CpuMemory>();
    memory->set_limit(cpu_limit);
    return memory;
  }
#if LOOM_TORCH_CUDA
  if (device.is_cuda()) return std::make_unique<CudaMemory>(device.has_index() ? device : c10::Device(c10::kCUDA, 0));
#endif
  throw Error("no memory accounting for device " + device.str());
}

void start_memory_history(const c10::Device& device) {
#if LOOM_TORCH_CUDA
  if (device.is_cuda()) {
    // Strings, not literals: a const char* would pick the bool overload (research/libtorch-api.md).
    torch::cuda::_record_memory_history(std::string("all"), std::string("all"), std::string("all"), 100000);
  }
#else
  (void)device;
#endif
}

void write_memory_snapshot(const c10::Device& device, const std::filesystem::path& path) {
#if LOOM_TORCH_CUDA
  if (device.is_cuda()) {
    write_file_atomic(path, torch::cuda::_memory_snapshot_pickled());
    return;
  }
#endif
  throw Error("memory snapshots are CUDA allocator snapshots (for pytorch.org/memory_viz); " + device.str() +
              " has none");
}

}  // namespace loom::core
