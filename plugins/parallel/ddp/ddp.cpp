// ddp: one process per device, the processes of a job joined in a c10d process group (Gloo on the
// CPU; NCCL on CUDA where this build has it: LOOM_DDP_NCCL, from a CUDA wheel's nvidia/nccl), as
// PyTorch's DistributedDataParallel joins them.
// The launcher's variables (<loom/sdk/launch.hpp>: torchrun, `loom launch`, Slurm, Open MPI)
// give the rank, the world and rank 0's address; rank 0 hosts a c10d::TCPStore there (under
// torchrun's elastic agent the agent's store is joined instead) and every rank builds its
// process group on it. The trainer sums gradients and the step's report over the ranks through
// all_reduce_sum and divides by the global count once, so the update is that of one process
// with the whole global batch.
#include <loom/sdk/launch.hpp>
#include <loom/sdk/sdk.hpp>

#include <ATen/ops/ones.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/cuda.h>
#if LOOM_DDP_NCCL
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <netdb.h>
#include <unistd.h>

namespace {

using loom::sdk::Error;

/// c10d logs each failed try to reach the store with its exception's whole C++ stack (about 50
/// lines on stderr, probe L); the error the rank gives after it says the same in one line. Quiet
/// while the store is made, unless c10's logging was asked for more (TORCH_CPP_LOG_LEVEL=INFO).
class QuietC10dLog {
 public:
  QuietC10dLog() : before_(FLAGS_caffe2_log_level) {
    if (before_ >= 1) FLAGS_caffe2_log_level = 3;  // (c10's FATAL: only a crash's own line)
  }
  ~QuietC10dLog() { FLAGS_caffe2_log_level = before_; }
  QuietC10dLog(const QuietC10dLog&) = delete;
  QuietC10dLog& operator=(const QuietC10dLog&) = delete;

 private:
  int before_;
};

/// Says, after 10 s and then every minute, what a rank still waits for: a node never started, or
/// an address that reaches no rank 0, waited parallel.timeout (30 minutes by default) in silence.
class WaitNotice {
 public:
  explicit WaitNotice(std::string what) : what_(std::move(what)), thread_([this] { watch(); }) {}
  ~WaitNotice() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  WaitNotice(const WaitNotice&) = delete;
  WaitNotice& operator=(const WaitNotice&) = delete;

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    int64_t waited = 0;
    for (int64_t next = 10; !wake_.wait_for(lock, std::chrono::seconds(next), [&] { return done_; }); next = 60) {
      waited += next;
      loom::sdk::log::warn(what_, " (", waited, " s so far)");
    }
  }
  std::string what_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool done_ = false;
  std::thread thread_;  // (last: it starts once the rest is made)
};

bool is_loopback(const std::string& address) {
  return address == "localhost" || address.rfind("127.", 0) == 0 || address == "::1";
}

class Ddp final : public loom::sdk::ParallelStrategy {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_enum("backend", "auto", "auto|gloo|nccl",
                             "the collective engine: auto is NCCL on CUDA, Gloo on the CPU"),
      loom::sdk::option_float("timeout", "1800",
                              "seconds a collective (or the rendezvous) waits for the other ranks before the run "
                              "stops with an error: a rank that hangs (one that died is found at once); the others "
                              "wait this long while rank 0 writes a checkpoint, as PyTorch's 30 minutes allow",
                              "1..86400"),
  };

  explicit Ddp(const loom::sdk::Options& o)
      : backend_(o.get_string("backend")),
        timeout_(std::chrono::milliseconds(static_cast<int64_t>(o.get_float("timeout") * 1000))) {}

  void setup(const std::string& device) override {
    const auto env = loom::sdk::launch_environment();
    if (!env)
      throw Error(
          "parallel = ddp runs one process per device, started by a launcher: `loom launch --nproc-per-node N -- "
          "train ...`, `torchrun --no-python --nproc-per-node N loom train ...`, srun or mpirun (none of RANK, "
          "SLURM_PROCID, OMPI_COMM_WORLD_RANK is set). For one process use parallel = single: `loom eval`, "
          "`bench` and `profile` run in one, and `loom launch` starts only `train`");
    env_ = *env;
    choose_device(device);
    if (backend_ == "auto") backend_ = device_.is_cuda() && kHasNccl ? "nccl" : "gloo";
    if (backend_ == "nccl" && !kHasNccl)
      throw Error("parallel.backend = nccl: this build of the ddp plugin has no NCCL (its LibTorch has no CUDA, or "
                  "NCCL's headers were not found beside it when Loom was configured); set parallel.backend = gloo, "
                  "which also reduces CUDA tensors, through host copies");
    if (backend_ == "nccl" && !device_.is_cuda())
      throw Error("parallel.backend = nccl reduces CUDA tensors, and rank " + std::to_string(env_.rank) +
                  " trains on " + device_.str() + "; use parallel.backend = gloo (or auto) on the CPU");
    nccl_ = backend_ == "nccl";
    join();
    loom::sdk::log::info("ddp: rank ", env_.rank, " of ", env_.world_size, " on ", device_.str(), ", joined over ",
                         nccl_ ? "NCCL" : "Gloo", " (", env_.master_addr, ":", env_.port, ")");
  }

  int64_t rank() const override { return env_.rank; }
  int64_t world_size() const override { return env_.world_size; }
  c10::Device device() const override { return device_; }

  void broadcast(const std::vector<at::Tensor>& tensors) override {
    for (const auto& t : tensors) {
      std::vector<at::Tensor> one{host(t)};
      run("a broadcast from rank 0", [&] { return group_->broadcast(one); });
      copy_back(t, one.front());
    }
  }

  void all_reduce_sum(const std::vector<at::Tensor>& tensors) override {
    // One all-reduce per tensor (the trainer hands a few flat gradient buffers and one report),
    // all queued before the first wait so that Gloo runs them back to back.
    std::vector<std::vector<at::Tensor>> buffers;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    buffers.reserve(tensors.size());
    for (const auto& t : tensors) buffers.push_back({host(t)});
    for (auto& b : buffers)
      works.push_back(call("an all-reduce", [&] { return group_->allreduce(b, c10d::AllreduceOptions{}); }));
    for (auto& w : works) wait("an all-reduce", w);
    for (size_t i = 0; i < tensors.size(); ++i) copy_back(tensors[i], buffers[i].front());
  }

  // Interface 1.1: the trainer starts one per gradient bucket from autograd's thread as backward
  // completes it; Gloo's threads reduce it while backward goes on.
  std::unique_ptr<loom::sdk::PendingReduction> start_all_reduce_sum(const std::vector<at::Tensor>& tensors) override {
    auto pending = std::make_unique<Pending>(*this);
    for (const auto& t : tensors) {
      pending->targets.push_back(t);
      pending->buffers.push_back({host(t)});
    }
    for (auto& b : pending->buffers)
      pending->works.push_back(call("an all-reduce", [&] { return group_->allreduce(b, c10d::AllreduceOptions{}); }));
    return pending;
  }

  void barrier() override {
    if (!nccl_) return run("a barrier", [&] { return group_->barrier(); });
    // NCCL's wait orders the streams only: a one-element sum read back makes the host wait too.
    std::vector<at::Tensor> one{at::ones({1}, at::TensorOptions().device(device_))};
    run("a barrier", [&] { return group_->allreduce(one, c10d::AllreduceOptions{}); });
    (void)one.front().item<float>();
  }

  void teardown() override {
    group_.reset();
    store_.reset();
  }

 private:
  void choose_device(const std::string& device) {
    const bool cuda = torch::cuda::is_available();
    if (device == "auto" || device == "cuda") {
      const int64_t visible = cuda ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
      if (env_.local_rank < visible) {
        device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env_.local_rank));
        return;
      }
      if (visible == 1) {  // a scheduler's binding (srun --gpus-per-task=1): each process sees its own GPU as 0
        device_ = c10::Device(c10::kCUDA, 0);
        loom::sdk::log::info("ddp: local rank ", env_.local_rank, " sees one GPU (CUDA_VISIBLE_DEVICES or the scheduler's "
                             "binding): it trains on cuda:0");
        return;
      }
      if (visible > 1)  // not a CPU rank among GPU ones: its all-reduces would not meet theirs
        throw Error("ddp: local rank " + std::to_string(env_.local_rank) + " has no GPU of its own (" +
                    std::to_string(visible) + " visible): start as many processes per node as GPUs (loom launch "
                    "--nproc-per-node " + std::to_string(visible) + "), or set trainer.device = cpu for every rank");
      if (device == "cuda")
        throw Error("trainer.device = cuda, parallel = ddp: local rank " + std::to_string(env_.local_rank) +
                    " has no CUDA device of its own (" + std::to_string(cuda ? torch::cuda::device_count() : 0) +
                    " visible); start as many processes per node as GPUs, or use trainer.device = cpu");
      device_ = c10::Device(c10::kCPU);
      return;
    }
    if (device == "cpu") {
      device_ = c10::Device(c10::kCPU);
      return;
    }
    throw Error("trainer.device = '" + device + "' with parallel = ddp: use auto, cpu or cuda (each process takes the "
                "GPU of its local rank)");
  }

  void join() {
    // A host name that does not resolve is said now: the store would retry it for parallel.timeout
    // (30 minutes by default), printing c10d's warning every few seconds.
    {
      addrinfo hints{};
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* found = nullptr;
      const int error = ::getaddrinfo(env_.master_addr.c_str(), nullptr, &hints, &found);
      if (found != nullptr) ::freeaddrinfo(found);
      if (error != 0 && error != EAI_AGAIN)  // (a name server that did not answer now: the store tries again)
        throw Error("ddp: rank 0's host " + env_.master_addr + " (" +
                    (std::getenv("MASTER_ADDR") == nullptr && env_.launcher == "slurm" ? "the first node of Slurm's node list"
                                                                                          : "MASTER_ADDR") +
                    ") does not resolve (" +
                    ::gai_strerror(error) + "); set MASTER_ADDR to rank 0's host name or address, one every node "
                    "resolves (127.0.0.1 on one machine)");
    }
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(env_.port);
    options.isServer = env_.rank == 0 && !env_.agent_store;
    options.numWorkers = static_cast<size_t>(env_.world_size);
    // (rank 0 does not wait here for its world's count of ranks to connect: agree_on_world waits,
    // with a deadline, and hears a rank started for another world, which would never come or be counted)
    options.waitWorkers = false;
    options.timeout = timeout_;
    c10::intrusive_ptr<c10d::Store> store;
    // (quiet while the store is made, and on the other ranks up to the process group: a failed read
    // of the store logged c10d's whole C++ stack before the rank's own one-line error)
    std::optional<QuietC10dLog> quiet;
    quiet.emplace();
    const std::string where = endpoint();
    try {
      const WaitNotice notice("ddp: rank " + std::to_string(env_.rank) + " still waits to reach rank 0 at " + where +
                              ", up to " + seconds() + ": is rank 0 started, and is that its address and port?");
      store = c10::make_intrusive<c10d::TCPStore>(env_.master_addr, options);
    } catch (const std::exception& e) {
      const std::string why = first_line(e.what());
      // A port another process holds: no wait helps; another port does.
      if (options.isServer && (why.find("EADDRINUSE") != std::string::npos || why.find("ddress already in use") != std::string::npos))
        throw Error("ddp: rank 0 cannot listen on " + where +
                    ": another process holds the port (" + why + "). Choose another one (loom launch --master-port N, "
                    "or 0 for a free one; MASTER_PORT under torchrun)");
      throw Error("ddp: rank " + std::to_string(env_.rank) + " of " + std::to_string(env_.world_size) +
                  " could not meet the others at " + where + " within " +
                  seconds() + " (" + why +
                  "). Are all ranks started, MASTER_ADDR reachable and the port free? parallel.timeout waits longer");
    }
    if (env_.rank == 0) quiet.reset();  // (its store's server thread may have errors to say, for as long as it waits)
    if (env_.agent_store)
      store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(env_.restart), store);
    store_ = store;
    // (torchrun's agent gave every rank of this rendezvous one world, and its store outlives a
    // re-rendezvous that does not count as a restart: keys of the round before would be read)
    if (!env_.agent_store) agree_on_world();
    agree_on_backend();
    quiet.reset();
    if (nccl_) {
      claim_gpu();
      return join_nccl();
    }
    auto gloo = c10d::ProcessGroupGloo::Options::create(timeout_);
    const char* interface = std::getenv("GLOO_SOCKET_IFNAME");
    try {
      if (interface != nullptr && *interface != '\0')
        gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
      else if (is_loopback(env_.master_addr))
        gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      else
        gloo->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, static_cast<int>(env_.rank),
                                                           static_cast<int>(env_.world_size), gloo);
    } catch (const std::exception& e) {
      throw Error("ddp: rank " + std::to_string(env_.rank) + " could not join the Gloo process group: " +
                  first_line(e.what()) + " (GLOO_SOCKET_IFNAME names the network interface to use)");
    }
  }

  /// The text rank 0 set under `key`, waited for (parallel.timeout); a failure says `what` failed.
  std::string text_of_rank_0(const std::string& key, const char* what) const {
    try {
      const std::vector<uint8_t> got = store_->get(key);
      return std::string(got.begin(), got.end());
    } catch (const std::exception& e) {
      throw failed(what, e);
    }
  }

  /// Every rank was started for rank 0's world, or each says how it differs, at once: nodes started
  /// with other --nnodes or --nproc-per-node met at the store and then waited in Gloo's connection
  /// of every pair, which has no deadline (rank 0 hung for good), or until parallel.timeout with an
  /// error about the network interface. Rank 0 goes on once the others agreed, or says who did not.
  void agree_on_world() {
    const std::string world_key = "loom/ddp/world", refused_key = "loom/ddp/world_refused", agreed_key = "loom/ddp/world_agreed";
    const std::string fix = ": start every node with the same --nnodes and --nproc-per-node and a --node-rank of its own";
    const auto bytes = [](const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); };
    if (env_.rank != 0) {
      const std::string theirs = [&] {
        const WaitNotice notice("ddp: rank " + std::to_string(env_.rank) + " still waits for rank 0's answer, up to " +
                                seconds() + " (is rank 0 this job's? another job's at that port answers nothing)");
        return text_of_rank_0(world_key, "reading rank 0's world size");
      }();
      std::string why;
      if (theirs != std::to_string(env_.world_size))
        why = "rank " + std::to_string(env_.rank) + " was started as one of " + std::to_string(env_.world_size) +
              " ranks, rank 0 as one of " + theirs;
      // (one world, two processes of one rank: nodes that split it another way, 2 x 2 and 4 x 1)
      else if (store_->add("loom/ddp/rank/" + std::to_string(env_.rank), 1) > 1)
        why = "rank " + std::to_string(env_.rank) + " of " + theirs + " was started twice (by two nodes that split the "
              "world differently, or with the same --node-rank; or the rank 0 at " + endpoint() +
              " is another job's, still running there: give each job a --master-port of its own)";
      if (!why.empty()) {
        store_->set(refused_key, bytes(why));
        throw Error("ddp: " + why + fix);
      }
      store_->add(agreed_key, 1);
      return;
    }
    store_->set(world_key, bytes(std::to_string(env_.world_size)));
    const auto start = std::chrono::steady_clock::now(), deadline = start + timeout_;
    auto notice = start + std::chrono::seconds(10);  // (then every minute: the wait was silent)
    for (int64_t agreed = 0;;) {
      if (store_->check({refused_key})) {
        const std::vector<uint8_t> why = store_->get(refused_key);
        throw Error("ddp: " + std::string(why.begin(), why.end()) + fix);
      }
      agreed = store_->add(agreed_key, 0);
      if (agreed >= env_.world_size - 1) return;
      if (std::chrono::steady_clock::now() > deadline)
        throw Error("ddp: rank 0 of " + std::to_string(env_.world_size) + ": " + std::to_string(agreed) + " of the " +
                    std::to_string(env_.world_size - 1) + " other ranks arrived within " + seconds() +
                    " (were all started, with the same --nnodes and --nproc-per-node?)");
      if (const auto now = std::chrono::steady_clock::now(); now > notice) {
        notice = now + std::chrono::seconds(60);
        loom::sdk::log::warn("ddp: rank 0 waits for the other ranks: ", agreed, " of ", env_.world_size - 1, " arrived in ",
                             std::chrono::duration_cast<std::chrono::seconds>(now - start).count(), " s (up to ",
                             seconds(), "); are they all started, with this rank 0's address and port?");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  /// Every rank reduces with rank 0's backend on rank 0's kind of device, or says what differs
  /// (one rank on NCCL, another on Gloo would wait for each other until parallel.timeout).
  void agree_on_backend() {
    const std::string mine = backend_ + " on " + (device_.is_cuda() ? "CUDA" : "the CPU");
    const std::string key = "loom/ddp/backend";
    if (env_.rank == 0) {
      store_->set(key, std::vector<uint8_t>(mine.begin(), mine.end()));
      return;
    }
    const std::string theirs = text_of_rank_0(key, "reading rank 0's backend");
    if (theirs != mine)
      throw Error("ddp: rank " + std::to_string(env_.rank) + " would reduce with " + mine + ", rank 0 with " + theirs +
                  ": every rank needs the same backend and kind of device. Set trainer.device and parallel.backend for "
                  "all of them (a machine with fewer GPUs than ranks, or another build of Loom?)");
  }

  /// NCCL takes one GPU per rank: two ranks of one host on one GPU (two processes on a one-GPU
  /// machine, each of which sees it as cuda:0) are said here, by the GPU's UUID, not by NCCL's
  /// "Duplicate GPU detected" at the first all-reduce.
  void claim_gpu() {
#if LOOM_DDP_NCCL
    const auto* properties = at::cuda::getDeviceProperties(device_.index());
    std::string uuid;
    for (const char byte : properties->uuid.bytes) {
      static const char* hex = "0123456789abcdef";
      uuid += hex[(static_cast<unsigned char>(byte) >> 4) & 15];
      uuid += hex[static_cast<unsigned char>(byte) & 15];
    }
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const int64_t ranks_on_it = store_->add("loom/ddp/gpu/" + std::string(host) + "/" + uuid, 1);
    if (ranks_on_it > 1)
      throw Error("ddp: rank " + std::to_string(env_.rank) + " would train on " + device_.str() + " (" + properties->name +
                  ") of " + host + ", which another rank of this machine has: NCCL needs a GPU per rank. Start as many "
                  "processes per node as GPUs, or set parallel.backend = gloo to share one");
#endif
  }

  void join_nccl() {
#if LOOM_DDP_NCCL
    c10::cuda::set_device(device_.index());
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout_;
    try {
      group_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(store_, static_cast<int>(env_.rank),
                                                           static_cast<int>(env_.world_size), options);
    } catch (const std::exception& e) {
      throw Error("ddp: rank " + std::to_string(env_.rank) + " could not join the NCCL process group on " +
                  device_.str() + ": " + first_line(e.what()) + " (NCCL_DEBUG=INFO says more)");
    }
#endif
  }

  // What a collective reduces: NCCL a tensor on this rank's GPU (the trainer's host-side control
  // tensors, the plan, a stop, the replicas' check, travel there and back: NCCL reduces nothing
  // else), Gloo host memory, so a CUDA tensor travels through a host copy. copy_back puts the
  // result into the caller's tensor, after the wait.
  at::Tensor host(const at::Tensor& t) const {
    if (nccl_) {
      const at::Tensor there = t.device() == device_ ? t : t.to(device_);
      return there.is_contiguous() ? there : there.contiguous();
    }
    return t.is_cpu() && t.is_contiguous() ? t : t.to(at::kCPU).contiguous();
  }
  static void copy_back(const at::Tensor& target, const at::Tensor& buffer) {
    if (!buffer.is_same(target)) target.copy_(buffer);
  }

  template <typename F>
  c10::intrusive_ptr<c10d::Work> call(const char* what, F&& f) {
    try {
      return f();
    } catch (const std::exception& e) {
      throw failed(what, e);
    }
  }
  void wait(const char* what, const c10::intrusive_ptr<c10d::Work>& work) {
    try {
      work->wait();
    } catch (const std::exception& e) {
      throw failed(what, e);
    }
  }
  template <typename F>
  void run(const char* what, F&& f) {
    wait(what, call(what, std::forward<F>(f)));
  }

  // A collective fails when another rank is gone (its connection closes) or silent for the
  // timeout. Which rank: with two, the other one; with more, the launcher says (loom launch names
  // the rank that exited first).
  Error failed(const char* what, const std::exception& e) const {
    const std::string who = env_.world_size == 2 ? "rank " + std::to_string(1 - env_.rank)
                                                 : "another rank (the launcher's log names which)";
    // (what the engine said tells the two apart: "the rank did not answer within 1800 s" for a
    // peer whose connection had closed at once misled)
    const std::string said = first_line(e.what());
    const bool timed_out = said.find("imed out") != std::string::npos || said.find("imeout") != std::string::npos;
    const bool closed = said.find("losed") != std::string::npos || said.find("reset by peer") != std::string::npos ||
                        said.find("EOF") != std::string::npos;
    return Error("ddp: " + std::string(what) + " on rank " + std::to_string(env_.rank) + " of " +
                 std::to_string(env_.world_size) + " failed: " + who +
                 (timed_out ? " did not answer within " + seconds() +
                                  (env_.rank != 0 ? "; if rank 0 was writing a checkpoint then (a large model's takes a while), "
                                                    "raise parallel.timeout above that time"
                                                  : "")
                  : closed  ? std::string(" stopped (its connection closed)")
                            : " stopped or did not answer within " + seconds()) +
                 " (" + said + ")");
  }

  std::string seconds() const { return std::to_string(timeout_.count() / 1000) + " s (parallel.timeout)"; }
  // Rank 0's store, ADDRESS:PORT, an IPv6 address in brackets as a URL writes it ("::1:29500" read
  // as one address).
  std::string endpoint() const {
    const bool v6 = env_.master_addr.find(':') != std::string::npos;
    return (v6 ? "[" + env_.master_addr + "]" : env_.master_addr) + ":" + std::to_string(env_.port);
  }

  static std::string first_line(const std::string& text) {
    std::string line = text.substr(0, text.find('\n'));
    return line.size() > 300 ? line.substr(0, 300) + "..." : line;
  }

  struct Pending final : loom::sdk::PendingReduction {
    explicit Pending(Ddp& owner) : ddp(owner) {}
    void wait() override {
      for (auto& w : works) ddp.wait("an all-reduce of gradients", w);
      for (size_t i = 0; i < targets.size(); ++i) copy_back(targets[i], buffers[i].front());
    }
    Ddp& ddp;
    std::vector<at::Tensor> targets;
    std::vector<std::vector<at::Tensor>> buffers;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
  };

#if LOOM_DDP_NCCL
  static constexpr bool kHasNccl = true;
#else
  static constexpr bool kHasNccl = false;
#endif
  std::string backend_;
  bool nccl_ = false;
  std::chrono::milliseconds timeout_;
  loom::sdk::LaunchEnvironment env_;
  c10::Device device_{c10::kCPU};
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> group_;  // ProcessGroupGloo or ProcessGroupNCCL
};

}  // namespace

LOOM_PLUGIN("ddp", "1.0.0",
            loom::sdk::component<Ddp>("ddp", "one process per device, gradients summed over a c10d process group"))
