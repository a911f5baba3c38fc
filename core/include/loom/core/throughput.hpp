// Model FLOPs utilization in the training log (Note [Model FLOPs in the log]): the model's FLOPs
// per loss term (Model 2.2) times the loss terms per second, per device, against the device's
// dense peak for the run's precision.
#pragma once

#include <loom/sdk/types.hpp>

#include <map>
#include <string>

namespace loom::core {

/// A device's dense peak for a precision, in TFLOP/s, and where it comes from.
struct PeakFlops {
  double tflops = 0;   ///< 0: unknown (no MFU is reported)
  std::string source;  ///< "NVIDIA H100 80GB HBM3, bf16 tensor cores", "trainer.peak_tflops", or why unknown
};

/// The dense peak of the card `device_description` names (core::device_description: "cuda:0
/// (NVIDIA H100 80GB HBM3, ...)") for the precision its manifest describes (autocast bfloat16 or
/// float16: the 16-bit tensor cores; else TF32 where tf32_matmul is on; else FP32), from NVIDIA's
/// data sheets for the cards listed in the source; tflops 0 for a CPU or a card not listed.
PeakFlops device_peak(const std::string& device_description, const sdk::TextMap& precision_manifest);

/// Adds train/tflops (model TFLOP/s per device) and, where peak_tflops > 0, train/mfu (a
/// fraction) to a log window's values, from its loss terms per second (train/loss_terms_per_s,
/// or train/samples_per_s where the loss counts samples). Nothing where flops_per_term is 0.
void add_model_flops(std::map<std::string, double>& values, double flops_per_term, int64_t devices,
                     double peak_tflops);

}  // namespace loom::core
