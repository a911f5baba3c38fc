// Where a process of a multi-process job finds its place: the variables the launchers set.
// Read in this order, the first launcher whose rank variable is set wins:
//   - torchrun and `loom launch`: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (and,
//     under torchrun's elastic agent, TORCHELASTIC_USE_AGENT_STORE: the agent hosts the store);
//   - Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is MASTER_ADDR or the
//     first host of SLURM_JOB_NODELIST (or SLURM_NODELIST), the port MASTER_PORT or 29500;
//   - Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK;
//     the master is MASTER_ADDR (127.0.0.1 when the whole job is on one node), the port
//     MASTER_PORT or 29500.
// A launcher's set that is incomplete or out of range is one error naming the variable. Header
// only: a parallel strategy calls it; the tests pass a fake environment.
#pragma once

#include <loom/sdk/error.hpp>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>

namespace loom::sdk {

struct LaunchEnvironment {
  std::string launcher;  ///< "torchrun", "slurm", "mpi"
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::string master_addr;
  int port = 29500;
  /// torchrun's elastic agent already hosts the store at master_addr:port; workers join it as
  /// clients under the prefix /worker/attempt_<restart> (as torch.distributed does).
  bool agent_store = false;
  int64_t restart = 0;
};

using GetEnv = std::function<const char*(const char*)>;

namespace launch_detail {

inline int64_t integer(const GetEnv& env, const char* name, const std::string& launcher, int64_t low, int64_t high) {
  const char* text = env(name);
  if (text == nullptr || *text == '\0')
    throw Error(launcher + " set some of its variables but not " + name + ": start the job with its launcher, or set " +
                name);
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < low || value > high)  // (RANK=5 of 2 was "not a whole number")
    throw Error(std::string(name) + " = '" + text + "' is " +
                (errno != 0 || end == text || *end != '\0' ? "not a whole number in " : "outside ") + std::to_string(low) +
                " ... " + std::to_string(high));
  return value;
}

inline std::string text_or(const GetEnv& env, const char* name, const std::string& fallback) {
  const char* text = env(name);
  return text != nullptr && *text != '\0' ? std::string(text) : fallback;
}

}  // namespace launch_detail

/// The first host of a Slurm node list: "node[07-09,12],gpu3" -> "node07"; "a,b" -> "a";
/// "rack[2-3]-n[1-4]" -> "rack2-n1".
inline std::string first_slurm_host(const std::string& list) {
  std::string first;
  int depth = 0;
  for (char c : list) {  // the first entry at the top level
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
    first += c;
  }
  for (size_t open; (open = first.find('[')) != std::string::npos;) {  // each bracket: its first value
    const size_t close = first.find(']', open);
    if (close == std::string::npos) throw Error("SLURM_JOB_NODELIST = '" + list + "': a '[' is not closed");
    std::string range = first.substr(open + 1, close - open - 1);
    range = range.substr(0, range.find(','));
    range = range.substr(0, range.find('-'));
    first = first.substr(0, open) + range + first.substr(close + 1);
  }
  return first;
}

/// The launcher's view of this process, or nothing when no launcher's rank variable is set.
inline std::optional<LaunchEnvironment> launch_environment(const GetEnv& env = [](const char* name) {
  return std::getenv(name);
}) {
  using launch_detail::integer;
  using launch_detail::text_or;
  LaunchEnvironment e;
  if (env("RANK") != nullptr) {
    e.launcher = "torchrun";
    e.world_size = integer(env, "WORLD_SIZE", "torchrun (or loom launch)", 1, 1 << 20);
    e.rank = integer(env, "RANK", e.launcher, 0, e.world_size - 1);
    e.local_rank = env("LOCAL_RANK") != nullptr ? integer(env, "LOCAL_RANK", e.launcher, 0, e.world_size - 1) : 0;
    e.master_addr = text_or(env, "MASTER_ADDR", "");
    if (e.master_addr.empty())
      throw Error("RANK and WORLD_SIZE are set but MASTER_ADDR is not: the address of rank 0's host is needed");
    e.port = static_cast<int>(integer(env, "MASTER_PORT", e.launcher, 1, 65535));
    e.agent_store = text_or(env, "TORCHELASTIC_USE_AGENT_STORE", "") == "True";
    if (e.agent_store) e.restart = integer(env, "TORCHELASTIC_RESTART_COUNT", e.launcher, 0, 1 << 20);
    return e;
  }
  if (env("SLURM_PROCID") != nullptr) {
    e.launcher = "slurm";
    e.world_size = integer(env, "SLURM_NTASKS", "Slurm", 1, 1 << 20);
    e.rank = integer(env, "SLURM_PROCID", e.launcher, 0, e.world_size - 1);
    e.local_rank = integer(env, "SLURM_LOCALID", "Slurm", 0, e.world_size - 1);
    std::string master = text_or(env, "MASTER_ADDR", "");
    if (master.empty()) {
      const std::string nodes = text_or(env, "SLURM_JOB_NODELIST", text_or(env, "SLURM_NODELIST", ""));
      if (nodes.empty())
        throw Error("Slurm set SLURM_PROCID but neither MASTER_ADDR nor SLURM_JOB_NODELIST: rank 0's host is unknown");
      master = first_slurm_host(nodes);
    }
    e.master_addr = master;
    e.port = env("MASTER_PORT") != nullptr ? static_cast<int>(integer(env, "MASTER_PORT", e.launcher, 1, 65535)) : 29500;
    return e;
  }
  if (env("OMPI_COMM_WORLD_RANK") != nullptr) {
    e.launcher = "mpi";
    e.world_size = integer(env, "OMPI_COMM_WORLD_SIZE", "Open MPI", 1, 1 << 20);
    e.rank = integer(env, "OMPI_COMM_WORLD_RANK", e.launcher, 0, e.world_size - 1);
    e.local_rank = integer(env, "OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI", 0, e.world_size - 1);
    const int64_t local_size =
        env("OMPI_COMM_WORLD_LOCAL_SIZE") != nullptr ? integer(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI", 1, 1 << 20) : 0;
    e.master_addr = text_or(env, "MASTER_ADDR", local_size == e.world_size ? "127.0.0.1" : "");
    if (e.master_addr.empty())
      throw Error("mpirun started ranks on several nodes and MASTER_ADDR is not set: export MASTER_ADDR=<rank 0's host> "
                  "(mpirun -x MASTER_ADDR)");
    e.port = env("MASTER_PORT") != nullptr ? static_cast<int>(integer(env, "MASTER_PORT", e.launcher, 1, 65535)) : 29500;
    return e;
  }
  return std::nullopt;
}

}  // namespace loom::sdk
