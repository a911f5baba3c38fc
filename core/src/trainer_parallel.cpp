// What the ranks of a multi-process run (parallel = ddp) must agree on, beyond the gradients and
// the reports the step sums (trainer_step.cpp): the weights at the start, when to stop, where in
// the data a resumed run with another world size goes on, and, at the end, that every rank still
// holds the same weights; and the replicas of one process over several devices (data_parallel).
// Rank 0's run folder and checkpoint: run_folder.cpp.
#include <loom/core/device_memory.hpp>
#include <loom/core/kinds.hpp>
#include <loom/core/log.hpp>
#include <loom/core/profiler.hpp>
#include <loom/core/text.hpp>
#include <loom/core/trainer.hpp>
#include "gradient_sync.hpp"
#include "replicas.hpp"
#include "trainer_internal.hpp"

#include <ATen/ops/cat.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <functional>
#include <map>

namespace loom::core {

void Trainer::broadcast_model() {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> tensors;
  for (const auto& [name, t] : model_tensors()) tensors.push_back(t);  // by name: the same order on every rank
  parallel_->broadcast(tensors);
  buffers_at_setup_.clear();  // (sync_buffers compares them with the first step's)
  for (const auto& [name, t] : model_tensors())
    if (name.rfind("buffer.", 0) == 0) buffers_at_setup_.push_back(t.clone());
}

// Buffers a step changes, BatchNorm's running statistics (each rank's from its own shard), are
// rank 0's on every rank after each step, as PyTorch's DistributedDataParallel makes them
// (broadcast_buffers): the evaluation, the checkpoint and the end-of-run check see one model (the
// check stopped such a run at its end). Which buffers change is found at this process's first
// step (each buffer against its copy at set-up: the version counter misses the running statistics,
// which the kernel writes itself), agreed by the ranks (one sum); then one broadcast per
// dtype per step, and none for a model whose buffers no step changes (a mask, a position table).
void Trainer::sync_buffers() {
  if (parallel_->world_size() <= 1) return;
  at::NoGradGuard no_grad;
  if (!moving_buffers_) {
    std::vector<std::string> names;
    std::vector<at::Tensor> buffers;
    for (const auto& [name, t] : model_tensors())
      if (name.rfind("buffer.", 0) == 0) {
        names.push_back(name.substr(7));
        buffers.push_back(t);
      }
    moving_buffers_.emplace();
    const std::vector<at::Tensor> before = std::move(buffers_at_setup_);
    buffers_at_setup_.clear();
    if (buffers.empty() || buffers.size() != before.size()) return;  // (the same on every rank)
    std::vector<std::string> moving;
    {
      HostMemoryScope host;
      at::Tensor moved = at::zeros({static_cast<int64_t>(buffers.size())}, at::kInt);
      for (size_t i = 0; i < buffers.size(); ++i)
        if (!at::equal(buffers[i], before[i])) moved[static_cast<int64_t>(i)] = 1;
      parallel_->all_reduce_sum({moved});
      const auto* flags = moved.data_ptr<int>();
      for (size_t i = 0; i < buffers.size(); ++i)
        if (flags[i] > 0) {
          moving_buffers_->push_back(buffers[i]);
          moving.push_back(names[i]);
        }
    }
    if (moving.empty()) return;
    log::info("parallel  ", moving.size(), " buffer", moving.size() == 1 ? "" : "s", " change in training (",
              moving.size() > 3 ? join({moving[0], moving[1], moving[2], "..."}, ", ") : join(moving, ", "),
              "): rank 0's are every rank's after each step");
  }
  if (moving_buffers_->empty()) return;
  LOOM_PHASE("buffers");
  std::map<at::ScalarType, std::vector<at::Tensor>> by_type;
  for (const auto& t : *moving_buffers_) by_type[t.scalar_type()].push_back(t);
  for (auto& [type, group] : by_type) {
    std::vector<at::Tensor> flat;
    for (const auto& t : group) flat.push_back(t.reshape({-1}).to(type == at::kBool ? at::kByte : type));
    at::Tensor one = at::cat(flat);
    parallel_->broadcast({one});
    int64_t offset = 0;
    for (auto& t : group) {
      t.copy_(one.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

void Trainer::build_gradient_sync() {
  sync_.reset();
  // auto: buckets on CUDA; on the CPU one reduction after backward, which measured faster
  // (bench/ddp_cpu.py, 2 cores: 3025 against 2735 samples/s with 0.25 MiB buckets), since there
  // the communication threads compete with backward for the same cores.
  bucket_mb_ = options_.bucket_mb >= 0 ? options_.bucket_mb : device_.is_cuda() ? 25.0 : 0.0;
  if (parallel_->world_size() <= 1 || !parallel_.implements(1) || bucket_mb_ <= 0) return;
  auto buckets = parameters_.buckets(static_cast<int64_t>(bucket_mb_ * 1024 * 1024));
  if (buckets.empty()) return;
  // (what the buckets hold, not what parallel.bucket_mb allows: a small model is one small bucket)
  int64_t bytes = 0;
  for (const auto& bucket : buckets) bytes += bucket.slice.numel() * static_cast<int64_t>(bucket.slice.element_size());
  bucket_bytes_ = bytes / static_cast<int64_t>(buckets.size());
  sync_ = std::make_unique<GradientSync>(*parallel_, std::move(buckets));
  log::debug("parallel  ", sync_->buckets(), " gradient buckets of about ", format_bytes(bucket_bytes_),
             ", reduced during backward");
}

// Rank 0 keeps the run's seed, so that its stream is a single process's; the others draw dropout
// (and anything else random in the step, a recommender's negatives) of their own, from a seed of
// (seed, rank, step) set at each step's start: a checkpoint needs no rank's generator but rank 0's,
// and a job resumed at step s draws at each rank what the job that never stopped drew (a save is
// no collective: a callback may save on one rank). The model was built before, from the same seed
// on every rank, then broadcast; the data's order has its own generator.
void Trainer::build_replicas() {
  replicas_.reset();
  replica_memory_.clear();
  if (!parallel_.implements(2)) return;  // ParallelStrategy 1.2: devices()
  const std::vector<c10::Device> devices = parallel_->devices();
  if (devices.size() <= 1) return;
  if (devices.front() != device_)
    throw Error("parallel strategy '" + detail::value_of(config_, "parallel.name") + "' trains on " + device_.str() +
                " but lists " + describe_devices(devices) + " as its devices; the first must be its device()");
  if (device_.is_cuda()) {
    // The memory policies cap the first device (memory_) and plan for it: each other one gets the
    // same cap in bytes (its replica needs as many) before its replica is made; --memory-fraction
    // capped cuda:0 alone (a review). 0, no cap, also clears a cap a run before set in this process.
    const int64_t cap = memory_->stats().limit;
    for (const auto& d : devices) {
      replica_memory_.push_back(make_device_memory(d));
      if (d != device_) replica_memory_.back()->set_limit(std::max<int64_t>(0, cap));
    }
  }
  replicas_ = std::make_unique<Replicas>(*model_, devices, [this] { return make_model(); }, detail::value_of(config_, "model.name"));
}

void Trainer::seed_rank() {
  if (parallel_->rank() == 0) return;
  // splitmix64 of the three: no two (rank, step) of a run share a seed
  uint64_t z = static_cast<uint64_t>(options_.seed) * 0x9E3779B97F4A7C15ULL ^
               (static_cast<uint64_t>(parallel_->rank()) << 40) ^ static_cast<uint64_t>(step_);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  at::manual_seed(z ^ (z >> 31));
}

namespace detail {

// Ranks started with different configurations (another command line on one node, a file edited
// between two starts) met in their first collective whose shapes differed, and Gloo aborted the
// process (a model option), or trained apart until the end-of-run check (a learning rate), or
// never noticed (a data seed). Rank 0's keys and values are sent to every rank, which names what
// differs. What may differ per node: its threads, data loader's workers and buffers, device and
// memory.device_memory_limit, and paths on its disks.
void agree_on_configuration(sdk::ParallelStrategy& parallel, const Resolved& config) {
  if (parallel.world_size() <= 1) return;
  const auto local = [](const std::string& key) {
    // (a cap of one device: its OOM recovery re-plans every rank; memory.fraction is not one of
    // these: it chooses the fraction_cap policy, whose planning is a collective every rank runs)
    if (key == "memory.device_memory_limit") return true;
    const std::string last = key.substr(key.rfind('.') + 1);
    for (const char* k : {"threads", "num_workers", "prefetch", "pin_memory", "device", "work_dir", "root", "path",
                          "pretrained", "tokenizer", "snapshot", "cache"})
      if (last == k) return true;
    return false;
  };
  std::map<std::string, std::string> mine;
  for (const auto& [key, v] : config)
    if (!local(key)) mine[key] = v.value;
  // Whether --resume auto took the run's settings: a rank whose node lacks the run folder took the
  // defaults where rank 0 took the run's, said as a 1 KB list of keys without the cause (probe).
  const std::string took = "(whether --resume auto found the run's settings)";
  const auto resume = config.find("trainer.resume");
  if (resume != config.end() && resume->second.value == "auto" && value_of(config, "trainer.resume_from").empty())
    mine[took] = std::any_of(config.begin(), config.end(), [](const auto& kv) { return kv.second.origin.source == kRunRecordOrigin; })
                     ? "yes" : "no";
  auto differ = differences_from_rank0(parallel, mine, [&](const std::string& key) {
    if (key == took) return key + " " + mine.at(key);
    const ConfigValue& v = config.at(key);
    return key + " = " + v.value + " (" + v.origin.describe() + ")";
  });
  std::string unshared;
  if (std::erase_if(differ, [&](const std::string& d) { return d.rfind(took, 0) == 0; }) > 0 && mine[took] == "no")
    unshared = "; this rank's --resume auto found no run to take its settings from in trainer.work_dir = " +
               value_of(config, "trainer.work_dir") + " (on its node), where rank 0 found the run's: every rank must see "
               "the run folder (a file system the nodes share), or give the run's settings on the command line";
  stop_where_ranks_differ(parallel, differ, "configuration",
                          ". Every rank must train one configuration: start all with the same command and configuration "
                          "files (only threads, the data loader's workers, the device, memory.device_memory_limit and paths "
                          "may differ per node)" + unshared);
}

std::vector<std::string> differences_from_rank0(sdk::ParallelStrategy& parallel, const std::map<std::string, std::string>& mine,
                                                const std::function<std::string(const std::string&)>& said) {
  std::string text;
  for (const auto& [key, value] : mine) text.append(key).append(1, '\0').append(value).append(1, '\0');
  HostMemoryScope host;
  at::Tensor length = at::full({1}, static_cast<int64_t>(text.size()), at::kLong);
  parallel.broadcast({length});
  at::Tensor bytes = at::zeros({length.item<int64_t>()}, at::kByte);
  if (parallel.rank() == 0) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  parallel.broadcast({bytes});
  std::map<std::string, std::string> theirs;
  const std::string sent(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
  for (size_t pos = 0; pos < sent.size();) {
    const size_t key_end = sent.find('\0', pos), value_end = sent.find('\0', key_end + 1);
    if (key_end == std::string::npos || value_end == std::string::npos) break;
    theirs[sent.substr(pos, key_end - pos)] = sent.substr(key_end + 1, value_end - key_end - 1);
    pos = value_end + 1;
  }
  std::vector<std::string> differ;
  const std::string rank = std::to_string(parallel.rank());
  for (const auto& [key, value] : mine) {
    const auto it = theirs.find(key);
    if (it == theirs.end()) differ.push_back(said(key) + " on rank " + rank + ", which rank 0 does not have");
    else if (it->second != value) differ.push_back(said(key) + " on rank " + rank + ", " + it->second + " on rank 0");
  }
  for (const auto& [key, value] : theirs)
    if (!mine.count(key)) differ.push_back(key + " = " + value + " on rank 0, which rank " + rank + " does not have");
  return differ;
}

void stop_where_ranks_differ(sdk::ParallelStrategy& parallel, const std::vector<std::string>& differ, const std::string& what,
                             const std::string& fix) {
  // Which ranks differ, then the first difference of the lowest of them, so that every rank's error
  // names one (rank 0's log, on another node, would have said only that some rank differs).
  HostMemoryScope host;
  const int64_t world = parallel.world_size();
  at::Tensor differs = at::zeros({world}, at::kLong);
  if (!differ.empty()) differs.data_ptr<int64_t>()[parallel.rank()] = 1;
  parallel.all_reduce_sum({differs});
  const auto* flags = differs.data_ptr<int64_t>();
  const int64_t first = std::find(flags, flags + world, int64_t{1}) - flags;
  if (first == world) return;
  constexpr int64_t kShown = 512;
  at::Tensor shown = at::zeros({kShown}, at::kLong);  // (a byte per element: summed, the other ranks' are zeros)
  auto* chars = shown.data_ptr<int64_t>();
  if (parallel.rank() == first)
    for (size_t i = 0; i < differ.front().size() && i < static_cast<size_t>(kShown); ++i)
      chars[i] = static_cast<unsigned char>(differ.front()[i]);
  parallel.all_reduce_sum({shown});
  chars = shown.data_ptr<int64_t>();
  std::string first_shown;
  for (int64_t i = 0; i < kShown && chars[i] > 0 && chars[i] < 256; ++i) first_shown += static_cast<char>(chars[i]);
  const std::string rank = std::to_string(parallel.rank());
  // (another version of a model's plugin differs in hundreds of tensors: the first few are said)
  constexpr size_t kListed = 10;
  std::vector<std::string> listed(differ.begin(), differ.begin() + static_cast<std::ptrdiff_t>(std::min(differ.size(), kListed)));
  if (differ.size() > kListed) listed.push_back("and " + std::to_string(differ.size() - kListed) + " more");
  if (!differ.empty()) throw Error("rank " + rank + "'s " + what + " differs from rank 0's: " + join(listed, "; ") + fix);
  const int64_t count = std::count(flags, flags + world, int64_t{1});
  throw Error(std::to_string(count) + (count == 1 ? " rank's " : " ranks' ") + what + " differs from rank 0's; rank " +
              std::to_string(first) + "'s first difference: " + first_shown + " (its own error names every key)" + fix);
}

// The ranks' models and data, compared before the run folder is opened: a plugin of another
// version on one node (a layer more) met rank 0's in the weights' broadcast, and both ranks waited
// parallel.timeout (30 minutes), each blaming the other as gone; data of another size at a path
// that may differ per node sharded with overlaps, unsaid (and of the same size, other samples).
void agree_on_model_and_data(sdk::ParallelStrategy& parallel, const sdk::TensorMap& tensors, const PluginRegistry& registry,
                             const Resolved& config, sdk::Dataset& dataset) {
  if (parallel.world_size() <= 1) return;
  std::map<std::string, std::string> mine;
  for (const auto& [name, t] : tensors) mine["model tensor '" + name + "'"] = c10::str(t.sizes(), " ", t.scalar_type());
  for (const auto& [kind, key] : {std::pair{LOOM_KIND_MODEL, "model.name"}, std::pair{LOOM_KIND_DATASET, "data.name"}})
    if (const auto& plugin = registry.require(kind, value_of(config, key)).plugin)
      mine[kind_name(kind) + " '" + value_of(config, key) + "''s plugin version"] = plugin->version;
  for (const sdk::Split split : {sdk::Split::kTrain, sdk::Split::kValidation, sdk::Split::kTest})
    mine[std::string("samples in the dataset's ") + sdk::split_name(split) + " split"] = std::to_string(dataset.size(split));
  // ... and what the data holds, where the dataset gives a fingerprint of it (Fashion-MNIST's splits,
  // the recommender's held-out samples and items): one label changed on one node's copy trained unsaid.
  for (const auto& [name, value] : dataset.spec().attributes)
    if (name.ends_with(".fingerprint")) mine["the dataset's " + name] = value;
  stop_where_ranks_differ(
      parallel, differences_from_rank0(parallel, mine, [&](const std::string& key) { return key + " " + mine.at(key); }),
      "model or data", ". Every rank needs the same plugins (the same version of each, built alike) and the same data: "
      "a node with another copy of either trains another model, or other samples");
}

// Rank 0's text on every rank, through the strategy's broadcast: its size (-1: rank 0 failed,
// so that no rank waits for it until the timeout), then its bytes. `text` is read on rank 0.
std::optional<std::string> from_rank0(sdk::ParallelStrategy& parallel, const std::optional<std::string>& text) {
  HostMemoryScope host;
  at::Tensor size = at::full({1}, text ? static_cast<int64_t>(text->size()) : int64_t{-1}, at::kLong);
  parallel.broadcast({size});
  const int64_t n = size.item<int64_t>();
  if (n < 0) return std::nullopt;
  at::Tensor bytes = at::zeros({std::max<int64_t>(n, 1)}, at::kByte);
  if (parallel.rank() == 0 && n > 0) std::memcpy(bytes.data_ptr(), text->data(), static_cast<size_t>(n));
  if (n > 0) parallel.broadcast({bytes});
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(n));
}

}  // namespace detail

bool Trainer::any_rank(bool local) {
  if (parallel_->world_size() <= 1) return local;
  HostMemoryScope host;
  at::Tensor flag = at::full({1}, local ? 1.0f : 0.0f, at::kFloat);
  parallel_->all_reduce_sum({flag});
  return flag.item<float>() > 0;
}

// Memory policies plan on every rank, each from its own device's memory: the ranks go on with
// the plan of the smallest micro-batch (the first such rank's), so that every rank fits it.
sdk::BatchPlan Trainer::agree_plan(const sdk::BatchPlan& mine) {
  const int64_t world = parallel_->world_size();
  if (world <= 1) return mine;
  HostMemoryScope host;
  at::Tensor plans = at::zeros({world, 2}, at::kDouble);  // each rank fills its row; the sum is everyone's
  plans[parallel_->rank()][0] = static_cast<double>(mine.micro_batch);
  plans[parallel_->rank()][1] = static_cast<double>(mine.accumulation);
  parallel_->all_reduce_sum({plans});
  const auto* v = plans.data_ptr<double>();
  int64_t chosen = 0;
  for (int64_t r = 1; r < world; ++r)
    if (v[2 * r] < v[2 * chosen]) chosen = r;
  sdk::BatchPlan agreed{static_cast<int64_t>(v[2 * chosen]), static_cast<int64_t>(v[2 * chosen + 1]), world};
  if (!(agreed == mine))
    log::info("plan: ", mine.micro_batch, " x ", mine.accumulation, " x ", world, " -> ", agreed.micro_batch, " x ",
              agreed.accumulation, " x ", world, " (rank ", chosen, "'s plan: the smallest micro-batch of the ranks)");
  return agreed;
}

// A Ctrl-C reaches the ranks at different moments: the step at which the run stops, skips its
// evaluation and writes its checkpoint must be the same on all, or one would wait in a
// collective the others never join. The ranks also agree on which signal it was (the lowest
// rank's that has one): a rank the signal had not reached yet used to report SIGTERM for a Ctrl-C.
// The same sum says whether a callback on some rank asked to stop during the step (another_rank_
// stopped_): the ranks then agree before deciding to evaluate, whose collectives one rank alone
// would run.
int Trainer::stop_signal() {
  const int local = stop_signal_received();
  const int64_t world = parallel_->world_size();
  if (world <= 1) return local;
  if (agreed_signal_ != 0) return agreed_signal_;
  HostMemoryScope host;
  at::Tensor received = at::zeros({world + 1}, at::kFloat);  // each rank's signal at its index; the sum is everyone's
  received[parallel_->rank()] = static_cast<float>(local);
  received[world] = stop_reason_.empty() ? 0.0f : 1.0f;  // how many ranks' callbacks asked to stop
  parallel_->all_reduce_sum({received});
  const auto* v = received.data_ptr<float>();
  for (int64_t r = 0; r < world && agreed_signal_ == 0; ++r) agreed_signal_ = static_cast<int>(v[r]);
  another_rank_stopped_ = v[world] > 0 && stop_reason_.empty();
  return agreed_signal_;
}

void Trainer::check_replicas() {
  if (parallel_->world_size() <= 1) return;
  at::NoGradGuard no_grad;
  HostMemoryScope host;
  // A group of tensors at a time, of 64 MiB or one tensor: two host copies of the whole model on
  // each rank (eight ranks of a 1.5B model: 96 GB) could end a finished run out of host memory.
  const sdk::TensorMap tensors = model_tensors();
  int64_t differ = 0, groups = 0;
  size_t compared = 0;
  std::string first;
  for (auto it = tensors.begin(); it != tensors.end(); ++groups) {
    std::vector<std::string> names;
    std::vector<at::Tensor> mine, theirs;
    const auto fits = [&](int64_t bytes) { return mine.empty() || bytes + static_cast<int64_t>(it->second.nbytes()) <= (64 << 20); };
    for (int64_t bytes = 0; it != tensors.end() && fits(bytes); ++it) {
      bytes += static_cast<int64_t>(it->second.nbytes());
      names.push_back(it->first);
      mine.push_back(it->second.detach().to(at::kCPU));
      theirs.push_back(mine.back().clone());
    }
    parallel_->broadcast(theirs);  // rank 0's (the same groups on every rank: the same model, agreed at the start)
    // (the same bits are the same weights: a NaN, as a run that diverged on every rank ends with,
    // is no value equal to itself, and at::equal alone said the ranks differed; a review)
    const auto same = [](const at::Tensor& a, const at::Tensor& b) {
      if (at::equal(a, b)) return true;
      const at::Tensor x = a.contiguous(), y = b.contiguous();
      return x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type() &&
             std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
    };
    for (size_t i = 0; i < mine.size(); ++i, ++compared)
      if (!same(mine[i], theirs[i]) && differ++ == 0) first = names[i];
  }
  if (!any_rank(differ > 0)) {
    log::info("parallel  weights identical on all ", parallel_->world_size(), " ranks at the end (", compared,
              " tensors compared with rank 0's", groups > 1 ? ", in " + std::to_string(groups) + " parts" : std::string(), ")");
    if (sync_ && sync_->steps() > 0)
      log::info("parallel  gradients in ", sync_->buckets(), " bucket", sync_->buckets() == 1 ? "" : "s", " of about ",
                format_bytes(bucket_bytes_), "; ",
                100.0 * static_cast<double>(sync_->overlapped_total()) /
                    static_cast<double>(sync_->steps() * static_cast<int64_t>(sync_->buckets())),
                " % of them started during backward, over ", sync_->steps(), " steps");
    return;
  }
  throw Error("the ranks ended with different weights" +
              (differ > 0 ? ": rank " + std::to_string(parallel_->rank()) + " differs from rank 0 in " +
                                std::to_string(differ) + " tensors (first: " + first + ")"
                          : std::string(" (the ranks that differ name their tensors)")) +
              "; a plugin that draws or reduces differently per rank is the likely cause. Rank 0's checkpoints "
              "were written");
}

// The data position of a checkpoint is a rank's offset into its share of the epoch; every rank
// of a world of W has taken as many samples, so the epoch's global position is offset x W, and
// in a world of W' each rank resumes at that / W'. The permutation of an epoch does not depend on
// the world, so the samples left are the same.
DataLoader::Position Trainer::position_for_world(int64_t epoch, int64_t offset, int64_t saved_world) const {
  const int64_t world = parallel_->world_size();
  if (saved_world == world) return {epoch, offset};
  const int64_t global = offset * saved_world;
  if (global % world != 0)
    log::warn("the checkpoint's data position (", global, " samples into epoch ", epoch, " over ", saved_world,
              " ranks) does not divide among ", world, " ranks; each rank goes on from sample ", global / world,
              " of its share");
  log::info("resuming a run of ", saved_world, " rank", saved_world == 1 ? "" : "s", " with ", world, ": ", global,
            " samples into epoch ", epoch, " are ", global / world, " of each rank's share");
  // (not cut to this run's epoch here: the global batch a resume adopts after this lengthens it;
  // on_the_steps_grid takes a position past the end to the next epoch; a review)
  return {epoch, global / world};
}

}  // namespace loom::core
