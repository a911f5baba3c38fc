// The fashion_mnist dataset plugin against the real files and against damaged copies: every
// problem is one error naming the file and what is wrong.
#include <loom/core/plugin_registry.hpp>
#include <loom/sdk/dataset.hpp>

#include <gtest/gtest.h>
#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <utility>
#include <sys/stat.h>

namespace fs = std::filesystem;
using loom::core::PluginRegistry;

namespace {

const PluginRegistry& registry() {
  static PluginRegistry* r = [] {
    auto* reg = new PluginRegistry();
    reg->load(fs::path(LOOM_BINARY_DIR) / "lib" / "loom" / "plugins" / "libloom_dataset_fashion_mnist.so");
    return reg;
  }();
  return *r;
}

std::string be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8), static_cast<char>(v)};
}

std::string images(uint32_t magic, uint32_t count, uint32_t stored) {
  std::string s = be32(magic) + be32(count) + be32(28) + be32(28);
  for (uint32_t i = 0; i < stored * 28 * 28; ++i) s.push_back(static_cast<char>(i % 251));
  return s;
}

std::string labels(uint32_t count, uint8_t bad_at = 255, uint8_t bad_value = 0) {
  std::string s = be32(0x801) + be32(count);
  for (uint32_t i = 0; i < count; ++i) s.push_back(static_cast<char>(i == bad_at ? bad_value : i % 10));
  return s;
}

class FashionMnistFiles : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("loom_fmnist_" + std::to_string(::getpid()) + "_" +
                                        testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    write("train-images-idx3-ubyte", images(0x803, 20, 20));
    write("train-labels-idx1-ubyte", labels(20));
    write_gz("t10k-images-idx3-ubyte.gz", images(0x803, 10, 10));
    write_gz("t10k-labels-idx1-ubyte.gz", labels(10));
  }
  void TearDown() override { fs::remove_all(dir_); }

  void write(const std::string& name, const std::string& bytes) {
    std::ofstream(dir_ / name, std::ios::binary) << bytes;
  }
  void write_gz(const std::string& name, const std::string& bytes) {
    gzFile f = gzopen((dir_ / name).c_str(), "wb");
    gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
    gzclose(f);
  }

  std::shared_ptr<loom::sdk::Dataset> open() {
    auto d = registry().create<loom::sdk::Dataset>("fashion_mnist", {{"path", dir_.string()}});
    d->setup();
    return d;
  }

  std::string error() {
    try {
      open();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(no error)";
  }

  fs::path dir_;
};

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

TEST_F(FashionMnistFiles, ReadsPlainAndGzippedFiles) {
  auto d = open();
  EXPECT_EQ(d->size(loom::sdk::Split::kTrain), 20);
  EXPECT_EQ(d->size(loom::sdk::Split::kTest), 10);
  const auto batch = d->get_batch(loom::sdk::Split::kTest, {3, 7});
  EXPECT_EQ(batch.at("image").sizes(), (std::vector<int64_t>{2, 1, 28, 28}));
  EXPECT_EQ(batch.at("label")[1].item<int64_t>(), 7);
}

// A checkpoint records each split's fingerprint, and a resume or an evaluation names a split whose
// images changed in place since (the same counts, other data: its figures were said as the run's).
TEST_F(FashionMnistFiles, EachSplitHasAFingerprintOfItsImagesAndLabelsNotOfItsFiles) {
  const auto attributes = [&] { return open()->spec().attributes; };
  const auto before = attributes();
  ASSERT_EQ(before.count("train split.fingerprint"), 1u);
  ASSERT_EQ(before.count("test split.fingerprint"), 1u);
  EXPECT_EQ(before.at("test split.fingerprint").size(), 16u);
  EXPECT_NE(before.at("train split.fingerprint"), before.at("test split.fingerprint"));

  // one pixel of one test image changed: the test split's fingerprint, not the training split's
  std::string changed = images(0x803, 10, 10);
  changed[16 + 5 * 784 + 300] ^= 1;
  fs::remove(dir_ / "t10k-images-idx3-ubyte.gz");
  write("t10k-images-idx3-ubyte", changed);
  const auto after = attributes();
  EXPECT_NE(after.at("test split.fingerprint"), before.at("test split.fingerprint"));
  EXPECT_EQ(after.at("train split.fingerprint"), before.at("train split.fingerprint"));

  // the same bytes gunzipped: the same data, the same fingerprint; two labels swapped: another
  write("t10k-images-idx3-ubyte", images(0x803, 10, 10));
  EXPECT_EQ(attributes().at("test split.fingerprint"), before.at("test split.fingerprint"));
  std::string relabelled = labels(20);
  std::swap(relabelled[8 + 2], relabelled[8 + 3]);
  write("train-labels-idx1-ubyte", relabelled);
  EXPECT_NE(attributes().at("train split.fingerprint"), before.at("train split.fingerprint"));
}

TEST_F(FashionMnistFiles, TruncatedImageFile) {
  std::string bytes = images(0x803, 20, 20);
  write("train-images-idx3-ubyte", bytes.substr(0, bytes.size() - 300));
  const std::string e = error();
  EXPECT_CONTAINS(e, (dir_ / "train-images-idx3-ubyte").string());
  EXPECT_CONTAINS(e, "is truncated: its header promises 20 images");
}

TEST_F(FashionMnistFiles, TruncatedGzipStream) {
  const fs::path gz = dir_ / "t10k-images-idx3-ubyte.gz";
  fs::resize_file(gz, fs::file_size(gz) / 2);
  const std::string e = error();
  EXPECT_CONTAINS(e, gz.string());
  EXPECT_TRUE(e.find("is corrupt") != std::string::npos || e.find("is truncated") != std::string::npos) << e;
}

TEST_F(FashionMnistFiles, AGzipFileCutInItsTrailerIsRefused) {
  // zlib reads a stream cut in its trailer (checksum and size) as a soft error beside a read of 0:
  // such a file trained, its checksum unchecked (one with its labels zeroed, at 0.2 %, exit 0).
  const fs::path gz = dir_ / "t10k-labels-idx1-ubyte.gz";
  std::string bytes;
  {
    std::ifstream in(gz, std::ios::binary);
    bytes.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  for (const size_t cut : {8, 4, 1}) {
    std::ofstream(gz, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - cut);
    EXPECT_CONTAINS(error(), gz.string() + " is truncated: its gzip stream ends before its end");
  }
  // Cut anywhere: never read as data (the reader's own inflate must tell a cut from an end).
  for (size_t keep = 0; keep < bytes.size(); ++keep) {
    std::ofstream(gz, std::ios::binary | std::ios::trunc) << bytes.substr(0, keep);
    const std::string e = error();
    EXPECT_TRUE(e.find("is truncated") != std::string::npos || e.find("is corrupt") != std::string::npos) << keep << ": " << e;
  }
  std::ofstream(gz, std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_EQ(open()->size(loom::sdk::Split::kTest), 10) << "the whole file is read";
}

TEST_F(FashionMnistFiles, BothAPlainAndAGzipFileOfOneNameAreAnErrorNotAGuess) {
  // The .gz always won: a plain file written over it to fix it was never read, in silence.
  write("t10k-labels-idx1-ubyte", labels(10, 3, 7));
  EXPECT_CONTAINS(error(), "fashion_mnist: both " + (dir_ / "t10k-labels-idx1-ubyte.gz").string() +
                               " and t10k-labels-idx1-ubyte are there, and either may be the current one; remove the other");
  fs::remove(dir_ / "t10k-labels-idx1-ubyte.gz");
  EXPECT_EQ(open()->get_batch(loom::sdk::Split::kTest, {3}).at("label")[0].item<int64_t>(), 7) << "the plain file, alone";
}

TEST_F(FashionMnistFiles, WrongMagicNumber) {
  write("train-images-idx3-ubyte", images(0x801, 20, 20));
  // In hex, as IDX writes it; the other file of the pair's number is named as such.
  EXPECT_CONTAINS(error(), "train-images-idx3-ubyte is not an IDX image file: magic number 0x00000801, expected 0x00000803 "
                           "(the magic number of an IDX label file: the files' names are swapped?)");
  write("train-images-idx3-ubyte", images(0xD03, 20, 20));  // (another type byte)
  EXPECT_CONTAINS(error(), "magic number 0x00000D03, expected 0x00000803; download");
}

TEST_F(FashionMnistFiles, AGzFileThatHoldsNoGzipDataIsSaidToBeSo) {
  write("t10k-labels-idx1-ubyte.gz", "<html>404 Not Found</html>\n");  // a failed download, saved as the file
  const std::string e = error();
  EXPECT_CONTAINS(e, "t10k-labels-idx1-ubyte.gz is not an IDX label file");
  EXPECT_CONTAINS(e, "(and it holds no gzip data, though its name ends in .gz); download the Fashion-MNIST files again");
}

TEST_F(FashionMnistFiles, LabelCountDiffersFromImageCount) {
  write("train-labels-idx1-ubyte", labels(19));
  EXPECT_CONTAINS(error(), "train-labels-idx1-ubyte has 19 labels but train-images-idx3-ubyte has 20 images");
}

TEST_F(FashionMnistFiles, TrailingBytes) {
  write("train-labels-idx1-ubyte", labels(20) + "garbage");
  EXPECT_CONTAINS(error(), "train-labels-idx1-ubyte has unexpected bytes after its data");
}

TEST_F(FashionMnistFiles, BytesAfterTheLastGzipMemberAreRefusedAndAnotherMemberIsRead) {
  // zlib's gzread passes over junk after a gzip stream that does not start another member: a file
  // with something appended read as whole (a probe). gzip's own concatenation is still one file.
  const fs::path gz = dir_ / "t10k-labels-idx1-ubyte.gz";
  const auto member = [&](const std::string& bytes) {
    write_gz("member.gz", bytes);
    std::ifstream in(dir_ / "member.gz", std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  const std::string whole = member(labels(10, 4, 6));
  for (const std::string& junk : {std::string("garbage\n"), std::string(1, '\0'), std::string("\x1f"), std::string(4096, 'x')}) {
    std::ofstream(gz, std::ios::binary | std::ios::trunc) << whole + junk;
    EXPECT_CONTAINS(error(), gz.string() + " has bytes after its gzip stream: the file is damaged or something was appended to it");
  }
  // a second member after the first: read as the rest of the data, its own checksum checked
  const std::string data = labels(10, 4, 6);
  std::ofstream(gz, std::ios::binary | std::ios::trunc) << member(data.substr(0, 11)) + member(data.substr(11));
  EXPECT_EQ(open()->get_batch(loom::sdk::Split::kTest, {4}).at("label")[0].item<int64_t>(), 6) << "two members, one file";
  std::string second = member(data.substr(11));
  second[second.size() - 6] = static_cast<char>(second[second.size() - 6] ^ 0x5a);
  std::ofstream(gz, std::ios::binary | std::ios::trunc) << member(data.substr(0, 11)) + second;
  EXPECT_CONTAINS(error(), gz.string() + " is corrupt: incorrect data check");
  // a second member that holds more than the header says: the data's own check
  std::ofstream(gz, std::ios::binary | std::ios::trunc) << whole + member("x");
  EXPECT_CONTAINS(error(), "t10k-labels-idx1-ubyte.gz has unexpected bytes after its data");
  std::ofstream(gz, std::ios::binary | std::ios::trunc) << whole;
  EXPECT_EQ(open()->size(loom::sdk::Split::kTest), 10) << "the file as written";
}

TEST_F(FashionMnistFiles, AFileLargerThanTheReadersBufferIsReadWholeAcrossMembersAndRefills) {
  // 100 images of pixels that do not compress: the stream crosses the reader's 64 KiB buffer, and
  // its first member ends near the buffer's edge (the refill, the move of what is left, a member's
  // start found with one byte of it in the buffer).
  std::string raw = be32(0x803) + be32(100) + be32(28) + be32(28);
  uint32_t x = 12345;
  for (int i = 0; i < 100 * 784; ++i) raw.push_back(static_cast<char>((x = x * 1664525u + 1013904223u) >> 24));
  const auto member = [&](const std::string& bytes) {
    write_gz("member.gz", bytes);
    std::ifstream in(dir_ / "member.gz", std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  write_gz("t10k-labels-idx1-ubyte.gz", labels(100));
  const fs::path gz = dir_ / "t10k-images-idx3-ubyte.gz";
  for (const size_t split : {size_t{65400}, size_t{65500}, size_t{65530}}) {  // (each member's 18 bytes of framing around it)
    const std::string first = member(raw.substr(0, split));
    std::ofstream(gz, std::ios::binary | std::ios::trunc) << first + member(raw.substr(split));
    const auto batch = open()->get_batch(loom::sdk::Split::kTest, {0, 83, 99});
    const at::Tensor pixels = batch.at("image").contiguous();
    const auto* p = pixels.data_ptr<uint8_t>();
    for (const auto& [row, image] : {std::pair{0, 0}, std::pair{1, 83}, std::pair{2, 99}})
      EXPECT_EQ(std::memcmp(p + row * 784, raw.data() + 16 + image * 784, 784), 0) << "image " << image << ", split " << split
                                                                                  << ", first member " << first.size() << " bytes";
    std::ofstream(gz, std::ios::binary | std::ios::app) << "x";
    EXPECT_NE(error().find("has bytes after its gzip stream"), std::string::npos) << split;
  }
}

TEST_F(FashionMnistFiles, LabelOutOfRange) {
  write("train-labels-idx1-ubyte", labels(20, 3, 12));
  EXPECT_CONTAINS(error(), "label 12 of image 3 is not a class");
}

TEST_F(FashionMnistFiles, MissingFile) {
  fs::remove(dir_ / "t10k-labels-idx1-ubyte.gz");
  const std::string e = error();
  EXPECT_CONTAINS(e, "t10k-labels-idx1-ubyte[.gz] not found; install");
  EXPECT_CONTAINS(e, "data.path");
  // A folder that is not there is said as such (it was one file "not found").
  fs::remove_all(dir_);
  EXPECT_CONTAINS(error(), "[.gz] not found (there is no folder " + dir_.string() + "); install");
}

TEST_F(FashionMnistFiles, SomethingNotAFileOfTheNameIsNamedAsWhatItIs) {
  // In place of a .gz file: each is named as what it is, not reported missing ("install the
  // package"), and not passed over for the other name.
  const fs::path gz = dir_ / "t10k-images-idx3-ubyte.gz";
  write("t10k-images-idx3-ubyte", images(0x803, 10, 10));  // a good plain file beside it
  fs::remove(gz);
  ASSERT_EQ(::mkfifo(gz.c_str(), 0644), 0);
  EXPECT_CONTAINS(error(), gz.string() + " is a FIFO, not an IDX file; put the file there, or set data.path");
  fs::remove(gz);
  fs::create_directory(gz);
  EXPECT_CONTAINS(error(), gz.string() + " is a folder, not an IDX file");
  fs::remove(gz);
  fs::create_symlink("/dev/zero", gz);
  EXPECT_CONTAINS(error(), gz.string() + " is a character device, not an IDX file");
  fs::remove(gz);
  fs::create_symlink(gz, gz);  // a loop
  EXPECT_CONTAINS(error(), gz.string() + " cannot be read (Too many levels of symbolic links); put the file there");
  fs::remove(gz);
  fs::create_symlink(dir_ / "nowhere", gz);
  EXPECT_CONTAINS(error(), gz.string() + " is a symbolic link to nothing");
  fs::remove(gz);
  EXPECT_EQ(open()->size(loom::sdk::Split::kTest), 10) << "the plain file, with nothing in its way";
}

TEST_F(FashionMnistFiles, ACorruptGzipStreamIsNamedWithoutZlibsFileDescriptor) {
  const fs::path gz = dir_ / "t10k-images-idx3-ubyte.gz";
  std::ifstream in(gz, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  bytes[bytes.size() - 6] = static_cast<char>(bytes[bytes.size() - 6] ^ 0x5a);  // the CRC-32 in the trailer
  std::ofstream(gz, std::ios::binary | std::ios::trunc) << bytes;
  const std::string e = error();
  EXPECT_CONTAINS(e, gz.string() + " is corrupt: ");
  EXPECT_EQ(e.find("<fd:"), std::string::npos) << e;
}

TEST(FashionMnist, ReadsDebiansFiles) {
  if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "dataset-fashion-mnist is not installed (scripts/setup.sh installs it)";
  auto d = registry().create<loom::sdk::Dataset>("fashion_mnist");
  d->setup();
  EXPECT_EQ(d->size(loom::sdk::Split::kTrain), 60000);
  EXPECT_EQ(d->size(loom::sdk::Split::kTest), 10000);
  EXPECT_EQ(d->spec().num_classes, 10);
}

}  // namespace
