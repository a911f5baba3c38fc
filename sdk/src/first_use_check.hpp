// A fused path's check at first use (internal to libloom_sdk, CUDA builds): the path runs once on
// fixed inputs beside the operations it replaces, on the device it is about to serve, and where
// the two disagree or the path fails, it is turned off with one warning and the replaced
// operations serve instead: a mistake there costs speed, not the model.
#pragma once

#include <loom/sdk/log.hpp>

#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <exception>
#include <map>
#include <mutex>
#include <string>

namespace loom::sdk::nn {

/// The verdict for `key` (e.g. the device and dtype): `check()` returns "" where the path gives the
/// replaced operations' results, else why not (an exception counts as a no). Run once per key and
/// remembered. Not run inside a CUDA graph's capture, where it could not read its results (false
/// then, and nothing remembered: a training step's first steps run eagerly, so it runs there).
/// A no logs "<path> is off on <key> (<why>); <instead>".
template <typename Check>
bool checked_at_first_use(const std::string& path, const std::string& key, Check&& check, const std::string& instead) {
  static std::mutex mutex;
  static std::map<std::string, bool> verdicts;
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = verdicts.find(key); it != verdicts.end()) return it->second;
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return false;
  std::string why;
  try {
    why = check();
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (!why.empty()) log::warn(path, " is off on ", key, " (", why, "); ", instead);
  return verdicts[key] = why.empty();
}

}  // namespace loom::sdk::nn
