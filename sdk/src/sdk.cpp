// libloom_sdk: the one home of the SDK classes' type info and vtables. Each class's destructor is
// its key function, defined here and nowhere else, so the compiler emits its vtable and type_info
// in this library only; the host and every plugin link it and use those (exported) objects.
// Exceptions and dynamic_cast across the plugin boundary then compare one type_info, instead of
// relying on the standard library comparing type names (Note [One home for type info], abi.md).
#include <loom/sdk/callback.hpp>
#include <loom/sdk/dataset.hpp>
#include <loom/sdk/error.hpp>
#include <loom/sdk/memory_policy.hpp>
#include <loom/sdk/model.hpp>
#include <loom/sdk/optimizer.hpp>
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/precision.hpp>
#include <loom/sdk/stop.hpp>

#include <ATen/ops/_foreach_div.h>

namespace loom::sdk {

Error::~Error() = default;
Dataset::~Dataset() = default;
Model::~Model() = default;
Guard::~Guard() = default;
PrecisionStrategy::~PrecisionStrategy() = default;
DeviceMemory::~DeviceMemory() = default;
MemoryPolicy::~MemoryPolicy() = default;
ParallelStrategy::~ParallelStrategy() = default;
PendingReduction::~PendingReduction() = default;

namespace {
class Done final : public PendingReduction {
 public:
  void wait() override {}
};
}  // namespace

std::unique_ptr<PendingReduction> ParallelStrategy::start_all_reduce_sum(const std::vector<at::Tensor>& tensors) {
  all_reduce_sum(tensors);
  return std::make_unique<Done>();
}
Optimizer::~Optimizer() = default;

void Optimizer::step_on_device_dividing(const at::Tensor& lr, const at::Tensor& found_non_finite,
                                        const at::Tensor& divisor, const std::vector<at::Tensor>& gradients) {
  // (the host's divisor is of shape [1]; the foreach division takes a tensor of no dimensions)
  if (!gradients.empty()) at::_foreach_div_(gradients, divisor.dim() == 0 ? divisor : divisor.reshape({}));
  step_on_device(lr, found_non_finite);
}

Schedule::~Schedule() = default;
RunContext::~RunContext() = default;
Callback::~Callback() = default;

namespace {
std::atomic<const std::atomic<int>*> g_stop_flag{nullptr};
}  // namespace

bool stop_requested() noexcept {
  const std::atomic<int>* flag = g_stop_flag.load();
  return flag != nullptr && flag->load() != 0;
}

void detail::set_stop_flag(const std::atomic<int>* flag) noexcept { g_stop_flag.store(flag); }

}  // namespace loom::sdk
