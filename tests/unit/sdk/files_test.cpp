// The SDK's whole-file reader, which every data and configuration file a plugin parses goes
// through: a special file is an error, never a wait; a file is read to its end, not to the size
// the kernel reports (0 for a /proc file); a file larger than such a file can be is refused.
#include <loom/sdk/files.hpp>

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace {

namespace fs = std::filesystem;

class ReadRegularFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("loom_files_test_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string error_of(const fs::path& path, int64_t most) {
    try {
      loom::sdk::read_regular_file(path, most, "reader: ", "a test file", "fix it");
    } catch (const loom::sdk::Error& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

TEST_F(ReadRegularFile, AFileWhoseSizeTheKernelDoesNotKnowIsReadWhole) {
  struct stat st {};
  ASSERT_EQ(::stat("/proc/self/status", &st), 0);
  ASSERT_EQ(st.st_size, 0);  // what made such a file read as empty
  const std::string text = loom::sdk::read_regular_file("/proc/self/status", 1 << 20, "reader: ", "a test file");
  EXPECT_NE(text.find("Pid:"), std::string::npos) << text;
  // and held to the limit all the same
  EXPECT_NE(error_of("/proc/self/status", 16).find("holds more than 16 bytes"), std::string::npos);
}

TEST_F(ReadRegularFile, ReadsAFileWholeAndRefusesOneOverTheLimitOrSpecial) {
  const std::string bytes(200000, 'x');  // more than one read's buffer
  std::ofstream(dir_ / "f") << bytes;
  EXPECT_EQ(loom::sdk::read_regular_file(dir_ / "f", 200000, "reader: ", "a test file"), bytes);
  const std::string big = error_of(dir_ / "f", 199999);
  EXPECT_NE(big.find("reader: " + (dir_ / "f").string() + " is 200000 bytes, more than"), std::string::npos) << big;
  EXPECT_NE(big.find("; fix it"), std::string::npos) << big;

  std::ofstream(dir_ / "empty").flush();
  EXPECT_EQ(loom::sdk::read_regular_file(dir_ / "empty", 10, "reader: ", "a test file"), "");

  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0600), 0);  // never waited on
  EXPECT_NE(error_of(dir_ / "fifo", 10).find("is a FIFO, not a regular file; fix it"), std::string::npos);
  EXPECT_NE(error_of(dir_, 10).find("is a folder, not a regular file"), std::string::npos);
  EXPECT_NE(error_of(dir_ / "gone", 10).find("reader: no " + (dir_ / "gone").string() + " (a test file); fix it"),
            std::string::npos);
  // a link to nothing is there: named with its target, not "no FILE"
  fs::create_symlink(dir_ / "moved", dir_ / "link");
  EXPECT_NE(error_of(dir_ / "link", 10).find("reader: " + (dir_ / "link").string() + " is a link to " +
                                            (dir_ / "moved").string() + ", which is not there; fix it"),
            std::string::npos)
      << error_of(dir_ / "link", 10);
}

}  // namespace
