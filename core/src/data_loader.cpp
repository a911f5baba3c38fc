// The data loader. See data_loader.hpp.
//
// Note [Reused batch buffers]
// Each job is fetched into a buffer of a ring (Dataset::get_batch_into, 1.3: index_select's out=
// form), pinned for a CUDA device, so that a run in its steady state allocates no batch memory and
// pins nothing anew. A buffer is written again only when nothing but the ring holds its tensors
// (their reference counts, storage included: a caller that keeps a batch, a view of it, autograd's
// saved input all count), and, on CUDA, once the copy to the device made from it is done (its
// event, queried without waiting). Otherwise the job takes fresh memory, as before buffers: a
// caller that keeps batches loses nothing, it only allocates. The ring holds depth + workers + 3
// buffers: the jobs in flight, a batch handed out, the next one staged on the device, and a
// job of an older generation a worker may still be filling after a seek (buffers are numbered
// by a counter a seek does not reset, and a busy flag keeps two jobs off one buffer).
#include <loom/core/error.hpp>
#include <loom/core/data_loader.hpp>
#include <loom/core/device_memory.hpp>
#include <loom/core/log.hpp>
#include <loom/core/text.hpp>

#include <system_error>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/masked_select.h>
#include <ATen/ops/max.h>
#include <ATen/ops/min.h>
#include <ATen/ops/ne.h>
#include <ATen/ops/randperm.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <c10/util/ParallelGuard.h>

#include <algorithm>
#include <numeric>

namespace loom::core {

std::string targets_outside_classes(const sdk::DataSpec& spec, const sdk::Batch& batch) {
  const auto field = spec.fields.find(spec.target_key);
  const auto target = batch.find(spec.target_key);
  if (spec.num_classes <= 0 || field == spec.fields.end() || !at::isIntegralType(field->second.dtype, false) ||
      target == batch.end() || !target->second.defined())
    return {};
  try {
    const at::Tensor all = target->second.to(at::kCPU);
    const at::Tensor t = all.masked_select(all.ne(-100));  // (-100: a target the loss ignores, as padding)
    if (t.numel() == 0) return {};
    const int64_t low = t.min().item<int64_t>(), high = t.max().item<int64_t>();
    if (low >= 0 && high < spec.num_classes) return {};
    return "targets run from " + std::to_string(low) + " to " + std::to_string(high) + ", outside the classes 0.." +
           std::to_string(spec.num_classes - 1) + " that spec().num_classes = " + std::to_string(spec.num_classes) + " gives";
  } catch (const std::exception&) {
    return {};  // (the device is unusable after a device-side assert: nothing more to say)
  }
}

void check_batch(const std::string& who, const sdk::DataSpec& spec, const sdk::Batch& batch, int64_t rows) {
  // Every tensor's first dimension is the batch's (the Dataset contract): a short or empty batch
  // would train and evaluate on fewer samples than the counts say, in silence.
  for (const auto& [name, t] : batch)
    if (!t.defined() || t.dim() == 0 || t.size(0) != rows)
      throw Error(who + "'s get_batch of " + std::to_string(rows) + " samples gave field '" + name + "' " +
                  (!t.defined() ? std::string("undefined") : "of shape " + c10::str(t.sizes())) + "; every field's first "
                  "dimension is the number of samples asked for (loom plugins check tests a dataset)");
  // ... and the fields its spec() describes, as it describes them, on the CPU: a batch that is
  // not failed in the model, which was blamed ("model 'x': map::at", "mat1 and mat2 shapes").
  for (const auto& [name, field] : spec.fields) {
    const auto it = batch.find(name);
    const at::Tensor* t = it == batch.end() ? nullptr : &it->second;
    if (t != nullptr && t->scalar_type() == field.dtype && t->device().is_cpu() && t->sizes().slice(1).vec() == field.shape)
      continue;
    std::vector<int64_t> want{rows};
    want.insert(want.end(), field.shape.begin(), field.shape.end());
    throw Error(who + ": get_batch of " + std::to_string(rows) + " samples gave field '" + name + "' " +
                (t == nullptr ? std::string("not at all")
                              : "as " + std::string(c10::toString(t->scalar_type())) + " " + c10::str(t->sizes()) + " on " +
                                    t->device().str()) +
                "; its spec() says " + c10::toString(field.dtype) + " " + c10::str(c10::IntArrayRef(want)) +
                " on the CPU (loom plugins check tests a dataset)");
  }
}

void check_order_memory(const std::string& name, sdk::Split split, int64_t samples) {
  constexpr int64_t kBytesPerSample = 32;
  const int64_t available = available_memory();
  if (available <= 0 || samples <= available / kBytesPerSample) return;
  const double bytes = static_cast<double>(samples) * kBytesPerSample;  // (a size() of 2^62: no int64 overflow)
  throw Error((name.empty() ? std::string("the dataset") : "dataset '" + name + "'") + " says its " + sdk::split_name(split) +
              " split has " + std::to_string(samples) + " samples: Loom's loader keeps each epoch's order of them in host "
              "memory, about " + std::to_string(kBytesPerSample) + " bytes a sample (" +
              (bytes < 9e18 ? format_bytes(static_cast<int64_t>(bytes)) : std::string("more than 8 EiB")) +
              "), more than the " + format_bytes(available) + " available; if that size is right, the split needs a machine "
              "with more memory or to be cut into parts; if not, its size() is wrong (a bug of the plugin's: report it to its author)");
}

DataLoader::DataLoader(std::shared_ptr<sdk::Dataset> dataset, sdk::Split split, Options options)
    : dataset_(std::move(dataset)), split_(split), options_(options) {
  check_micro_batch(options_.micro_batch, options_.step_samples);
  if (options_.world_size < 1 || options_.rank < 0 || options_.rank >= options_.world_size)
    throw Error("loader: rank " + std::to_string(options_.rank) + " outside world of " + std::to_string(options_.world_size));
  size_ = options_.subset.empty() ? dataset_->size(split_) : static_cast<int64_t>(options_.subset.size());
  try {
    spec_ = dataset_->spec();
  } catch (const std::exception& e) {
    throw Error((options_.name.empty() ? std::string("the dataset") : "dataset '" + options_.name + "'") + " (spec()): " + e.what());
  }
  // (2^62 from a dataset's size() ended the first step with "cannot create std::vector larger than max_size()")
  if (constexpr int64_t kMaxSamples = int64_t{1} << 40; size_ < 0 || size_ > kMaxSamples)
    throw Error((options_.name.empty() ? std::string("the dataset") : "dataset '" + options_.name + "'") + " says its " + sdk::split_name(split_) + " split has " + std::to_string(size_) +
                " samples, outside [0, 2^40]: its size() is wrong (a bug of the plugin's: report it to its author)");
  check_order_memory(options_.name, split_, size_);
  // (Evaluation: a rank past a split smaller than the world has no sample and adds zeros to the sums.)
  if (options_.drop_last ? size_ / options_.world_size < options_.micro_batch : size_ < 1)
    throw Error(std::string("the ") + sdk::split_name(split_) + " split has " + std::to_string(size_) +
                " samples, too few for one micro-batch of " + std::to_string(options_.micro_batch) +
                (options_.world_size > 1 ? " on each of " + std::to_string(options_.world_size) + " ranks" : std::string()) +
                "; lower the batch size");
  if (options_.fills_buffers || (options_.pin_memory && options_.device.is_cuda())) {
    const int64_t depth = std::max<int64_t>(1, options_.workers * options_.prefetch);
    buffers_.resize(static_cast<size_t>(depth + options_.workers + 3));
  }
  try {
    threads_.reserve(static_cast<size_t>(options_.workers));  // (a bad_alloc between starts: threads destroyed running)
    for (int64_t i = 0; i < options_.workers; ++i) threads_.emplace_back([this] { worker_loop(); });
  } catch (const std::exception& e) {
    // The threads that did start are stopped and joined: a constructor that throws runs no
    // destructor, and a joinable thread destroyed would end the process.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_ready_.notify_all();
    for (auto& t : threads_) t.join();
    throw Error("the data loader could not start thread " + std::to_string(threads_.size() + 1) + " of " +
                std::to_string(options_.workers) + " (" + e.what() + "); lower data.num_workers");
  }
}

DataLoader::~DataLoader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& t : threads_) t.join();
}

// Training drops the tail that does not divide by the world (every rank takes as many samples,
// so the ranks step together) and then the tail of whole steps (below); evaluation keeps it, rank
// r taking samples r, r + world, ..., and the ranks' sums and counts add up to the whole split's.
//
// Note [An epoch of whole steps]
// An epoch ended where the next micro-batch did not fit: with gradient accumulation a step could
// take an epoch's last micro-batches and the next epoch's first (a sample twice in one step,
// under another permutation), and where OOM recovery halved the micro-batch the epoch's end
// moved, so the recovered run trained on other samples than the run that never ran out of
// memory from the first epoch's end on (1000 samples, 48 = 24 x 2: step 21 took 960..983 of
// epoch 0 where the plain run took epoch 1's first 48; a review). The epoch holds whole steps:
// the same samples whatever the split of a step into micro-batches. (A resume at an offset off
// the steps' grid, from a checkpoint of before or with another global batch or world size, goes on
// at the next step's start: Trainer::on_the_steps_grid.)
int64_t DataLoader::samples_per_epoch() const {
  if (!options_.drop_last) return (size_ - options_.rank + options_.world_size - 1) / options_.world_size;
  const int64_t unit = options_.step_samples > 0 ? options_.step_samples : options_.micro_batch;
  return size_ / options_.world_size / unit * unit;
}

int64_t DataLoader::batches_per_epoch() const {
  const int64_t n = samples_per_epoch();
  return options_.drop_last ? n / options_.micro_batch : (n + options_.micro_batch - 1) / options_.micro_batch;
}

const std::vector<int64_t>& DataLoader::order(int64_t epoch) {
  auto it = orders_.find(epoch);
  if (it != orders_.end()) return it->second;
  std::vector<int64_t> all(static_cast<size_t>(size_));
  if (options_.shuffle) {
    // A permutation that depends on (seed, epoch) only.
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(options_.seed * 1000003ULL + static_cast<uint64_t>(epoch));
    const at::Tensor perm = at::randperm(size_, gen, at::TensorOptions().dtype(at::kLong));
    std::memcpy(all.data(), perm.data_ptr<int64_t>(), all.size() * sizeof(int64_t));
  } else {
    std::iota(all.begin(), all.end(), int64_t{0});
  }
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(samples_per_epoch()));
  const int64_t end = options_.drop_last ? samples_per_epoch() * options_.world_size : size_;
  for (int64_t i = options_.rank; i < end; i += options_.world_size) {
    const int64_t position = all[static_cast<size_t>(i)];
    mine.push_back(options_.subset.empty() ? position : options_.subset[static_cast<size_t>(position)]);
  }
  while (orders_.size() >= 2) orders_.erase(orders_.begin());
  return orders_[epoch] = std::move(mine);
}

void DataLoader::restart() {
  staged_.reset();  // planned from the position before it
  std::lock_guard<std::mutex> lock(mutex_);
  ++generation_;
  jobs_.clear();
  results_.clear();
  errors_.clear();
  position_after_.clear();
  planned_ = position_;
  next_sequence_ = next_to_hand_ = 0;
}

void DataLoader::seek(Position position) {
  position_ = position;
  restart();
}

void DataLoader::check_micro_batch(int64_t micro_batch, int64_t step_samples) {
  if (micro_batch < 1) throw Error("loader: micro-batch must be at least 1");
  if (step_samples < 0 || step_samples % micro_batch != 0)
    throw Error("loader: a step of " + std::to_string(step_samples) + " samples is no whole number of micro-batches of " +
                std::to_string(micro_batch));
}

void DataLoader::set_micro_batch(int64_t micro_batch, int64_t step_samples) {
  check_micro_batch(micro_batch, step_samples);
  const int64_t before = samples_per_epoch();
  options_.micro_batch = micro_batch;
  options_.step_samples = step_samples;
  if (samples_per_epoch() != before) orders_.clear();  // (an order is cut to the epoch's length)
  restart();
}

void DataLoader::schedule() {
  const uint64_t depth = static_cast<uint64_t>(std::max<int64_t>(1, options_.workers * options_.prefetch));
  const int64_t spe = samples_per_epoch();
  std::unique_lock<std::mutex> lock(mutex_);
  bool added = false;
  while (next_sequence_ - next_to_hand_ < depth) {
    const int64_t need = options_.drop_last ? options_.micro_batch : 1;
    if (planned_.offset + need > spe) {
      if (options_.one_epoch) break;
      planned_ = {planned_.epoch + 1, 0};
      if (need > spe)  // (an epoch of no step, which the trainer refuses before the first batch)
        throw Error("loader: an epoch of " + std::to_string(spe) + " samples holds no micro-batch of " + std::to_string(need));
    }
    lock.unlock();
    const std::vector<int64_t>& ord = order(planned_.epoch);
    const int64_t end = std::min(spe, planned_.offset + options_.micro_batch);
    std::vector<int64_t> indices(ord.begin() + planned_.offset, ord.begin() + end);
    lock.lock();
    planned_.offset = end;
    position_after_[next_sequence_] = planned_;
    const size_t buffer = buffers_.empty() ? 0 : static_cast<size_t>(next_buffer_++ % buffers_.size());
    jobs_.push_back(Job{generation_, next_sequence_, std::move(indices), buffer});
    ++next_sequence_;
    added = true;
    if (threads_.empty()) break;  // synchronous: one at a time
  }
  if (added) work_ready_.notify_all();
}

bool DataLoader::unheld(const sdk::Batch& batch) {
  return std::all_of(batch.begin(), batch.end(), [](const auto& field) {
    const at::Tensor& t = field.second;
    return !t.defined() || (t.use_count() == 1 && t.storage().use_count() == 1);
  });
}

int64_t DataLoader::fresh_batches() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return fresh_;
}

sdk::Batch DataLoader::fetch(const Job& job) {
  // Batches are host memory, as on a GPU, where the ring is pinned host memory and only the
  // batch in use and the next one staged are the device's: on a CPU device (its --device-memory-limit
  // emulation) the ring would otherwise fill the budget with batch buffers that no memory probe
  // measured, and a micro-batch the probes found to fit ran out of memory a few steps later.
  HostMemoryScope host;
  const bool pin = options_.pin_memory && options_.device.is_cuda();
  // Fills `into` (empty: fresh memory) with the job's samples, pinned where the device is CUDA.
  const auto rows = static_cast<int64_t>(job.indices.size());
  const std::string who = options_.name.empty() ? "the dataset" : "dataset '" + options_.name + "'";
  // A dataset's error names it and the call, unless its message does (a built-in's "fashion_mnist: ...").
  // (and which samples: the first few of the batch's indices, to find a bad one by)
  const auto named = [&](const std::string& message) {
    std::string samples;
    for (size_t i = 0; i < job.indices.size() && i < 4; ++i) samples += (i ? ", " : "") + std::to_string(job.indices[i]);
    if (job.indices.size() > 4) samples += ", ...";
    const std::string which = " (get_batch of " + std::to_string(rows) + " " + sdk::split_name(split_) + " samples: " + samples + ")";
    if (!options_.name.empty() && message.rfind(options_.name + ":", 0) == 0) return Error(message + which);
    return Error(who + which + ": " + message);
  };
  auto fill = [&](sdk::Batch& into) {
    try {
      if (options_.fills_buffers) {
        dataset_->get_batch_into(split_, job.indices, into);
      } else {  // an older dataset: its batch copied into pinned buffers (pin is true here when into is not empty)
        sdk::Batch fresh = dataset_->get_batch(split_, job.indices);
        for (auto it = into.begin(); it != into.end();) it = fresh.count(it->first) ? std::next(it) : into.erase(it);
        for (auto& [name, t] : fresh) {
          at::Tensor& target = into[name];
          if (target.defined() && target.scalar_type() == t.scalar_type()) target.resize_(t.sizes()).copy_(t);
          else target = t;
        }
      }
    } catch (const c10::OutOfMemoryError&) {
      throw;
    } catch (const c10::Error& e) {
      throw named(explained(e));
    } catch (const std::exception& e) {
      throw named(e.what());
    } catch (...) {  // (not a std::exception: it passed unnamed, and a prefetch on CUDA lost its batch)
      throw named("an exception that is no std::exception");
    }
    check_batch(who, spec_, into, rows);
    if (pin)
      for (auto& [name, t] : into)
        if (!t.is_pinned()) t = t.pin_memory();
  };
  bool reuse = false;
  if (!buffers_.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    Buffer& buffer = buffers_[job.buffer];
    reuse = !buffer.busy && unheld(buffer.batch);
    if (reuse) buffer.busy = true;
    if (reuse && buffer.batch.empty()) ++fresh_;  // its first fill allocates
  }
  if (!reuse) {
    sdk::Batch batch;
    fill(batch);
    std::lock_guard<std::mutex> lock(mutex_);
    ++fresh_;
    return batch;
  }
  Buffer& buffer = buffers_[job.buffer];
  try {
    fill(buffer.batch);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    buffer.batch.clear();  // half written
    buffer.busy = false;
    throw;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  buffer.busy = false;
  return buffer.batch;  // shares its tensors: held from here until the caller lets go
}

void DataLoader::worker_loop() {
  // Note [Data loader threads run operators serially]
  // An ATen operator called from a thread that is not in a parallel region may start its own
  // team of intra-op threads (with OpenMP, one team per calling thread, whose threads spin after
  // each region). On a machine with as many cores as intra-op threads that steals time from the
  // training step: measured at batch 128 on 2 cores, 927 samples/s with 2 loader threads against
  // 1142 with none. Marking the thread as inside a parallel region makes every operator it calls
  // run serially on it.
  c10::ParallelGuard serial(true);
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_ready_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
    if (stopping_) return;
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    sdk::Batch batch;
    std::exception_ptr error;
    try {
      batch = fetch(job);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (job.generation != generation_) continue;  // planned before a seek: nobody wants it
    if (error) errors_[job.sequence] = error;
    else results_[job.sequence] = std::move(batch);
    result_ready_.notify_all();
  }
}

std::pair<sdk::Batch, DataLoader::Position> DataLoader::take() {
  schedule();
  sdk::Batch batch;
  Position after;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t want = next_to_hand_;
    if (want >= next_sequence_)  // (one_epoch, at its end: no batch is planned, none would come)
      throw Error("loader: a batch asked for past the end of the " + std::string(sdk::split_name(split_)) + " split's pass");
    if (threads_.empty()) {
      Job job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      try {
        batch = fetch(job);
      } catch (...) {
        restart();  // the batch is not consumed: a retry fetches it again (the job was taken off the queue)
        throw;
      }
      lock.lock();
    } else {
      result_ready_.wait(lock, [&] { return results_.count(want) || errors_.count(want); });
      if (auto e = errors_.find(want); e != errors_.end()) {
        const std::exception_ptr error = e->second;
        errors_.erase(e);
        lock.unlock();
        restart();  // the batch is not consumed: a retry fetches it again
        std::rethrow_exception(error);
      }
      batch = std::move(results_[want]);
      results_.erase(want);
    }
    after = position_after_[want];
    position_after_.erase(want);
    ++next_to_hand_;
  }
  schedule();
  return {std::move(batch), after};
}

DataLoader::Staged DataLoader::stage(std::pair<sdk::Batch, Position> taken) {
  const auto* cuda = c10::impl::getDeviceGuardImpl(options_.device.type());
  if (!copy_stream_) copy_stream_ = cuda->getStreamFromGlobalPool(options_.device, /*isHighPriority=*/false);
  // Host batches whose copies are done let go of their buffers (Note [Reused batch buffers]).
  while (!copying_.empty() && copying_.front().second.query()) copying_.pop_front();
  Staged staged;
  staged.after = taken.second;
  const c10::StreamGuard on_copy_stream(*copy_stream_);
  for (auto& [name, t] : taken.first) staged.batch[name] = t.to(options_.device, /*non_blocking=*/options_.pin_memory);
  staged.copied.record(*copy_stream_);
  copying_.emplace_back(std::move(taken.first), c10::Event(options_.device.type()));
  copying_.back().second.record(*copy_stream_);
  return staged;
}

bool DataLoader::planned_none() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_to_hand_ >= next_sequence_;
}

sdk::Batch DataLoader::next() {
  if (!options_.device.is_cuda()) {
    auto [batch, after] = take();
    position_ = after;
    if (options_.device.is_cpu()) return batch;
    for (auto& [name, t] : batch) t = t.to(options_.device);
    return batch;
  }
  Staged current = staged_ ? std::move(*staged_) : stage(take());
  staged_.reset();
  position_ = current.after;
  const c10::Stream compute = c10::impl::getDeviceGuardImpl(options_.device.type())->getStream(options_.device);
  current.copied.block(compute);
  for (auto& [name, t] : current.batch) t.record_stream(compute);
  // The following batch: its copy runs while the caller computes on this one. A failure to get
  // it is not this batch's: the next call fetches it again and reports it then.
  try {
    if (options_.one_epoch && planned_none()) return std::move(current.batch);  // (the pass's last)
    staged_ = stage(take());
  } catch (const std::exception& e) {
    log::debug("loader: prefetching the next batch failed (asked again at the next batch): ", e.what());
    restart();
  }
  return std::move(current.batch);
}

}  // namespace loom::core
