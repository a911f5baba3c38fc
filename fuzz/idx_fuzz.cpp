// Fuzz target: an IDX file of (Fashion-)MNIST, gzipped or not, as the fashion_mnist dataset reads
// it; the first byte picks images or labels. Expected outcome for bad input: loom::sdk::Error.
#include "fuzz_support.hpp"
#include "idx.hpp"

#include <loom/sdk/error.hpp>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool labels = data[0] & 1;
  const auto path = loom::fuzz::write_input(labels ? "labels-idx1-ubyte" : "images-idx3-ubyte", data + 1, size - 1);
  try {
    if (labels)
      (void)loom::fashion_mnist::read_labels(path, 1 + (data[0] >> 1), "images");
    else
      (void)loom::fashion_mnist::read_images(path);
  } catch (const loom::sdk::Error&) {
  }
  return 0;
}
