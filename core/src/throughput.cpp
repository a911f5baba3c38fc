// Note [Model FLOPs in the log]
// An ML engineer reads a GPU run's speed as model FLOPs utilization: the FLOPs the model needs
// per second (PaLM, appendix B: the products of forward and backward, not what the kernels
// happen to execute) over the card's dense peak. Loom asks the model for its FLOPs per loss term
// (Model::flops_per_loss_term, Model 2.2: gpt2_lm counts 6 N + 12 L d T per token, as nanoGPT and
// bench/compare_gpt2.py do; the ViT its products per sample), multiplies by the window's loss
// terms per second, divides by the devices (so a DDP run reports per GPU) and by the peak of the
// card for the run's precision: the 16-bit tensor cores under bf16/fp16 autocast, TF32's where
// tf32 matmuls are on, plain FP32's otherwise. The peak comes from trainer.peak_tflops, else
// from the table below (NVIDIA's data sheets, dense, without sparsity); a CPU or a card not
// listed gets TFLOP/s but no MFU unless the user gives the peak. The figures are the log's, the
// benchmark's are compare_gpt2.py's: both use the same count for GPT-2.
#include <loom/core/throughput.hpp>
#include <loom/core/log.hpp>

#include <cmath>

namespace loom::core {

namespace {

struct Card {
  const char* name;     ///< in the device's name
  const char* exclude;  ///< not in it ("" for none): a variant of the same name with another peak
  const char* and_one_of[2];  ///< at least one of these in the name (nullptr: no condition)
  double fp16, tf32, fp32;    ///< dense TFLOP/s: bf16/fp16 tensor cores, TF32 tensor cores, FP32
};

// Dense peaks from NVIDIA's data sheets (the sparse figures halved). The SXM H100 names its HBM3
// ("NVIDIA H100 80GB HBM3"); the PCIe and NVL parts have lower clocks and peaks.
constexpr Card kCards[] = {
    {"H100", "", {"HBM3", "SXM"}, 989.4, 494.7, 66.9},
    {"H100", "", {"PCIe", nullptr}, 756.5, 378.0, 51.2},
    {"H100", "", {"NVL", nullptr}, 835.5, 417.5, 60.0},
    {"H200", "NVL", {nullptr, nullptr}, 989.4, 494.7, 66.9},
    {"H200", "", {"NVL", nullptr}, 835.5, 417.5, 60.0},
    {"A100", "", {nullptr, nullptr}, 312.0, 156.0, 19.5},
};

bool has(const std::string& text, const char* part) {
  return part != nullptr && *part != '\0' && text.find(part) != std::string::npos;
}

std::string value(const sdk::TextMap& map, const std::string& key) {
  const auto it = map.find(key);
  return it == map.end() ? std::string() : it->second;
}

}  // namespace

PeakFlops device_peak(const std::string& device_description, const sdk::TextMap& precision_manifest) {
  if (device_description.rfind("cuda", 0) != 0)
    return {0, "no peak known for " + device_description + " (give trainer.peak_tflops for an MFU)"};
  const std::string autocast = value(precision_manifest, "autocast");
  const bool half = autocast == "bfloat16" || autocast == "float16";
  const bool tf32 = !half && value(precision_manifest, "tf32_matmul") == "on";
  const std::string units = half ? (autocast == "bfloat16" ? "bf16 tensor cores" : "fp16 tensor cores")
                                 : tf32 ? "TF32 tensor cores" : "FP32";
  for (const Card& card : kCards) {
    if (!has(device_description, card.name) || has(device_description, card.exclude)) continue;
    if ((card.and_one_of[0] || card.and_one_of[1]) && !has(device_description, card.and_one_of[0]) &&
        !has(device_description, card.and_one_of[1]))
      continue;
    const size_t open = device_description.find('('), comma = device_description.find(',', open);
    const std::string name = open == std::string::npos ? device_description
                                                       : device_description.substr(open + 1, comma - open - 1);
    return {half ? card.fp16 : tf32 ? card.tf32 : card.fp32, name + ", " + units};
  }
  return {0, "no peak known for " + device_description + " (give trainer.peak_tflops for an MFU)"};
}

void add_model_flops(std::map<std::string, double>& values, double flops_per_term, int64_t devices,
                     double peak_tflops) {
  if (!(flops_per_term > 0) || devices < 1) return;
  auto rate = values.find("train/loss_terms_per_s");
  if (rate == values.end()) rate = values.find("train/samples_per_s");
  if (rate == values.end() || !std::isfinite(rate->second)) return;
  const double tflops = flops_per_term * rate->second / static_cast<double>(devices) / 1e12;
  values["train/tflops"] = tflops;
  if (peak_tflops > 0) values["train/mfu"] = tflops / peak_tflops;
  // More than the peak is no utilization: the peak given (or a model's FLOPs) is wrong. Said once
  // per process, the figure still logged as measured.
  static bool said = false;
  if (peak_tflops > 0 && tflops > peak_tflops && !said) {
    said = true;
    log::warn("the model's FLOPs run at ", tflops, " TFLOP/s per device, above the peak of ", peak_tflops,
              " TFLOP/s this MFU is measured against (trainer.peak_tflops, or the card's table): an MFU above 100 % "
              "means that peak is too low for this device and precision, or the model declares more FLOPs than it runs");
  }
}

}  // namespace loom::core
