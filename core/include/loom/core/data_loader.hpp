// The data loader: the order of samples and the threads that fetch them.
//
// Order: each epoch is a permutation of the split, drawn from (seed, epoch) alone, so it is the
// same in every run with that seed; with several ranks each takes every world-th sample of the
// permutation (the tail that does not divide evenly is dropped, so all ranks take as many
// steps). The position (epoch, samples consumed in it) is all a checkpoint needs to resume the
// exact sequence of batches, and it stays valid when the micro-batch changes (OOM recovery).
//
// Threads: `workers` threads fetch upcoming batches, at most workers x prefetch ahead; next()
// hands them out in order. The threads live as long as the loader, across epochs.
//
// Buffers (Note [Reused batch buffers]): a batch is fetched into one of a ring of buffers
// (pinned host memory when the device is CUDA) that the loader reuses once nobody holds the
// batch it last handed out from it, so a steady state allocates no batch memory; a buffer still
// held (a caller keeps the batch) is left alone and the batch gets fresh memory.
//
// On CUDA one batch more is already on the device: next() hands out the batch copied during the
// previous step and queues the copy of the following one on a copy stream of its own, so that
// the copy overlaps the step's kernels. The compute stream waits for the copy's event, and the
// batch's memory is marked in use by the compute stream (record_stream) so that the caching
// allocator does not hand it out again before the step is done with it.
#pragma once

#include <loom/sdk/dataset.hpp>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace loom::core {

/// "" where every target of `spec`'s target field in `batch` is a class of `spec` (or -100, the
/// index a loss ignores, or the data is no classification with integer targets); otherwise
/// "targets run from L to H, outside the classes 0..N-1 that spec().num_classes = N gives". A
/// classifier's loss indexes its logits by the target: one outside fails in the model, far from
/// the dataset that gave it. Reads the targets on the host (a failure to, as after a device-side
/// assert, gives "").
std::string targets_outside_classes(const sdk::DataSpec& spec, const sdk::Batch& batch);

/// Refuses a split whose sample indices would not fit in the host's available memory: the loader
/// holds each epoch's order of them (a permutation, this rank's share, the next epoch's), about
/// 32 bytes a sample. A dataset that said 3e9 samples ran the machine out of memory in set-up,
/// where the kernel killed it after minutes, its stop signal unheard (probe). `name`: the dataset's
/// component name.
void check_order_memory(const std::string& name, sdk::Split split, int64_t samples);

class DataLoader {
 public:
  struct Options {
    int64_t micro_batch = 32;
    bool shuffle = true;
    bool drop_last = true;   ///< drop the last incomplete batch of an epoch (training)
    /// This rank's samples per optimizer step (the micro-batch times the accumulation), with
    /// drop_last: an epoch holds whole steps, so its end does not move when the micro-batch does
    /// (OOM recovery) and no step spans two epochs (Note [An epoch of whole steps]). 0: one micro-batch.
    int64_t step_samples = 0;
    /// Nothing is fetched past an epoch's end (evaluation: the loader idles between passes, where
    /// it fetched the next epoch's first batches, and on CUDA held one on the device, until the
    /// next evaluation); a next() past the end is an error.
    bool one_epoch = false;
    uint64_t seed = 0;
    int64_t rank = 0;
    int64_t world_size = 1;
    int64_t workers = 2;     ///< 0: fetch on the calling thread
    int64_t prefetch = 2;    ///< batches each worker may prepare ahead
    bool pin_memory = true;  ///< only used when `device` is CUDA
    /// The dataset implements Dataset::get_batch_into (interface 1.3): batches are fetched into
    /// the loader's reused buffers. Without it, buffers are used only to pin (CUDA).
    bool fills_buffers = false;
    c10::Device device{c10::kCPU};
    /// The dataset's component name, which its errors are given (empty: "the dataset").
    std::string name;
    /// The split's samples this loader draws from, as dataset indices (a held-out validation
    /// share of train, or the rest); empty: the whole split.
    std::vector<int64_t> subset;
  };

  struct Position {
    int64_t epoch = 0;
    int64_t offset = 0;  ///< samples of this rank's share of the epoch already handed out
  };

  DataLoader(std::shared_ptr<sdk::Dataset> dataset, sdk::Split split, Options options);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// The next micro-batch, on the device. Crosses into the next epoch when this one is used up.
  sdk::Batch next();

  Position position() const { return position_; }
  /// Continues from `position` (from a checkpoint, or a step to replay).
  void seek(Position position);
  /// Changes the micro-batch from the next batch on (the position is kept), and the samples of a
  /// step (Options::step_samples; a multiple of the micro-batch, or 0).
  void set_micro_batch(int64_t micro_batch, int64_t step_samples);
  int64_t micro_batch() const { return options_.micro_batch; }

  /// This rank's samples per epoch, and micro-batches per epoch (full ones only when
  /// drop_last, whole steps of them; otherwise the last may be smaller).
  int64_t samples_per_epoch() const;
  int64_t batches_per_epoch() const;
  /// The samples of the split (or subset) across every rank.
  int64_t size() const { return size_; }

  /// Batches fetched into fresh memory because their buffer was still held (or there is none
  /// to reuse: the first of each buffer, a dataset without get_batch_into on the CPU).
  int64_t fresh_batches() const;

 private:
  struct Job {
    uint64_t generation;
    uint64_t sequence;
    std::vector<int64_t> indices;
    size_t buffer;  // the ring's buffer it is fetched into
  };
  struct Buffer {
    sdk::Batch batch;
    bool busy = false;  // a worker is filling it (under mutex_)
  };
  const std::vector<int64_t>& order(int64_t epoch);  // this rank's indices of an epoch
  static void check_micro_batch(int64_t micro_batch, int64_t step_samples);
  void restart();       // drop queued work, plan from position_
  void schedule();      // queue jobs up to the prefetch depth
  bool planned_none() const;  // no batch is planned after those handed out (one_epoch: the pass ended)
  void worker_loop();
  sdk::Batch fetch(const Job& job);
  /// Whether nobody but the buffer holds its tensors (then they may be written again).
  static bool unheld(const sdk::Batch& batch);
  /// The next batch in order, on the host, and the position once it is handed out.
  std::pair<sdk::Batch, Position> take();
  /// A batch whose copy to the device is queued on the copy stream (CUDA).
  struct Staged {
    sdk::Batch batch;
    Position after;
    c10::Event copied{c10::DeviceType::CUDA};
  };
  Staged stage(std::pair<sdk::Batch, Position> taken);
  std::optional<Staged> staged_;          // the next batch, on its way to the device
  // Host batches whose copy to the device may still run: held (so their buffer is not written)
  // until their event says the copy is done. Main thread only.
  std::deque<std::pair<sdk::Batch, c10::Event>> copying_;
  std::optional<c10::Stream> copy_stream_;

  std::shared_ptr<sdk::Dataset> dataset_;
  sdk::DataSpec spec_;  // what each batch is checked against (a field missing or of another shape was the model's error)
  sdk::Split split_;
  Options options_;
  int64_t size_ = 0;
  Position position_;

  std::map<int64_t, std::vector<int64_t>> orders_;  // epoch -> this rank's order (a few cached)

  // Planning state (main thread): where the next job to schedule starts.
  Position planned_;
  uint64_t next_sequence_ = 0;  // of the next job to schedule
  uint64_t next_to_hand_ = 0;   // sequence next() returns next
  uint64_t generation_ = 0;

  mutable std::mutex mutex_;
  std::condition_variable work_ready_, result_ready_;
  std::deque<Job> jobs_;
  std::map<uint64_t, sdk::Batch> results_;
  std::map<uint64_t, std::exception_ptr> errors_;
  std::map<uint64_t, Position> position_after_;  // sequence -> the position once it is handed out
  std::vector<Buffer> buffers_;  // Note [Reused batch buffers]
  uint64_t next_buffer_ = 0;     // never reset: a job of an older generation may still fill one
  int64_t fresh_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

/// Throws loom::Error, naming `who` (the dataset and its call), where `batch` is not what the
/// dataset's spec says a batch of `rows` samples is: every tensor's first dimension `rows`, each
/// field of the spec there, of its dtype and shape, on the CPU.
void check_batch(const std::string& who, const sdk::DataSpec& spec, const sdk::Batch& batch, int64_t rows);

}  // namespace loom::core
