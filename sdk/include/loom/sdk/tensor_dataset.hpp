// A dataset held in memory as tensors, one set of named fields per split: a plugin loads or
// makes its data in setup() and hands each split to set_split(); size() and get_batch() (index
// checks, index_select, safe for the loader's worker threads) come from here. Fashion-MNIST, the
// synthetic data and the regression example are such datasets.
#pragma once

#include <loom/sdk/dataset.hpp>

#include <ATen/ops/index_select.h>
#include <ATen/ops/tensor.h>

#include <map>
#include <string>
#include <vector>

namespace loom::sdk {

class TensorDataset : public Dataset {
 public:
  int64_t size(Split split) const override {
    auto it = splits_.find(split);
    return it == splits_.end() ? 0 : it->second.size;
  }

  Batch get_batch(Split split, const std::vector<int64_t>& indices) const override {
    auto it = splits_.find(split);
    if (it == splits_.end()) throw Error(name_ + " has no " + split_name(split) + " split");
    const int64_t n = it->second.size;
    for (int64_t i : indices)
      if (i < 0 || i >= n)
        throw Error(name_ + ": index " + std::to_string(i) + " out of range [0, " + std::to_string(n) + ") of the " +
                    split_name(split) + " split");
    const at::Tensor index = at::tensor(indices, at::TensorOptions().dtype(at::kLong));
    Batch out;
    for (const auto& [field, tensor] : it->second.fields) out[field] = at::index_select(tensor, 0, index);
    return out;
  }

 protected:
  /// `name` appears in error messages ("fashion_mnist: index 70000 out of range ...").
  explicit TensorDataset(std::string name) : name_(std::move(name)) {}

  /// The samples of `split`: each field's first dimension is the sample (all the same length).
  /// Call from setup(), on the main thread; a split not set has no samples.
  void set_split(Split split, Batch fields) {
    int64_t n = -1;
    for (const auto& [field, tensor] : fields) {
      if (tensor.dim() < 1) throw Error(name_ + ": field '" + field + "' of the " + split_name(split) + " split has no sample dimension");
      if (n >= 0 && tensor.size(0) != n)
        throw Error(name_ + ": the " + std::string(split_name(split)) + " split's fields disagree on its size (" +
                    std::to_string(n) + " and " + std::to_string(tensor.size(0)) + " for '" + field + "')");
      n = tensor.size(0);
    }
    splits_[split] = Stored{std::move(fields), std::max<int64_t>(n, 0)};
  }

  /// A split's field, for subclasses (statistics, a description); undefined when not set.
  at::Tensor field(Split split, const std::string& name) const {
    auto it = splits_.find(split);
    if (it == splits_.end()) return {};
    auto f = it->second.fields.find(name);
    return f == it->second.fields.end() ? at::Tensor() : f->second;
  }

 private:
  struct Stored {
    Batch fields;
    int64_t size = 0;
  };
  std::string name_;
  std::map<Split, Stored> splits_;
};

}  // namespace loom::sdk
