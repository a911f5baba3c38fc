// Tier-1 interface of a dataset plugin: batched random access to samples.
//
// The host's loader owns the order (seeded shuffling, sharding across ranks, prefetching on
// worker threads, pinned memory): a dataset only answers "give me these samples".
#pragma once

#include <loom/sdk/abi.h>
#include <loom/sdk/types.hpp>

#include <vector>

namespace loom::sdk {

class LOOM_SDK_API Dataset {
 public:
  using Interface = Dataset;
  static constexpr uint32_t kKind = LOOM_KIND_DATASET;
  static constexpr uint32_t kInterfaceMajor = 1;
  static constexpr uint32_t kInterfaceMinor = 3;  // 1.1: Split::kValidation; 1.2: tables(); 1.3: get_batch_into

  virtual ~Dataset();  // defined in libloom_sdk: its type info has one home

  /// Opens and checks the data. Called once, on the main thread, before any other method. A
  /// missing, truncated or corrupt file throws Error naming the file and what is wrong.
  virtual void setup() = 0;

  /// The fields of a sample. Valid after setup; constant afterwards.
  virtual DataSpec spec() const = 0;

  /// Number of samples of a split (0 when the dataset has no such split). The host asks for
  /// Split::kValidation only from datasets built against interface 1.1 or newer; one that has no
  /// validation split returns 0, and the host holds out data.validation_fraction of train.
  virtual int64_t size(Split split) const = 0;

  /// The samples at `indices` (each in [0, size(split))), stacked: every tensor's first
  /// dimension is indices.size(). CPU tensors, contiguous. Thread-safe: the loader calls it from
  /// several worker threads at once, so it must not modify shared state without a lock.
  virtual Batch get_batch(Split split, const std::vector<int64_t>& indices) const = 0;

  /// Data the whole dataset shares rather than each sample (since 1.2): an item catalogue, each
  /// user's known items. CPU tensors, asked once after setup; the host hands them to the model
  /// (Model::use_tables, Model 2.1). Their names and meaning are a contract between a dataset and
  /// the models that read it, documented by both. Default: none.
  virtual TensorMap tables() const { return {}; }

  /// get_batch into `out`, whose tensors the host's loader reuses from batch to batch (pinned
  /// host memory for a CUDA device), so that a steady state allocates no batch memory (since
  /// 1.3). Where `out` has a field of the right dtype, write the samples into that tensor,
  /// resizing it to the batch's shape (index_select's out= form: TensorDataset does); other
  /// fields may be replaced; fields the batch does not have are removed. The host owns `out` and
  /// guarantees nobody else reads it meanwhile. Thread-safe as get_batch. Default: `out` becomes
  /// get_batch's batch (fresh memory each time; no LibTorch call inline here, so that this header
  /// still builds a plugin the host refuses for its C++ ABI and can name).
  virtual void get_batch_into(Split split, const std::vector<int64_t>& indices, Batch& out) const {
    out = get_batch(split, indices);
  }
};

}  // namespace loom::sdk
