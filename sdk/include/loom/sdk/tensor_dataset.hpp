// A dataset held in memory as tensors, one set of named fields per split: a plugin loads or
// makes its data in setup() and hands each split to set_split(); size() and get_batch() (index
// checks, index_select, safe for the loader's worker threads) come from here, and
// get_batch_into (index_select's out= form: the loader's reused buffers, no allocation). Fashion-MNIST, the
// synthetic data and the regression example are such datasets.
#pragma once

#include <loom/sdk/dataset.hpp>

#include <ATen/ops/from_blob.h>
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
    Batch out;
    get_batch_into(split, indices, out);
    return out;
  }

  void get_batch_into(Split split, const std::vector<int64_t>& indices, Batch& out) const override {
    const Stored& stored = checked(split, indices);
    // A view of the indices, not a copy: nothing here allocates when `out` fits.
    const at::Tensor index = at::from_blob(const_cast<int64_t*>(indices.data()), {static_cast<int64_t>(indices.size())},
                                           at::TensorOptions().dtype(at::kLong));
    for (auto it = out.begin(); it != out.end();) it = stored.fields.count(it->first) ? std::next(it) : out.erase(it);
    for (const auto& [field, tensor] : stored.fields) {
      at::Tensor& into = out[field];
      if (into.defined() && into.scalar_type() == tensor.scalar_type() && into.device() == tensor.device()) {
        std::vector<int64_t> shape = tensor.sizes().vec();
        shape[0] = index.size(0);
        into.resize_(shape);  // within its memory when the batch is not larger (an epoch's tail and back)
        at::index_select_out(into, tensor, 0, index);
      } else
        into = at::index_select(tensor, 0, index);
    }
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
  const Stored& checked(Split split, const std::vector<int64_t>& indices) const {
    auto it = splits_.find(split);
    if (it == splits_.end()) throw Error(name_ + " has no " + split_name(split) + " split");
    const int64_t n = it->second.size;
    for (int64_t i : indices)
      if (i < 0 || i >= n)
        throw Error(name_ + ": index " + std::to_string(i) + " out of range [0, " + std::to_string(n) + ") of the " +
                    split_name(split) + " split");
    return it->second;
  }
  std::string name_;
  std::map<Split, Stored> splits_;
};

}  // namespace loom::sdk
