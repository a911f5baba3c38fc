// data_parallel: one process, several devices, as torch.nn.DataParallel. The strategy only chooses
// the devices (parallel.devices); the host builds a model replica per further device through the
// model's plugin, cuts each micro-batch across them and sums their gradients into the first
// device's model, which alone is updated (Note [Replicas in one process], core/src/replicas.cpp).
// `parallel.devices = cpu,cpu` runs replicas on the CPU: the equivalence with `single` is tested
// on machines without GPUs.
#include <loom/sdk/device.hpp>
#include <loom/sdk/sdk.hpp>

#include <set>
#include <string>
#include <vector>

namespace {

using loom::sdk::Error;

class DataParallel final : public loom::sdk::ParallelStrategy {
 public:
  static constexpr loom_option_spec kOptions[] = {
      loom::sdk::option_list("devices", "auto",
                             "the devices, the first holds the trained model: auto is every visible GPU "
                             "(CUDA_VISIBLE_DEVICES counts); or a list such as cuda:0,cuda:2, or cpu,cpu (CPU "
                             "replicas, for tests)"),
  };

  explicit DataParallel(const loom::sdk::Options& o) : listed_(o.get_list("devices")) {}

  void setup(const std::string& device) override {
    const bool automatic = listed_.size() == 1 && listed_.front() == "auto";
    if (automatic && device == "cpu")
      throw Error("trainer.device = cpu with parallel = data_parallel and parallel.devices = auto (every GPU): name "
                  "CPU replicas (parallel.devices = cpu,cpu), or use parallel = single");
    if (automatic) {
      const auto count = static_cast<int64_t>(torch::cuda::is_available() ? torch::cuda::device_count() : 0);
      if (count == 0)
        throw Error("parallel = data_parallel with parallel.devices = auto found no CUDA device; on a machine "
                    "without GPUs name CPU replicas (parallel.devices = cpu,cpu) or use parallel = single");
      for (int64_t i = 0; i < count; ++i) devices_.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
      return;
    }
    std::set<std::string> seen;
    for (const auto& text : listed_) {
      if (text == "auto")
        throw Error("parallel.devices = '" + join(listed_) + "': auto stands alone (every visible GPU)");
      const c10::Device d = loom::sdk::parse_device(text, "parallel.devices");
      if (!devices_.empty() && d.type() != devices_.front().type())
        throw Error("parallel.devices = '" + join(listed_) + "' mixes CPU and CUDA devices; list devices of one type");
      if (d.is_cuda() && !seen.insert(d.str()).second)
        throw Error("parallel.devices = '" + join(listed_) + "' names " + d.str() + " twice; each GPU holds one replica");
      devices_.push_back(d);
    }
    if (devices_.empty()) throw Error("parallel.devices is empty; name at least one device, or auto");
    if (device != "auto" && loom::sdk::parse_device(device, "trainer.device").type() != devices_.front().type())
      throw Error("trainer.device = '" + device + "' but parallel.devices = '" + join(listed_) +
                  "': data_parallel trains on its parallel.devices; leave trainer.device = auto");
  }

  c10::Device device() const override { return devices_.front(); }
  std::vector<c10::Device> devices() const override { return devices_; }

 private:
  static std::string join(const std::vector<std::string>& items) {
    std::string out;
    for (const auto& s : items) out += (out.empty() ? "" : ",") + s;
    return out;
  }

  std::vector<std::string> listed_;
  std::vector<c10::Device> devices_;
};

}  // namespace

LOOM_PLUGIN("data_parallel", "1.0.0",
            loom::sdk::component<DataParallel>("data_parallel",
                                               "one process on several devices: a model replica per device, "
                                               "each micro-batch cut across them"))
