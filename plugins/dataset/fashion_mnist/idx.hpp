#pragma once
// The IDX files of (Fashion-)MNIST, gzipped or not: a checked reader (idx.cpp). Apart from the
// plugin so that tests and the fuzz target (fuzz/idx_fuzz.cpp) call it directly.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <string>

namespace loom::fashion_mnist {

constexpr uint32_t kImageMagic = 0x00000803;  // unsigned byte, 3 dimensions
constexpr uint32_t kLabelMagic = 0x00000801;  // unsigned byte, 1 dimension
constexpr int64_t kClasses = 10;
constexpr int64_t kMaxImages = 1'000'000;

/// The images of an IDX image file: [count, 1, 28, 28] bytes. Throws loom::sdk::Error naming the
/// file for anything but a regular file holding exactly what its header says.
at::Tensor read_images(const std::filesystem::path& path);

/// The labels of an IDX label file: [count] longs, each a class (0 to 9); `count` images come
/// from `images_file`, named in the error when the counts differ.
at::Tensor read_labels(const std::filesystem::path& path, int64_t count, const std::string& images_file);

}  // namespace loom::fashion_mnist
