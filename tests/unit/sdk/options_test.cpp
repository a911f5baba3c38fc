// The SDK's option parsing, shared by the host's validation and the plugins' factories.
#include <loom/sdk/helpers.hpp>
#include <loom/sdk/options.hpp>

#include <gtest/gtest.h>

using namespace loom::sdk;

TEST(Options, Bytes) {
  EXPECT_EQ(parse_bytes("4096"), 4096);
  EXPECT_EQ(parse_bytes("512MiB"), 512LL << 20);
  EXPECT_EQ(parse_bytes("2GiB"), 2LL << 30);
  EXPECT_EQ(parse_bytes("2 gib"), 2LL << 30);
  EXPECT_EQ(parse_bytes("1.5GB"), 1500000000LL);
  EXPECT_EQ(parse_bytes("64k"), 65536);
  EXPECT_FALSE(parse_bytes("lots"));
  EXPECT_FALSE(parse_bytes("-1GiB"));
  EXPECT_FALSE(parse_bytes("3 parsecs"));
  // Below 8 EiB, as the messages say, in every unit up to it (1PiB was "not a size").
  EXPECT_EQ(parse_bytes("1PiB"), 1LL << 50);
  EXPECT_EQ(parse_bytes("2 EiB"), 2LL << 60);
  EXPECT_EQ(parse_bytes("1000PB"), 1000000000000000000LL);
  EXPECT_FALSE(parse_bytes("8EiB"));
  EXPECT_TRUE(parse_bytes("7.9EiB"));
  // ... and said in them (1 EiB was "1048576.0 TiB")
  EXPECT_EQ(format_bytes(1LL << 50), "1.0 PiB");
  EXPECT_EQ(format_bytes(3LL << 60), "3.0 EiB");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
}

TEST(Options, ScalarsAndLists) {
  EXPECT_EQ(parse_bool("Yes"), true);
  EXPECT_EQ(parse_bool("off"), false);
  EXPECT_FALSE(parse_bool("maybe"));
  EXPECT_EQ(parse_int(" 42 "), 42);
  EXPECT_EQ(parse_int("+7"), 7);
  EXPECT_FALSE(parse_int("4.2"));
  EXPECT_FALSE(parse_int("12abc"));
  EXPECT_DOUBLE_EQ(*parse_float("1e-3"), 1e-3);
  EXPECT_FALSE(parse_float("nan"));
  EXPECT_FALSE(parse_float("inf"));
  EXPECT_EQ(parse_list(" a, b ,,c "), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(parse_list("").empty());
  EXPECT_FALSE(list_has_empty_item(""));
  EXPECT_FALSE(list_has_empty_item(" a, b ,c "));
  EXPECT_TRUE(list_has_empty_item("a,,b"));
  EXPECT_TRUE(list_has_empty_item("a, "));
  EXPECT_TRUE(list_has_empty_item(",a"));
  EXPECT_FALSE(parse_float("0x10"));
  // Too small for a double: 0 or a subnormal from strtod, which turned clipping off
  // (trainer.clip_grad_norm=1e-400) or gave an MFU of inf (peak_tflops=1e-320).
  EXPECT_FALSE(parse_float("1e-400"));
  EXPECT_FALSE(parse_float("1e-320"));
  EXPECT_FALSE(parse_float("-4e-310"));
  EXPECT_EQ(parse_float("0"), 0.0);
  EXPECT_EQ(parse_float("-0.0"), 0.0);
  EXPECT_DOUBLE_EQ(*parse_float("2.3e-308"), 2.3e-308);  // (the smallest normal double is 2.2250738585072014e-308)
  EXPECT_FALSE(parse_bytes("0x10MiB"));
  EXPECT_TRUE(is_valid_value(LOOM_OPTION_ENUM, "sgd", "adamw|sgd"));
  EXPECT_FALSE(is_valid_value(LOOM_OPTION_ENUM, "adam", "adamw|sgd"));
}

TEST(Options, TypedAccessNamesTheKey) {
  const Options options({{"n", "3"}, {"flag", "true"}, {"size", "1KiB"}});
  EXPECT_EQ(options.get_int("n"), 3);
  EXPECT_TRUE(options.get_bool("flag"));
  EXPECT_EQ(options.get_bytes("size"), 1024);
  try {
    options.get_int("missing");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'missing'"), std::string::npos);
  }
  EXPECT_THROW(options.get_bool("n"), Error);
}
