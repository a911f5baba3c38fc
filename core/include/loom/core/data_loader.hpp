// The data loader: the order of samples and the threads that fetch them.
//
// Order: each epoch is a permutation of the split, drawn from (seed, epoch) alone, so it is the
// same in every run with that seed; with several ranks each takes every world-th sample of the
// permutation (the tail that does not divide evenly is dropped, so all ranks take as many
// steps). The position (epoch, samples consumed in it) is all a checkpoint needs to resume the
// exact sequence of batches, and it stays valid when the micro-batch changes (OOM recovery).
//
// Threads: `workers` threads fetch upcoming batches (Dataset::get_batch), at most
// workers x prefetch ahead, and pin them when the target device is CUDA (PyTorch's caching host
// allocator reuses the pinned blocks); next() hands them out in order. The threads live as long
// as the loader, across epochs.
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
#include <thread>
#include <vector>

namespace loom::core {

class DataLoader {
 public:
  struct Options {
    int64_t micro_batch = 32;
    bool shuffle = true;
    bool drop_last = true;   ///< drop the last incomplete batch of an epoch (training)
    uint64_t seed = 0;
    int64_t rank = 0;
    int64_t world_size = 1;
    int64_t workers = 2;     ///< 0: fetch on the calling thread
    int64_t prefetch = 2;    ///< batches each worker may prepare ahead
    bool pin_memory = true;  ///< only used when `device` is CUDA
    c10::Device device{c10::kCPU};
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
  /// Changes the micro-batch from the next batch on (the position is kept).
  void set_micro_batch(int64_t micro_batch);
  int64_t micro_batch() const { return options_.micro_batch; }

  /// This rank's samples per epoch, and micro-batches per epoch (full ones only when
  /// drop_last; otherwise the last may be smaller).
  int64_t samples_per_epoch() const;
  int64_t batches_per_epoch() const;

 private:
  struct Job {
    uint64_t generation;
    uint64_t sequence;
    std::vector<int64_t> indices;
  };
  const std::vector<int64_t>& order(int64_t epoch);  // this rank's indices of an epoch
  void restart();       // drop queued work, plan from position_
  void schedule();      // queue jobs up to the prefetch depth
  void worker_loop();
  sdk::Batch fetch(const std::vector<int64_t>& indices) const;
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
  std::optional<c10::Stream> copy_stream_;

  std::shared_ptr<sdk::Dataset> dataset_;
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
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace loom::core
