// An ABI 1.0 plugin, as the first release built one: Tier 0 from the frozen copy of abi.h
// (tests/abi/v1_0 comes first on the include path), the descriptor written field by field as 1.0
// defined it, the build fingerprint in the descriptor and no fingerprint note. Its component is
// a dataset (interface 1.0: no validation split). tests/unit/plugins/abi_test.cpp loads it into
// the current host; see tests/abi/README.md.
#include <loom/sdk/abi.h>
static_assert(LOOM_ABI_MINOR == 0, "the frozen ABI 1.0 header must be the one included");

#include <loom/sdk/dataset.hpp>

#include <ATen/ops/arange.h>
#include <ATen/ops/remainder.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <torch/version.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

// Sample i is [i, -i], label i % 2.
class FrozenDataset final : public loom::sdk::Dataset {
 public:
  explicit FrozenDataset(int64_t size) : size_(size) {}
  void setup() override {}
  loom::sdk::DataSpec spec() const override {
    loom::sdk::DataSpec spec;
    spec.fields["input"] = {{2}, c10::ScalarType::Float};
    spec.fields["target"] = {{}, c10::ScalarType::Long};
    spec.num_classes = 2;
    return spec;
  }
  int64_t size(loom::sdk::Split split) const override { return split == loom::sdk::Split::kTrain ? size_ : size_ / 2; }
  loom::sdk::Batch get_batch(loom::sdk::Split, const std::vector<int64_t>& indices) const override {
    const at::Tensor i = at::tensor(indices, at::kLong);
    const at::Tensor x = at::stack({i.to(at::kFloat), -i.to(at::kFloat)}, 1);
    return {{"input", x}, {"target", at::remainder(i, 2)}};
  }

 private:
  int64_t size_;
};

void* create(const loom_create_args* args, loom_error* error) noexcept {
  try {
    int64_t size = 8;
    for (uint32_t k = 0; k < args->value_count; ++k)
      if (std::strcmp(args->values[k].key, "size") == 0) size = std::atoll(args->values[k].value);
    return static_cast<loom::sdk::Dataset*>(new FrozenDataset(size));
  } catch (const std::exception& e) {
    std::snprintf(error->message, error->capacity, "%s", e.what());
    return nullptr;
  }
}

void destroy(void* object) noexcept { delete static_cast<loom::sdk::Dataset*>(object); }

const loom_option_spec kOptions[] = {
    {sizeof(loom_option_spec), LOOM_OPTION_INT, "size", "8", "training samples", nullptr},
};

const loom_component kComponents[] = {
    {sizeof(loom_component), LOOM_KIND_DATASET, "frozen_v1_0", "an ABI 1.0 dataset: [i, -i], label i % 2", 1, 0,
     kOptions, 1, /*reserved0=*/0, &create, &destroy},
};

#if defined(__clang__)
#define FROZEN_COMPILER "clang 14"
#else
#define FROZEN_COMPILER "gcc 12"
#endif

const loom_build_fingerprint kFingerprint = {
    sizeof(loom_build_fingerprint), TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, LOOM_TORCH_CUDA,
    _GLIBCXX_USE_CXX11_ABI, static_cast<uint32_t>(__cplusplus / 100), 0, FROZEN_COMPILER, "0.1.0"};

const loom_plugin_descriptor kDescriptor = {
    LOOM_ABI_MAGIC, sizeof(loom_plugin_descriptor), 1, 0, 1, "frozen_v1_0", "1.0.0", &kFingerprint, kComponents,
    nullptr};

}  // namespace

extern "C" __attribute__((visibility("default"), used, section(LOOM_ENTRY_SECTION)))
const loom_plugin_descriptor* loom_plugin_entry_v1(void) noexcept {
  return &kDescriptor;
}
