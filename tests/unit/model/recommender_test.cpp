// The recommender plugin (plugins/model/recommender, docs/recommender.md): MovieLens in its three
// download formats from small files written here (Latin-1 and UTF-8 titles, commas in quoted
// titles, malformed rows, special files), the splits and tables, cached against dynamic text
// vectors, a frozen GPT-2, exact resume for both tasks, the cache after a checkpoint is loaded,
// and the metrics against a reference computed here from predict().
#include "byte_vocabulary.hpp"
#include "trainer_testing.hpp"

#include <loom/core/checkpoint.hpp>
#include <loom/core/files.hpp>
#include <loom/core/log.hpp>
#include <loom/sdk/attributes.hpp>
#include <loom/sdk/dataset.hpp>
#include <loom/sdk/model.hpp>
#include <loom/sdk/safetensors.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/tensor.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <regex>
#include <string>
#include <sys/stat.h>
#include <tuple>
#include <vector>

namespace {

namespace fs = std::filesystem;
using loom::sdk::attribute_lines;
using loom::sdk::Split;
using loom::testing::config_of;
using loom::testing::make_trainer;
using loom::testing::registry;

void write(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

class RecommenderData : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = loom::testing::fresh_test_dir("loom_movielens"); }
  void TearDown() override { fs::remove_all(dir_); }

  loom::core::Created<loom::sdk::Dataset> open(std::map<std::string, std::string> options = {}) {
    options.emplace("root", dir_.string());
    options.emplace("min_interactions", "3");
    auto d = registry().create<loom::sdk::Dataset>("interactions", options);
    d->setup();
    return d;
  }

  /// The (user, item) pairs of a split as the data's own ids.
  std::vector<std::pair<std::string, std::string>> pairs(loom::sdk::Dataset& d, Split split) {
    const auto spec = d.spec();
    const auto users = attribute_lines(spec.attributes.at("users.ids")), items = attribute_lines(spec.attributes.at("items.ids"));
    std::vector<int64_t> all(d.size(split));
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
    const auto b = d.get_batch(split, all);
    std::vector<std::pair<std::string, std::string>> out;
    for (size_t i = 0; i < all.size(); ++i)
      out.emplace_back(users[b.at("user")[i].item<int64_t>()], items[b.at("item")[i].item<int64_t>()]);
    return out;
  }

  fs::path dir_;
};

std::string ml100k_item(int id, const std::string& title, std::initializer_list<int> genres) {
  std::string flags;
  for (int g = 0; g < 19; ++g) flags += std::string("|") + (std::find(genres.begin(), genres.end(), g) != genres.end() ? "1" : "0");
  return std::to_string(id) + "|" + title + "|01-Jan-1995||http://example.org/" + std::to_string(id) + flags + "\n";
}

TEST_F(RecommenderData, MovieLens100kIsReadWithLatin1TitlesGenreFlagsAndAChronologicalSplit) {
  write(dir_ / "u.item", ml100k_item(1, "Caf\xe9 Society (1995)", {3, 4, 5}) + ml100k_item(2, "Heat (1995)", {1, 6, 16}) +
                             ml100k_item(3, "Babe (1995)", {0}) + ml100k_item(4, "Se7en (1995)", {6, 16}));
  // User 7's items by time: 2 (t=10), 3 (t=20), 1 (t=30), 4 (t=40); the file is not in time order.
  write(dir_ / "u.data", "7\t1\t5\t30\n7\t2\t3\t10\n7\t4\t4\t40\n7\t3\t1\t20\n9\t1\t2\t5\n9\t2\t4\t6\n9\t3\t5\t7\n8\t1\t1\t1\n");
  auto d = open();
  const auto spec = d->spec();
  EXPECT_EQ(spec.attributes.at("users.count"), "2");  // user 8 has 1 interaction < 3
  EXPECT_EQ(spec.attributes.at("items.count"), "4");
  EXPECT_EQ(spec.attributes.at("task"), "ranking");
  const auto titles = attribute_lines(spec.attributes.at("items.title"));
  EXPECT_EQ(titles[0], "Caf\xc3\xa9 Society (1995)");  // Latin-1 0xE9 read as U+00E9
  EXPECT_EQ(attribute_lines(spec.attributes.at("items.text"))[0], "Caf\xc3\xa9 Society (1995) | Animation, Children's, Comedy");
  EXPECT_EQ(attribute_lines(spec.attributes.at("items.text"))[2], "Babe (1995)");  // "unknown" is no genre
  using P = std::vector<std::pair<std::string, std::string>>;
  EXPECT_EQ(pairs(*d, Split::kTest), (P{{"7", "4"}, {"9", "3"}}));
  EXPECT_EQ(pairs(*d, Split::kValidation), (P{{"7", "1"}, {"9", "2"}}));
  EXPECT_EQ(pairs(*d, Split::kTrain), (P{{"7", "2"}, {"7", "3"}, {"9", "1"}}));
  // Each user's items of every split, sorted: the mask of full-catalogue ranking (which unmasks the
  // item ranked). Without the test items, a random split's other test items competed with the one
  // ranked while its other validation items were masked: validation and test measured otherwise.
  const auto tables = d->tables();
  EXPECT_TRUE(at::equal(tables.at("seen.indptr"), at::tensor(std::vector<int64_t>{0, 4, 7})));
  EXPECT_TRUE(at::equal(tables.at("seen.items"), at::tensor(std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2})));
  // Ranking: every interaction is a positive.
  EXPECT_TRUE(at::equal(d->get_batch(Split::kTrain, {0, 1, 2}).at("rating"), at::ones({3})));
  // A random split whose share holds out no interaction of the 7 is refused, not run with empty
  // test and validation splits.
  const std::string message = error_of([&] { open({{"split", "random"}, {"holdout", "0.1"}}); });
  EXPECT_NE(message.find("data.holdout = 0.1 of 7 interactions holds out none: the test and validation splits would be "
                         "empty; raise data.holdout to 0.1429 or more"), std::string::npos) << message;
  EXPECT_EQ(pairs(*open({{"split", "random"}, {"holdout", "0.15"}}), Split::kTest).size(), 1u);
  // A format named that is not the folder's: its file is said missing, with data.format.
  const std::string other = error_of([&] { open({{"format", "ml-1m"}}); });
  EXPECT_NE(other.find("data.format = ml-1m reads " + (dir_ / "ratings.dat").string() + ", which is not there; set "
                       "data.format to the folder's format, or auto to find it"), std::string::npos) << other;
  // An empty u.genre (it sets how many flags a line of u.item has): named, not u.item's lines alone.
  write(dir_ / "u.genre", "");
  const std::string genres = error_of([&] { open(); });
  EXPECT_NE(genres.find("u.item:1: 24 fields, expected 5 (movie id|title|release date|video release date|IMDb URL|one flag "
                        "per genre: u.genre names 0, not MovieLens's 19; is it whole?)"), std::string::npos) << genres;
}

TEST_F(RecommenderData, WhichInteractionsAreHeldOutDoesNotDependOnTheOrderOfTheLines) {
  // MovieLens has many ratings of one second: user 7's four are all at t=50. The held-out ones
  // were the last in the file, so a ratings file sorted otherwise gave another test set (and loom
  // eval scored items the model had trained on); the random split followed the lines' order too.
  write(dir_ / "u.item", ml100k_item(1, "A (1995)", {0}) + ml100k_item(2, "B (1995)", {0}) + ml100k_item(3, "C (1995)", {0}) +
                             ml100k_item(4, "D (1995)", {0}) + ml100k_item(5, "E (1995)", {0}));
  const std::vector<std::string> lines{"7\t3\t5\t50\n", "7\t1\t3\t50\n", "7\t4\t4\t50\n", "7\t2\t1\t50\n",
                                       "9\t1\t2\t5\n",  "9\t2\t4\t6\n",  "9\t5\t5\t6\n",  "9\t3\t1\t7\n"};
  using P = std::vector<std::pair<std::string, std::string>>;
  const auto held_out = [&](const std::vector<std::string>& order, std::map<std::string, std::string> options) {
    std::string text;
    for (const auto& line : order) text += line;
    write(dir_ / "u.data", text);
    auto d = open(std::move(options));
    P test = pairs(*d, Split::kTest), validation = pairs(*d, Split::kValidation);
    std::sort(test.begin(), test.end());
    std::sort(validation.begin(), validation.end());
    return std::tuple{test, validation, d->spec().attributes.at("splits.fingerprint")};
  };
  std::vector<std::string> reversed(lines.rbegin(), lines.rend());
  // (user 9 first in the reversed file: the users' indices follow the file, their ids do not)
  const auto [test, validation, fingerprint] = held_out(lines, {});
  EXPECT_EQ(test, (P{{"7", "4"}, {"9", "3"}}));  // (of one second: the item last; user 9: its latest)
  EXPECT_EQ(validation, (P{{"7", "3"}, {"9", "5"}}));  // (items 2 and 5 of user 9 at t=6: 5)
  EXPECT_EQ(held_out(reversed, {}), std::tuple(test, validation, fingerprint));
  std::vector<std::string> users_kept = {lines[3], lines[2], lines[0], lines[1], lines[7], lines[4], lines[6], lines[5]};
  EXPECT_EQ(held_out(users_kept, {}), std::tuple(test, validation, fingerprint));
  const std::map<std::string, std::string> random{{"split", "random"}, {"holdout", "0.25"}};
  const auto shuffled = held_out(lines, random);
  EXPECT_EQ(held_out(users_kept, random), shuffled);
  EXPECT_EQ(held_out(reversed, random), shuffled);
  EXPECT_NE(std::get<2>(shuffled), fingerprint);  // (other held-out pairs, another fingerprint)
  // The catalogue in another order (the items' indices follow it; ties went by index): the same.
  write(dir_ / "u.item", ml100k_item(5, "E (1995)", {0}) + ml100k_item(3, "C (1995)", {0}) + ml100k_item(4, "D (1995)", {0}) +
                             ml100k_item(1, "A (1995)", {0}) + ml100k_item(2, "B (1995)", {0}));
  EXPECT_EQ(held_out(lines, {}), std::tuple(test, validation, fingerprint));
  EXPECT_EQ(held_out(reversed, random), shuffled);
}

TEST_F(RecommenderData, AFileOfManyPartsIsReadWhole) {
  // The file is read a megabyte at a time: rows across the parts' edges, each one counted once.
  std::string movies, ratings;
  for (int item = 1; item <= 500; ++item) movies += std::to_string(item) + "::Film " + std::to_string(item) + " (1995)::Drama\n";
  int64_t rows = 0;
  for (int user = 1; user <= 500; ++user)
    for (int item = 1; item <= 500; item += 1 + user % 3, ++rows)
      ratings += std::to_string(user) + "::" + std::to_string(item) + "::" + std::to_string(1 + (user + item) % 5) +
                 "::" + std::to_string(978300000 + user * 1000 + item) + (item % 7 == 0 ? "\r\n" : "\n");
  ASSERT_GT(ratings.size(), 3u << 20);
  // A byte-order mark first, and a row whose "\r\n" straddles the first part's end (its timestamp
  // padded with zeros to put the '\r' on the part's last byte).
  const std::string head = ratings.substr(0, ratings.rfind('\n', (1u << 20) - 64) + 1), tail = ratings.substr(head.size());
  const std::string edge = "501::1::3::" + std::string((1u << 20) - 2 - head.size() - 14, '0') + "1\r\n";
  ASSERT_EQ(3 + head.size() + edge.size() - 2, (1u << 20) - 1);  // (the '\r' on the part's last byte)
  write(dir_ / "movies.dat", movies);
  write(dir_ / "ratings.dat", "\xEF\xBB\xBF" + head + edge + tail);
  auto d = open({{"task", "rating"}, {"min_interactions", "1"}, {"split", "random"}});
  EXPECT_EQ(d->size(Split::kTrain) + d->size(Split::kValidation) + d->size(Split::kTest), rows + 1);
  EXPECT_EQ(d->spec().attributes.at("users.count"), "501");
  // The last row, without its line ending: read as it stands (and said).
  write(dir_ / "ratings.dat", ratings + "500::500::5::979000500");
  auto last = open({{"task", "rating"}, {"min_interactions", "1"}, {"split", "random"}});
  EXPECT_EQ(last->size(Split::kTrain) + last->size(Split::kValidation) + last->size(Split::kTest), rows + 1);
}

TEST_F(RecommenderData, MovieLens1mIsReadWithDoubleColonsAndRatingsKept) {
  // (a NUL in a title, a damaged file's, cut the title short; an escape character, or U+009B, garbled the terminal)
  write(dir_ / "movies.dat", "1::American President, The (1995)::Comedy|Drama|Romance\n2::Misérables, Les (1995)::Drama\n"
                             "3::Heat" + std::string(1, '\0') + "(1995)\x1b\xc2\x9b::Action|Crime|Thriller\n"
                             "4::Bar: :::Comedy|Drama\n");  // (a title ending in ':' was "Bar: " of the genre ":Comedy")
  write(dir_ / "ratings.dat", "1::1::5::978300760\n1::2::3::978300761\n1::3::4::978300762\n2::3::2::978300763\n"
                              "2::1::1::978300764\n2::2::4::978300765\n");
  auto d = open({{"task", "rating"}, {"split", "leave_last_out"}});
  const auto spec = d->spec();
  EXPECT_EQ(attribute_lines(spec.attributes.at("items.title"))[0], "American President, The (1995)");
  EXPECT_EQ(attribute_lines(spec.attributes.at("items.title"))[1], "Misérables, Les (1995)");  // UTF-8 stays UTF-8
  EXPECT_EQ(attribute_lines(spec.attributes.at("items.text"))[2], "Heat (1995)   | Action, Crime, Thriller");
  EXPECT_EQ(attribute_lines(spec.attributes.at("items.title"))[3], "Bar: :");
  EXPECT_EQ(attribute_lines(spec.attributes.at("items.text"))[3], "Bar: : | Comedy, Drama");
  const auto test = d->get_batch(Split::kTest, {0, 1});
  EXPECT_TRUE(at::equal(test.at("rating"), at::tensor(std::vector<float>{4, 4})));  // the last ratings kept
  EXPECT_EQ(spec.attributes.at("rating.mean"), std::to_string((5.0 + 2.0) / 2));
}

TEST_F(RecommenderData, MovieLensLatestReadsQuotedTitlesWithCommasAndTags) {
  write(dir_ / "movies.csv", "movieId,title,genres\n1,Toy Story (1995),Adventure|Animation\n"
                             "2,\"City of Lost Children, The (Cité des enfants perdus, La) (1995)\",Drama|Mystery\n"
                             "3,\"Dr. \"\"Strangelove\"\" (1964)\",(no genres listed)\n4,\"Up (2009)\n\",Drama\n");
  // (a quoted field may hold line breaks, RFC 4180: a tag of free text; an empty line among them too)
  write(dir_ / "tags.csv", "userId,movieId,tag,timestamp\n1,2,dreamlike,1\n2,2,dreamlike,2\n2,2,\"dark, strange\",3\n"
                           "3,3,\"cold\r\n\r\nwar\",4\r\n3,1,\"\"\"toys\"\"\n\",5\n3,1,plain,6\n");
  // (an exporter that quotes every field: "is not an integer" before)
  write(dir_ / "ratings.csv", "\"userId\",\"movieId\",\"rating\",\"timestamp\"\n1,1,4.0,100\n1,2,3.5,101\n1,3,5.0,102\n"
                              "\"2\",\"1\",\"0.5\",\"200\"\n2,2,4.5,201\n2,3,3.0,202\n");
  auto d = open();
  const auto text = attribute_lines(d->spec().attributes.at("items.text"));
  EXPECT_EQ(text[1], "City of Lost Children, The (Cité des enfants perdus, La) (1995) | Drama, Mystery | dreamlike, dark, strange");
  EXPECT_EQ(text[2], "Dr. \"Strangelove\" (1964) | cold  war");  // (a tag's line breaks are spaces in the text)
  EXPECT_EQ(text[0], "Toy Story (1995) | Adventure, Animation | \"toys\", plain");
  EXPECT_EQ(text[3], "Up (2009) | Drama");  // (a title's line break: a space, trimmed)
  EXPECT_EQ(d->size(Split::kTrain) + d->size(Split::kValidation) + d->size(Split::kTest), 6);
}

TEST_F(RecommenderData, AnMlLatestFileInAnotherEncodingOrWithMacLineEndingsIsNamed) {
  // CR-only line endings made the whole file one line that began with the header ("has no
  // ratings"); UTF-16 showed its raw bytes as "the header". Each is named, with the fix.
  write(dir_ / "movies.csv", "movieId,title,genres\n1,Heat (1995),Action\n2,Babe (1995),Comedy\n");
  write(dir_ / "ratings.csv", "userId,movieId,rating,timestamp\r1,1,4.0,100\r1,2,3.5,101\r");
  std::string message;
  {
    loom::core::log::Capture capture(LOOM_LOG_WARN);
    message = error_of([&] { open(); });
    EXPECT_FALSE(capture.contains("does not end with a line ending")) << "a misleading warning before the error";
  }
  EXPECT_NE(message.find("ratings.csv:1: the file's lines end in a carriage return alone (old Mac line endings); convert "
                         "them to newlines, e.g. tr '\\r' '\\n'"),
            std::string::npos)
      << message;
  std::string utf16 = "\xFF\xFE";
  for (char c : std::string("userId,movieId,rating,timestamp\n1,1,4.0,100\n")) utf16 += std::string{c, '\0'};
  write(dir_ / "ratings.csv", utf16);
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.csv:1: the file is UTF-16 (or holds NUL bytes); save it as UTF-8"), std::string::npos)
      << message;
  // A header that only begins as the expected one is another file's.
  write(dir_ / "ratings.csv", "userId,movieId,rating,timestamp,source\n1,1,4.0,100,x\n");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("the header is 'userId,movieId,rating,timestamp,source', expected userId,movieId,rating,timestamp"),
            std::string::npos)
      << message;
  // ml-1m's files have no header: old Mac line endings there were "1: 9 fields, expected 4".
  fs::remove(dir_ / "ratings.csv");
  fs::remove(dir_ / "movies.csv");
  write(dir_ / "movies.dat", "1::Heat (1995)::Action\r2::Babe (1995)::Comedy\r");
  write(dir_ / "ratings.dat", "1::1::5::1\r1::2::4::2\r");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("movies.dat:1: the file's lines end in a carriage return alone (old Mac line endings)"),
            std::string::npos) << message;
}

TEST_F(RecommenderData, AMalformedRowIsOneErrorNamingFileLineAndField) {
  write(dir_ / "movies.dat", "1::Heat (1995)::Action\n2::Babe (1995)::Comedy\n");
  write(dir_ / "ratings.dat", "1::1::5::1\n1::2::4::2\n1::2::x::3\n");
  std::string message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.dat:3: Rating 'x' is not a number"), std::string::npos) << message;
  write(dir_ / "ratings.dat", "1::1::5::1\n1::2::-3::2\n");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.dat:2: Rating -3 is outside MovieLens's scale (0.5 to 5 stars)"), std::string::npos)
      << message;
  write(dir_ / "ratings.dat", "1::1::5::1\n1::9::4::2\n");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.dat:2: item id 9 is not in movies.dat"), std::string::npos) << message;
  // A NUL or a control character in the row is shown, not left to cut the message short.
  write(dir_ / "ratings.dat", std::string("1::1::5::1\n1::2::4::88000000") + std::string(1, '\0') + "5\n");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.dat:2: Timestamp '88000000\\x005' is not an integer"), std::string::npos) << message;
  // A field of 10 MB is shown by its start and its size (the error's line was the whole field).
  write(dir_ / "ratings.dat", "1::1::5::1\n1::2::" + std::string(10'000'000, '2') + "::2\n");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.dat:2: Rating " + std::string(40, '2') + "... (10000000 bytes) is outside MovieLens's scale"),
            std::string::npos) << message.substr(0, 300);
  EXPECT_LT(message.size(), 1000u);
  for (const std::string big : {"1e309", "-1e309", "1e-400"}) {  // (past a double's range: "is not a number")
    write(dir_ / "ratings.dat", "1::1::5::1\n1::2::" + big + "::2\n");
    message = error_of([&] { open(); });
    EXPECT_NE(message.find("ratings.dat:2: Rating " + big + " is outside MovieLens's scale (0.5 to 5 stars)"), std::string::npos)
        << message;
  }
  write(dir_ / "ratings.dat", "1::1::5::1\n99999999999999999999::2::4::2\n");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.dat:2: UserID 99999999999999999999 is outside the 64-bit integers"), std::string::npos)
      << message;
  write(dir_ / "ratings.dat", "1::1::5\n");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.dat:1: 3 fields, expected 4 (UserID::MovieID::Rating::Timestamp)"), std::string::npos) << message;
  // A user rating an item twice (a file joined twice): split by time, the copy would be tested
  // on what it trained on.
  write(dir_ / "ratings.dat", "1::1::5::1\n1::2::4::2\n2::1::3::3\n1::2::4::2\n2::1::3::3\n");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.dat: user 1 rates item 2 more than once (2 repeated ratings in all); MovieLens has one "
                         "rating per user and item"), std::string::npos) << message;
  // Two fields whose "::" overlap a third colon: no title (read as ':Comedy', the size wrapped round).
  write(dir_ / "movies.dat", "1::Heat (1995)::Action\n2:::Comedy\n");
  write(dir_ / "ratings.dat", "1::1::5::1\n");
  EXPECT_CONTAINS(error_of([&] { open(); }), "movies.dat:2: 2 fields, expected 3 (MovieID::Title::Genres)");
  fs::remove(dir_ / "ratings.dat");
  fs::remove(dir_ / "movies.dat");
  // A spreadsheet's "CSV UTF-8" starts with a byte-order mark: not part of the header.
  write(dir_ / "movies.csv", "\xEF\xBB\xBFmovieId,title,genres\n1,Heat (1995),Action\n2,Babe (1995),Comedy\n3,Up (2009),Drama\n");
  write(dir_ / "ratings.csv", "\xEF\xBB\xBFuserId,movieId,rating,timestamp\n1,1,4.0,1\n1,2,3.0,2\n1,3,5.0,3\n");
  EXPECT_EQ(error_of([&] { open(); }), "(no error)");
  write(dir_ / "movies.csv", "movieId,title,genres\n1,\"Heat, the (1995),Action\n");
  write(dir_ / "ratings.csv", "userId,movieId,rating,timestamp\n1,1,4.0,1\n");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("movies.csv:2: a quoted field is not closed (the file ends on that line): a stray quote"),
            std::string::npos)
      << message;
  // A stray quote in a large file: named at its line once the record passes 1 MiB, not the rest of
  // the file joined into one field.
  std::string many = "movieId,title,genres\n1,Heat (1995),Action\n2,\"Babe (1995),Comedy\n";
  for (int i = 3; i < 60000; ++i) many.append(std::to_string(i)).append(",Up (2009),Drama\n");
  write(dir_ / "movies.csv", many);
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("movies.csv:3: a quoted field is not closed within 1024 KiB: a stray quote"), std::string::npos)
      << message;
  // ... and a field's error in a record of several lines names its lines.
  write(dir_ / "movies.csv", "movieId,title,genres\n1,\"Heat\n(1995)\",Action,Drama\n");  // (4 fields)
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("movies.csv:2-3: 4 fields, expected 3"), std::string::npos) << message;
  // A line of blanks is passed over as an empty one is (it was "1 fields, expected 4"); an empty
  // file has no line to name (it was "movies.csv:0:").
  write(dir_ / "movies.csv", "movieId,title,genres\n1,Heat (1995),Action\n2,Babe (1995),Comedy\n3,Up (2009),Drama\n");
  write(dir_ / "ratings.csv", "userId,movieId,rating,timestamp\n1,1,4.0,1\n   \n1,2,3.0,2\n\t\n1,3,5.0,3\n");
  EXPECT_EQ(error_of([&] { open(); }), "(no error)");
  write(dir_ / "movies.csv", "");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("movies.csv is empty; expected the header movieId,title,genres"), std::string::npos) << message;
  fs::remove(dir_ / "movies.csv");
  fs::remove(dir_ / "ratings.csv");
  // ml-100k's u.data has no header: a line of names is said as one, and a row's first wrong field
  // is the one named (the arguments' order of evaluation named the timestamp first).
  write(dir_ / "u.item", "1|Heat (1995)|01-Jan-1995||http://x|0|1|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0\n");
  write(dir_ / "u.data", "\nuser\titem\trating\ttimestamp\n1\t1\t5\t100\n");  // (after an empty line: still the first row)
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("u.data:2: 'user\\x09item\\x09rating\\x09timestamp' is no rating: ml-100k's u.data has no header "
                         "line; if this is one, remove it"), std::string::npos) << message;
  write(dir_ / "u.data", "1\t1\t5\t100\n\t\t\t\n");  // (a line of tabs: four empty fields, not a blank line)
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("u.data:2: user id '' is not an integer"), std::string::npos) << message;
  write(dir_ / "u.data", "1\t1\t5\t100\nx\t1\ty\tz\n");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("u.data:2: user id 'x' is not an integer"), std::string::npos) << message;
}

TEST_F(RecommenderData, SpecialFilesAndMissingFoldersAreNamedNotWaitedOn) {
  write(dir_ / "movies.csv", "movieId,title,genres\n1,Heat (1995),Action\n");
  ASSERT_EQ(::mkfifo((dir_ / "ratings.csv").c_str(), 0600), 0);
  std::string message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.csv is a FIFO, not a regular file"), std::string::npos) << message;
  // A file larger than any MovieLens (sparse here: nothing is written) is refused unread.
  fs::remove(dir_ / "ratings.csv");
  write(dir_ / "ratings.csv", "");
  fs::resize_file(dir_ / "ratings.csv", std::uintmax_t{1} << 40);
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.csv is 1099511627776 bytes, more than such a file has (at most 8589934592): it is damaged "
                         "or another file; point data.root at a MovieLens folder as unpacked"),
            std::string::npos) << message;
  // A file damaged past its first rows (a copy cut and filled with zeros): refused at the first
  // bad line, read a part at a time (the whole file was read first: 3.5 GB of memory for 3 GiB).
  fs::remove(dir_ / "ratings.csv");
  write(dir_ / "ratings.csv", "userId,movieId,rating,timestamp\n1,1,4.0,1\n");
  fs::resize_file(dir_ / "ratings.csv", std::uintmax_t{1} << 30);
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.csv:3: a line of more than 64 MiB: the file is damaged or not MovieLens"), std::string::npos)
      << message;
  // (the hint of that size, "the largest MovieLens file is under 1 GiB", was said for a FIFO too)
  EXPECT_EQ(message.find("1 GiB"), std::string::npos) << message;
  // A link to nothing where the ratings are: named as such ("holds no MovieLens ratings" before).
  fs::remove(dir_ / "ratings.csv");
  fs::create_symlink(dir_ / "gone.csv", dir_ / "ratings.csv");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.csv is a link to " + (dir_ / "gone.csv").string() + ", which is not there"), std::string::npos)
      << message;
  // An empty catalogue: said so, beside the first rating of an item it lacks.
  fs::remove(dir_ / "ratings.csv");
  write(dir_ / "movies.csv", "movieId,title,genres\n");
  write(dir_ / "ratings.csv", "userId,movieId,rating,timestamp\n1,1,4.0,1\n");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("ratings.csv:2: item id 1 is not in movies.csv, which holds no items"), std::string::npos) << message;
  // An optional file that is a link to nothing: named (tags.csv and u.genre were skipped in silence).
  write(dir_ / "movies.csv", "movieId,title,genres\n1,Heat (1995),Action\n");
  fs::create_symlink(dir_ / "gone_tags.csv", dir_ / "tags.csv");
  message = error_of([&] { open(); });
  EXPECT_NE(message.find("tags.csv is a link to " + (dir_ / "gone_tags.csv").string() + ", which is not there"),
            std::string::npos) << message;
  fs::remove(dir_ / "tags.csv");
  message = error_of([&] { open({{"root", (dir_ / "nowhere").string()}}); });
  EXPECT_NE(message.find("nowhere does not exist; point it at a MovieLens folder"), std::string::npos) << message;
  fs::create_symlink(dir_ / "loop", dir_ / "loop");  // (a loop of links was "is not a folder" too)
  message = error_of([&] { open({{"root", (dir_ / "loop").string()}}); });
  EXPECT_NE(message.find("loop cannot be read (Too many levels of symbolic links)"), std::string::npos) << message;
  message = error_of([&] { registry().create<loom::sdk::Dataset>("interactions"); });
  EXPECT_NE(message.find("data.root is not set"), std::string::npos) << message;
}

TEST(SyntheticInteractions, SizesThatWouldNotFitInMemoryAreRefusedBeforeGenerating) {
  // users x items is within its bound, the interactions are not: refused at creation, not by the
  // out-of-memory killer minutes into set-up.
  const std::string message = error_of([] {
    registry().create<loom::sdk::Dataset>("synthetic_interactions", {{"users", "10000000"}, {"items", "200"}, {"per_user", "200"}});
  });
  EXPECT_NE(message.find("users x per_user = 2000000000 interactions, more than 100000000"), std::string::npos) << message;
}

TEST(SyntheticInteractions, TheBestAchievableHitRateIsAProbability) {
  // With few items a user's candidates of other genres were fewer than the places left in the
  // top 10, and the "best achievable HR@10" came out 10, 3.3, 1.67.
  for (const char* items : {"30", "32", "35", "48"}) {
    auto d = registry().create<loom::sdk::Dataset>("synthetic_interactions",
                                                  {{"users", "40"}, {"items", items}, {"per_user", "12"}});
    d->setup();
    const double best = std::stod(d->spec().attributes.at("optimum.hr_at_10"));
    EXPECT_GT(best, 0.0) << items << " items";
    EXPECT_LE(best, 1.0) << items << " items";
  }
}

// ---- the model -----------------------------------------------------------------------------

class Gpt2RecommenderTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = loom::testing::fresh_test_dir("loom_recommender"); }
  void TearDown() override { fs::remove_all(dir_); }

  loom::core::Config config(const std::string& name, std::initializer_list<const char*> more = {}) {
    loom::core::Config c = config_of({"model.name=gpt2_recommender", "model.size=debug", "model.text_tokens=16",
                                      "model.embedding_dim=16", "model.hidden=32", "data.name=synthetic_interactions",
                                      "data.users=40", "data.items=48", "data.per_user=12", "data.num_workers=0",
                                      "trainer.batch_size=32", "trainer.max_steps=8", "trainer.eval_every=4",
                                      "trainer.lr=0.01", "trainer.seed=3"},
                                     dir_, name);
    for (const char* kv : more) c.set_assignment(kv);
    return c;
  }

  /// A MovieLens 1M folder of 12 films and users with these ids, 4 ratings each.
  fs::path write_movielens(std::initializer_list<int> users) {
    const fs::path ml = dir_ / "ml";
    fs::create_directories(ml);
    std::string movies, ratings;
    for (int item = 1; item <= 12; ++item) movies += std::to_string(item) + "::Film " + std::to_string(item) + " (1995)::Drama\n";
    write(ml / "movies.dat", movies);
    int row = 0;
    for (int user : users)
      for (int k = 0; k < 4; ++k, ++row) {
        const int item = (row / 4 * 2 + 2 + k) % 12 + 1;
        ratings += std::to_string(user) + "::" + std::to_string(item) + "::" + std::to_string(1 + (row / 4 + 1 + k) % 5) +
                   "::" + std::to_string(978300000 + row) + "\n";
      }
    write(ml / "ratings.dat", ratings);
    return ml;
  }

  loom::core::Config movielens_config(const fs::path& ml, const std::string& name, const char* steps,
                                      std::initializer_list<std::string> more = {}) {
    loom::core::Config c = loom::testing::config_of(
        {"model.name=gpt2_recommender", "model.size=debug", "model.text_tokens=8", "model.embedding_dim=8",
         "model.hidden=16", "model.top_k=2", "model.negatives=2", "data.name=interactions", "data.min_interactions=3",
         "data.num_workers=0", "trainer.batch_size=4", "trainer.eval_every=2", "trainer.checkpoint_every=2",
         "trainer.seed=3"},
        dir_, name);
    c.set_assignment("data.root=" + ml.string());
    c.set_assignment(std::string("trainer.max_steps=") + steps);
    for (const std::string& assignment : more) c.set_assignment(assignment);
    return c;
  }

  /// Whether `what` logs a warning holding `words`.
  static bool warns(const std::function<void()>& what, const std::string& words) {
    loom::core::log::Capture capture(LOOM_LOG_WARN);
    what();
    return capture.contains(words);
  }

  /// What loom eval says of `checkpoint` against `config`'s data (a trainer as loom eval builds it:
  /// no run folder).
  static void evaluate_data(const loom::core::Config& config, const fs::path& checkpoint) {
    loom::core::Trainer t(loom::core::resolve_run(config, loom::testing::registry()), loom::testing::registry());
    t.setup_for_evaluation();
    t.load_weights(checkpoint);
    t.warn_if_data_sizes_differ(checkpoint);
  }

  static std::map<std::string, at::Tensor> gpt2_parameters(loom::core::Trainer& t) {
    std::map<std::string, at::Tensor> out;
    for (const auto& item : t.model().module().named_parameters())
      if (item.key().rfind("gpt2.", 0) == 0) out[item.key()] = item.value().detach().clone();
    return out;
  }

  fs::path dir_;
};

TEST_F(Gpt2RecommenderTest, AResumeOnDataWithOtherUsersIsRefusedNamingTheDataNotDamage) {
  // The users' embedding follows the data: 40 users trained, 30 now. Each checkpoint was called
  // "damaged or of another model" and passed over, and the run called unloadable ("move the folder
  // away"); the data's change is named instead, once, and nothing older is tried.
  make_trainer(config("fewer", {"trainer.checkpoint_every=4"}))->train();
  auto resume = config("fewer", {"data.users=30", "trainer.max_steps=12"});
  resume.set_assignment("trainer.resume=auto");
  std::string message = "(no error)";
  try {
    make_trainer(resume);
  } catch (const std::exception& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("checkpoints/step_00000008: its weights do not fit this run's data ("), std::string::npos) << message;
  EXPECT_NE(message.find("and the data differs from the checkpoint's: data.users = 30 (the checkpoint's: 40). Resume with "
                         "the checkpoint's data, or train on this data as a new run (another trainer.name)"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("step_00000004"), std::string::npos) << "no older checkpoint tried: " << message;
}

TEST_F(Gpt2RecommenderTest, AResumeOnRatingsThatGainedAUserIsRefusedNamingTheDataNotDamage) {
  // The same data.root with a user added to its ratings: every checkpoint was called "damaged or
  // of another model" and the run unloadable ("move the folder away").
  const fs::path ml = write_movielens({1, 2, 3, 4, 5, 6});
  const auto config = [&](const char* steps) { return movielens_config(ml, "grown", steps); };
  make_trainer(config("2"))->train();
  std::ofstream(ml / "ratings.dat", std::ios::app) << "7::1::4::978300900\n7::2::3::978300901\n7::3::5::978300902\n";
  auto resume = config("4");
  resume.set_assignment("trainer.resume=auto");
  const std::string message = error_of([&] { make_trainer(resume); });
  // (the data's sizes, which the checkpoint records, name what changed in its files)
  EXPECT_CONTAINS(message, "its weights do not fit this run's data (tensor '");
  EXPECT_CONTAINS(message, "and the data differs from the checkpoint's: the train split holds 13 samples (the checkpoint's "
                           "run: 12); the validation split holds 7 samples (the checkpoint's run: 6)");
  EXPECT_EQ(message.find("move the folder away"), std::string::npos) << message;
  // loom eval and loom recommend (the checkpoint's settings, these files) name the data's change too.
  auto eval = config("2");
  eval.set_assignment("trainer.name=");
  loom::core::Trainer evaluator(loom::core::resolve_run(eval, registry()), registry());
  evaluator.setup_for_evaluation();
  const std::string eval_message = error_of([&] { evaluator.load_weights(dir_ / "grown" / "checkpoints" / "step_00000002"); });
  EXPECT_CONTAINS(eval_message, "step_00000002: its weights do not fit this model (tensor '");
  EXPECT_CONTAINS(eval_message, "the data the model is sized by changed in its files since it trained");
}

TEST_F(Gpt2RecommenderTest, AResumeRefusedAtItsFirstStepLeavesTheRunsRecordAsItWas) {
  // A user's id renamed in the ratings (as many users as before): the weights load, and the first
  // step refuses them. The resume had rewritten config.json with its own settings (and written a
  // config.until_step_2.json), so the record said the run trained with a rate it never used; and
  // --resume-from into a new run left a folder holding config.json alone, which the same command
  // then refused ("already holds a run"). Both are as they were before the command now.
  const fs::path ml = write_movielens({1, 2, 3, 4, 5, 6});
  make_trainer(movielens_config(ml, "renamed", "2"))->train();
  const fs::path run = dir_ / "renamed";
  const std::string record = loom::core::read_file(run / "config.json");
  const auto event_files = [&] {
    return std::distance(fs::directory_iterator(run / "tensorboard"), fs::directory_iterator());
  };
  ASSERT_EQ(event_files(), 1);
  write_movielens({2, 3, 4, 5, 6, 60});
  auto resume = movielens_config(ml, "renamed", "4");
  resume.set_assignment("trainer.resume=auto");
  resume.set_assignment("trainer.lr=0.02");
  EXPECT_CONTAINS(error_of([&] { make_trainer(resume)->train(); }), "the weights were trained on other data: the user at index ");
  EXPECT_EQ(loom::core::read_file(run / "config.json"), record);
  EXPECT_FALSE(fs::exists(run / "config.until_step_2.json"));
  EXPECT_EQ(loom::core::CheckpointStore::list_run(run).size(), 1u);
  EXPECT_EQ(event_files(), 1);  // (it wrote a TensorBoard file of no values)

  auto elsewhere = movielens_config(ml, "from_renamed", "4");
  elsewhere.set_assignment("trainer.resume_from=" + (run / "checkpoints" / "step_00000002").string());
  auto trainer = make_trainer(elsewhere);
  EXPECT_CONTAINS(error_of([&] { trainer->train(); }), "the weights were trained on other data: the user at index ");
  EXPECT_TRUE(trainer->discard_if_nothing_trained());
  trainer.reset();
  EXPECT_FALSE(fs::exists(dir_ / "from_renamed"));
}

TEST_F(Gpt2RecommenderTest, AutoBatchsCachedAnswerIsNotTakenForOtherDataInTheSameFolder) {
  // MovieLens replaced in place (other users: another embedding; the configuration the same) took
  // the micro-batch cached for the data before, which then ran out of memory at step 1.
  const fs::path ml = write_movielens({1, 2, 3, 4, 5, 6});
  const auto config = [&](const std::string& name) {
    auto c = movielens_config(ml, name, "2");
    for (const std::string& a : {std::string("memory.policies=auto_batch"), "memory.cache=" + (dir_ / "cache.tsv").string(),
                                 std::string("memory.device_memory_limit=256MiB"), std::string("trainer.batch_size=8")})
      c.set_assignment(a);
    return c;
  };
  const auto cached = [&](const std::string& name) {
    const loom::core::log::Capture capture(LOOM_LOG_INFO);
    make_trainer(config(name));
    return capture.contains("[auto_batch] micro-batch 8 from the cache ");
  };
  EXPECT_FALSE(cached("first"));
  EXPECT_TRUE(cached("again")) << "the same data: the cached answer is taken";
  write_movielens({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  EXPECT_FALSE(cached("other")) << "other data: searched again";
}

TEST_F(Gpt2RecommenderTest, AValidationFractionSetForADatasetWithItsOwnValidationSplitIsSaidUnused) {
  // The interactions datasets hold out their own validation pairs: a data.validation_fraction the
  // user set there held out nothing, and nothing said so.
  const fs::path ml = write_movielens({1, 2, 3, 4, 5, 6});
  const auto warned = [&](const std::string& name, bool set) {
    auto c = movielens_config(ml, name, "2");
    if (set) c.set_assignment("data.validation_fraction=0.3");
    const loom::core::log::Capture capture(LOOM_LOG_WARN);
    make_trainer(c);
    return capture.contains("data.validation_fraction = 0.3 (--set) holds out nothing: dataset 'interactions' has its own "
                            "validation split (");
  };
  EXPECT_TRUE(warned("fraction_set", true));
  EXPECT_FALSE(warned("fraction_default", false)) << "the default is no one's choice: nothing to say";
}

TEST_F(Gpt2RecommenderTest, EvaluatingOnRatingsChangedInPlaceIsSaid) {
  // Ratings changed in place, every id the same (the model's own check compares the ids): loom
  // eval ranked what had become training items as the held-out ones, and said nothing.
  const fs::path ml = write_movielens({1, 2, 3, 4, 5, 6});
  make_trainer(movielens_config(ml, "sized", "2"))->train();
  const fs::path step = dir_ / "sized" / "checkpoints" / "step_00000002";
  const auto evaluate = [&](const fs::path& checkpoint) {
    return warns([&] { evaluate_data(movielens_config(ml, "sized_eval", "2"), checkpoint); },
                 "this data is not the data " + checkpoint.string() + " was trained on: the train split holds ");
  };
  EXPECT_FALSE(evaluate(step));
  std::ofstream(ml / "ratings.dat", std::ios::app) << "1::7::4::978300900\n";  // (item 7: user 2 rated it)
  EXPECT_TRUE(evaluate(step));
  // The hint names the dataset's own folder key (it named data.root to every dataset, then none).
  EXPECT_TRUE(warns([&] { evaluate_data(movielens_config(ml, "sized_eval", "2"), step); },
                    "(point data.interactions.root, the data's settings"));
  EXPECT_TRUE(evaluate(dir_ / "sized" / "checkpoints" / "best_hr_at_2.safetensors"));
}

TEST_F(Gpt2RecommenderTest, EvaluatingOnOtherHeldOutInteractionsOfTheSameCountsIsSaid) {
  // The same users, items and counts, other times: another item is each user's last, so the test
  // split holds items the model trained on. Its sizes and ids are the run's: only the held-out
  // samples' fingerprint, recorded in each checkpoint, tells.
  const fs::path ml = write_movielens({1, 2, 3, 4, 5, 6});
  make_trainer(movielens_config(ml, "held", "2"))->train();
  const auto evaluate = [&](const fs::path& checkpoint) {
    return warns([&] { evaluate_data(movielens_config(ml, "held_eval", "2"), checkpoint); },
                 "this data is not the data " + checkpoint.string() + " was trained on: its validation and test "
                 "samples are others than the run's (the same counts; fingerprint ");
  };
  const fs::path step = dir_ / "held" / "checkpoints" / "step_00000002";
  EXPECT_FALSE(evaluate(step));
  {  // A checkpoint written before the fingerprint (splits then followed the lines' order): said.
    const std::string state = loom::core::read_file(step / "state.json");
    const std::string older = std::regex_replace(state, std::regex(R"(,\s*"held_out":\s*"[0-9a-f]{16}")"), "");
    ASSERT_NE(older, state);
    loom::core::Trainer t(loom::core::resolve_run(movielens_config(ml, "held_eval", "2"), loom::testing::registry()),
                          loom::testing::registry());
    t.setup_for_evaluation();
    t.load_weights(step);
    write(step / "state.json", older);  // (after the load: its checksum would call the checkpoint damaged)
    loom::core::log::Capture capture(LOOM_LOG_WARN);
    t.warn_if_data_sizes_differ(step);
    EXPECT_TRUE(capture.contains("the checkpoint records no fingerprint of the samples its run held out"));
    write(step / "state.json", state);
  }
  std::ifstream in(ml / "ratings.dat");
  std::string line, later;
  while (std::getline(in, line)) {  // (each user's first rating becomes its last)
    const size_t at_time = line.rfind("::") + 2;
    const int64_t time = std::stoll(line.substr(at_time));
    later += line.substr(0, at_time) + std::to_string((time - 978300000) % 4 == 0 ? time + 100 : time) + "\n";
  }
  in.close();
  write(ml / "ratings.dat", later);
  EXPECT_TRUE(evaluate(step));
  EXPECT_TRUE(evaluate(dir_ / "held" / "checkpoints" / "best_hr_at_2.safetensors"));
}

TEST_F(Gpt2RecommenderTest, AnItemsTextEditedInPlaceIsSaidAtAnEvaluationAndAResume) {
  // The same ids and ratings, a title edited (or tags added): the model reads each item's text, so
  // its figures changed (HR@10 0.53 to 0.60 in the probe), and neither loom eval nor a resume said so.
  const fs::path ml = write_movielens({1, 2, 3, 4, 5, 6});
  make_trainer(movielens_config(ml, "text", "2"))->train();
  const fs::path step = dir_ / "text" / "checkpoints" / "step_00000002";
  const auto said = [&](const std::function<void()>& what) { return warns(what, "its items.text changed since (fingerprint "); };
  const auto evaluate = [&] { evaluate_data(movielens_config(ml, "text_eval", "2"), step); };
  EXPECT_FALSE(said(evaluate));
  std::string movies = loom::core::read_file(ml / "movies.dat");
  movies.replace(movies.find("Film 3 "), 7, "Flim 3 ");
  write(ml / "movies.dat", movies);
  EXPECT_TRUE(said(evaluate));
  EXPECT_TRUE(said([&] {
    auto c = movielens_config(ml, "text", "4");
    c.set_assignment("trainer.resume=auto");
    make_trainer(c);
  }));
}

TEST_F(Gpt2RecommenderTest, RatingsChangedInPlaceAreSaidAtAnEvaluationAndAResume) {
  // The same users, items and held-out pairs, other ratings (a probe set every rating to 5): the
  // rating task's predictions add the training split's mean, and the RMSE is of other values, but
  // neither loom eval, loom recommend nor a resume said so (only the pairs were fingerprinted).
  const fs::path ml = write_movielens({1, 2, 3, 4, 5, 6});
  const auto rating = [&](const std::string& name, const char* steps) {
    return movielens_config(ml, name, steps, {"model.task=rating", "data.task=rating", "trainer.best_metric=rmse"});
  };
  make_trainer(rating("rated", "2"))->train();
  const fs::path step = dir_ / "rated" / "checkpoints" / "step_00000002";
  const auto said = [&](const std::function<void()>& what) { return warns(what, "its ratings changed since (fingerprint "); };
  const auto evaluate = [&] { evaluate_data(rating("rated_eval", "2"), step); };
  EXPECT_FALSE(said(evaluate));
  // (the lines in another order: the same ratings, nothing said)
  std::string ratings = loom::core::read_file(ml / "ratings.dat");
  std::vector<std::string> lines;
  for (size_t at = 0, end; (end = ratings.find('\n', at)) != std::string::npos; at = end + 1) lines.push_back(ratings.substr(at, end - at + 1));
  write(ml / "ratings.dat", std::accumulate(lines.rbegin(), lines.rend(), std::string()));
  EXPECT_FALSE(said(evaluate));
  std::string fives;  // (user::item::rating::time, every rating 5)
  for (const std::string& line : lines) {
    const size_t rating_at = line.find("::", line.find("::") + 2) + 2;
    fives += line.substr(0, rating_at) + "5" + line.substr(line.find("::", rating_at));
  }
  ASSERT_NE(fives, ratings);
  write(ml / "ratings.dat", fives);
  EXPECT_TRUE(said(evaluate));
  EXPECT_TRUE(said([&] {
    auto c = rating("rated", "4");
    c.set_assignment("trainer.resume=auto");
    make_trainer(c);
  }));
}

TEST_F(Gpt2RecommenderTest, ATokenizerReplacedInPlaceIsSaidAtAnEvaluationAndAResume) {
  // The same weights read other token ids where the tokenizer's files changed (two ids swapped,
  // the file the same size): the model records its files' fingerprints (Model 2.3).
  const fs::path ml = write_movielens({1, 2, 3, 4, 5, 6});
  const fs::path tokenizer = dir_ / "tokenizer";
  fs::create_directories(tokenizer);
  loom::testing::write_tokenizer(tokenizer, loom::testing::byte_vocabulary([](int b) { return b; }));
  const auto with_tokenizer = [&](const std::string& name, const char* steps) {
    return movielens_config(ml, name, steps, {"model.tokenizer=" + tokenizer.string()});
  };
  make_trainer(with_tokenizer("tok", "2"))->train();
  const fs::path step = dir_ / "tok" / "checkpoints" / "step_00000002";
  const auto said = [&](const std::function<void()>& what) { return warns(what, "the model's tokenizer files changed since (fingerprint "); };
  const auto evaluate = [&] { evaluate_data(with_tokenizer("tok_eval", "2"), step); };
  EXPECT_FALSE(said(evaluate));
  loom::testing::write_tokenizer(tokenizer, loom::testing::byte_vocabulary([](int b) { return b == 'F' ? 'l' : b == 'l' ? 'F' : b; }));
  EXPECT_TRUE(said(evaluate));
  EXPECT_TRUE(said([&] {
    auto c = with_tokenizer("tok", "4");
    c.set_assignment("trainer.resume=auto");
    make_trainer(c);
  }));
}

TEST_F(Gpt2RecommenderTest, SavingACheckpointAddsLittleToThePeakOfALargeEmbedding) {
  // The check that no weight is NaN before a save held |x| and three masks of each parameter at
  // once: 1.75 times a large frozen embedding, above the steps' own peak (measured 1.3 GiB against
  // 495 MiB with a vocabulary of 2,000,000). Checked in slices, a save adds a few MiB.
  auto peak = [&](const std::string& name, const char* callbacks) {
    auto c = config(name, {"model.vocab_size=400000", "trainer.max_steps=2", "trainer.eval_every=2"});
    c.set_assignment(callbacks);
    return make_trainer(c)->train().peak_memory;
  };
  const int64_t without = peak("unsaved", "trainer.callbacks=progress");
  const int64_t with = peak("saved", "trainer.callbacks=progress, checkpoint, best");
  EXPECT_LT(with - without, int64_t{16} << 20) << "without saves " << without << " bytes, with " << with;
}

TEST_F(Gpt2RecommenderTest, CachedAndDynamicTextVectorsGiveTheSameScores) {
  auto cached = make_trainer(config("cached", {"model.use_cache=true"}));
  auto dynamic = make_trainer(config("dynamic", {"model.use_cache=false"}));
  {
    torch::NoGradGuard no_grad;
    auto from = cached->model().module().named_parameters();
    for (auto& item : dynamic->model().module().named_parameters()) item.value().copy_(from[item.key()]);
  }
  const auto a = cached->evaluate(), b = dynamic->evaluate();
  EXPECT_NEAR(a.loss, b.loss, 1e-6);
  for (const auto& [name, value] : a.metrics) EXPECT_NEAR(value, b.metrics.at(name), 1e-6) << name;
  const loom::sdk::Batch users{{"user", at::arange(40, at::kLong)}};
  cached->model().module().eval();
  dynamic->model().module().eval();
  EXPECT_TRUE(at::allclose(cached->model().predict(users).at("scores"), dynamic->model().predict(users).at("scores"), 1e-5, 1e-6));
  // Training steps too: the same negatives (same seed), the same losses.
  // (Both draw from the process's CPU generator: the second draws what the first drew.)
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  for (int i = 0; i < 3; ++i) {
    const auto state = generator.get_state();
    const double a_loss = cached->train_step().loss;
    generator.set_state(state);
    EXPECT_NEAR(a_loss, dynamic->train_step().loss, 1e-5) << "step " << i + 1;
  }
}

TEST_F(Gpt2RecommenderTest, UseCacheWithAGpt2ThatTrainsIsRefused) {
  const std::string message = error_of([&] { make_trainer(config("refused", {"model.freeze_gpt2=false"})); });
  EXPECT_NE(message.find("use_cache = true needs freeze_gpt2 = true"), std::string::npos) << message;
}

TEST_F(Gpt2RecommenderTest, AFrozenGpt2StaysBitIdenticalAndHasNoOptimizerState) {
  for (const bool frozen : {true, false}) {
    SCOPED_TRACE(frozen ? "frozen" : "trained");
    const std::string name = frozen ? "frozen" : "trained";
    auto t = make_trainer(config(name, {frozen ? "model.freeze_gpt2=true" : "model.freeze_gpt2=false",
                                        frozen ? "model.use_cache=true" : "model.use_cache=false"}));
    const auto before = gpt2_parameters(*t);
    ASSERT_FALSE(before.empty());
    for (int i = 0; i < 4; ++i) t->train_step();
    const auto after = gpt2_parameters(*t);
    int changed = 0;
    for (const auto& [key, value] : before) changed += at::equal(value, after.at(key)) ? 0 : 1;
    if (frozen) EXPECT_EQ(changed, 0);
    else EXPECT_EQ(changed, static_cast<int>(before.size()));
    const auto states = t->model_states();
    EXPECT_EQ(states.frozen > 0, frozen);
    t->save_checkpoint();
    const auto optimizer = loom::sdk::map_safetensors(dir_ / name / "checkpoints" / loom::core::step_dir_name(4) / "optimizer.safetensors");
    int gpt2_states = 0;
    for (const auto& [key, value] : optimizer) gpt2_states += key.find(".gpt2.") != std::string::npos ? 1 : 0;
    if (frozen) EXPECT_EQ(gpt2_states, 0);
    else EXPECT_GT(gpt2_states, 0);
  }
}

TEST_F(Gpt2RecommenderTest, AResumedRunGivesTheSameLossesForBothTasks) {
  for (const std::string name : {"ranking", "rating"}) {
    SCOPED_TRACE(name);
    const std::string task = "data.task=" + name;
    auto full = make_trainer(config(name, {task.c_str()}));
    std::vector<double> losses;
    while (full->step() < full->total_steps()) {
      losses.push_back(full->train_step().loss);
      if (full->step() == 4) full->save_checkpoint();
    }
    auto resumed_config = config(name + "_resumed", {task.c_str()});
    resumed_config.set_assignment("trainer.resume_from=" + (dir_ / name / "checkpoints" / loom::core::step_dir_name(4)).string());
    auto again = make_trainer(resumed_config);
    ASSERT_EQ(again->step(), 4);
    for (size_t i = 4; i < losses.size(); ++i) EXPECT_DOUBLE_EQ(again->train_step().loss, losses[i]) << "step " << i + 1;
    const auto a = loom::testing::parameters_of(*full), b = loom::testing::parameters_of(*again);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i;
  }
}

TEST_F(Gpt2RecommenderTest, TheCacheIsRebuiltWhenACheckpointIsLoaded) {
  // Two runs of other seeds have other (frozen, random) GPT-2 weights. Loading the first's
  // checkpoint into the second, whose cache holds its own vectors, gives the first's scores.
  auto first = make_trainer(config("first"));
  first->train_step();
  const fs::path checkpoint = first->save_checkpoint();
  auto second = make_trainer(config("second", {"trainer.seed=4"}));
  const loom::sdk::Batch users{{"user", at::arange(40, at::kLong)}};
  first->model().module().eval();
  second->model().module().eval();
  const at::Tensor expected = first->model().predict(users).at("scores");
  const at::Tensor own = second->model().predict(users).at("scores");  // builds the second's cache
  EXPECT_FALSE(at::allclose(own, expected));
  second->load_weights(checkpoint);
  second->model().module().eval();
  EXPECT_TRUE(at::allclose(second->model().predict(users).at("scores"), expected, 1e-6, 1e-6));
}

TEST_F(Gpt2RecommenderTest, RankingMetricsAreThoseOfTheFullCatalogueWithKnownItemsMasked) {
  // A reference computed here from predict(): each test user's rank of its item among all items
  // but its other known items (the seen table), as HR@10, NDCG@10 and MRR.
  auto t = make_trainer(config("ranks"));
  for (int i = 0; i < 4; ++i) t->train_step();
  const auto e = t->evaluate(Split::kTest);
  auto d = registry().create<loom::sdk::Dataset>(
      "synthetic_interactions", {{"users", "40"}, {"items", "48"}, {"per_user", "12"}});
  d->setup();
  std::vector<int64_t> all(d->size(Split::kTest));
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  const auto test = d->get_batch(Split::kTest, all);
  const auto tables = d->tables();
  t->model().module().eval();
  const at::Tensor scores = t->model().predict({{"user", test.at("user")}}).at("scores");
  const int64_t* indptr = tables.at("seen.indptr").data_ptr<int64_t>();
  const int64_t* seen = tables.at("seen.items").data_ptr<int64_t>();
  double hr = 0, ndcg = 0, mrr = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const int64_t user = test.at("user")[i].item<int64_t>(), item = test.at("item")[i].item<int64_t>();
    at::Tensor row = scores[i].clone();
    for (int64_t k = indptr[user]; k < indptr[user + 1]; ++k)
      if (seen[k] != item) row[seen[k]].fill_(-INFINITY);
    const double rank = row.ge(row[item]).sum().item<double>() - 1;  // ties count against the item
    hr += rank < 10 ? 1 : 0;
    ndcg += rank < 10 ? 1 / std::log2(rank + 2) : 0;
    mrr += 1 / (rank + 1);
  }
  const double n = static_cast<double>(all.size());
  EXPECT_NEAR(e.metrics.at("hr_at_10"), hr / n, 1e-6);
  EXPECT_NEAR(e.metrics.at("ndcg_at_10"), ndcg / n, 1e-6);
  EXPECT_NEAR(e.metrics.at("mrr"), mrr / n, 1e-6);
}

TEST_F(Gpt2RecommenderTest, AModelThatScoresEveryItemAlikeRanksEachTargetLastNotFirst) {
  // A diverged model (all scores equal, or NaN) had HR@10 1.0: the target won every tie. Ties and
  // NaN now count against it: a constant scorer misses every user (48 items, at most 12 seen, so
  // each target shares its score with more than 10 others).
  auto t = make_trainer(config("alike"));
  {
    torch::NoGradGuard no_grad;
    for (auto& p : t->model().module().parameters()) p.zero_();
  }
  const auto e = t->evaluate(Split::kTest);
  EXPECT_EQ(e.metrics.at("hr_at_10"), 0.0);
  EXPECT_LT(e.metrics.at("mrr"), 0.1);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : t->model().module().parameters()) p.fill_(std::nan(""));
  }
  const auto n = t->evaluate(Split::kTest);
  EXPECT_EQ(n.metrics.at("hr_at_10"), 0.0);
  EXPECT_NEAR(n.metrics.at("mrr"), 1.0 / 48, 1e-6);  // every target last of the 48 items
}

TEST_F(Gpt2RecommenderTest, ATopKOfTheWholeCatalogueIsRefused) {
  // K of HR@K at or above the 48 items: every target is in the top K, HR@K 1 for any model.
  try {
    make_trainer(config("top_k", {"model.top_k=48"}));
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("model.top_k 48 is not below the 48 items"), std::string::npos) << e.what();
  }
  // Nor one that holds every item each user does not know: each knows 12, masked in evaluation but
  // the one ranked, so a held-out item is ranked among 37.
  try {
    make_trainer(config("top_k_masked", {"model.top_k=37"}));
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("model.top_k 37 holds every item each user does not know (37 at most, of 48; the "
                                         "known ones are masked), so HR@37 would be 1 whatever the model; lower model.top_k "
                                         "below 37"), std::string::npos) << e.what();
  }
  {
    loom::core::log::Capture capture(LOOM_LOG_WARN);
    EXPECT_NO_THROW(make_trainer(config("top_k_36", {"model.top_k=36"})));
    EXPECT_FALSE(capture.contains("whatever the model")) << "no user has 36 or fewer candidates";
  }
  // A random split: each user's held-out items are known too, so it is refused alike (its test
  // items competed with the one ranked, a validation item's did not: two measures).
  EXPECT_THROW(make_trainer(config("top_k_random", {"model.top_k=37", "data.split=random"})), loom::sdk::Error);
  // Users who know more items than others (12 films: user 1 knows 4, user 2 knows 8, so 9 and 5
  // candidates): a warning with how many at K = 5, and the run goes on.
  const fs::path ml = dir_ / "uneven";
  fs::create_directories(ml);
  std::string movies, ratings;
  for (int item = 1; item <= 12; ++item) movies += std::to_string(item) + "::Film " + std::to_string(item) + " (1995)::Drama\n";
  for (int user = 1, time = 978300000; user <= 2; ++user)
    for (int item = 1; item <= 4 * user; ++item) ratings += std::to_string(user) + "::" + std::to_string(item) + "::4::" + std::to_string(time++) + "\n";
  write(ml / "movies.dat", movies);
  write(ml / "ratings.dat", ratings);
  auto uneven = movielens_config(ml, "top_k_some", "2");
  uneven.set_assignment("model.top_k=5");
  loom::core::log::Capture capture(LOOM_LOG_WARN);
  EXPECT_NO_THROW(make_trainer(uneven));
  std::string said;
  for (const auto& line : capture.lines()) said += line + "\n";
  EXPECT_NE(said.find("model.top_k 5 holds every item 1 of the 2 users do not know (their known ones are masked): their HR@5 is 1 "
                      "whatever the model; lower model.top_k below 5"), std::string::npos) << said;
}

TEST_F(Gpt2RecommenderTest, ATokenizerWhoseIdsLeaveAWideGapWarnsOfTheEmbeddingItSizes) {
  // A trimmed vocab.json that kept one id far past the others sized the embedding by it in
  // silence (one token at id 16 000 000 is a 49 GB table at n_embd 768): said, with the fix.
  const fs::path sparse = dir_ / "sparse_tokenizer";
  fs::create_directories(sparse);
  loom::testing::write_tokenizer(sparse, loom::testing::byte_vocabulary([](int b) { return b == 'z' ? 200000 : b; }));
  const std::string tokenizer = "model.tokenizer=" + sparse.string();
  {
    loom::core::log::Capture capture(LOOM_LOG_WARN);
    auto trainer = make_trainer(config("sparse", {tokenizer.c_str()}));
    std::string said;
    for (const auto& line : capture.lines()) said += line + "\n";
    EXPECT_CONTAINS(said, sparse.string() + "/vocab.json has 256 tokens but ids up to 200000: the embedding has a row per "
                          "id, 199745 of them no token's (");
    EXPECT_CONTAINS(said, "number the tokens 0..255 to keep the table to them");
    EXPECT_NO_THROW(trainer->train());  // a warning: the run goes on
  }
  // A dense vocabulary (GPT-2's own has no gaps) says nothing.
  const fs::path dense = dir_ / "dense_tokenizer";
  fs::create_directories(dense);
  loom::testing::write_tokenizer(dense, loom::testing::byte_vocabulary([](int b) { return b; }));
  const std::string dense_tokenizer = "model.tokenizer=" + dense.string();
  loom::core::log::Capture capture(LOOM_LOG_WARN);
  make_trainer(config("dense", {dense_tokenizer.c_str()}));
  EXPECT_FALSE(capture.contains("no token's")) << "a dense vocabulary warned";
}

TEST_F(Gpt2RecommenderTest, ARatingModelOnDataMadeForRankingIsRefused) {
  // Ranking data's ratings are all 1: a rating model would learn the constant and report an RMSE
  // near 0. The data's own ratings (data.task = rating) train it.
  try {
    make_trainer(config("rating_on_ranking", {"model.task=rating", "data.task=ranking"}));
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("model.task = rating on data made for ranking, whose ratings are all 1"),
              std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(make_trainer(config("rating", {"model.task=rating", "data.task=rating"})));
}

TEST_F(Gpt2RecommenderTest, WeightsOfOtherDataAreRefusedByTheirIds) {
  // The data's own ids travel with the weights (buffers user_ids, item_ids): weights whose ids
  // are not the data's are one error naming the first that differs, not silent nonsense.
  auto t = make_trainer(config("ids"));
  t->train_step();
  auto buffers = t->model().module().named_buffers();
  ASSERT_TRUE(buffers.contains("user_ids"));
  EXPECT_EQ(buffers["user_ids"][3].item<int64_t>(), 4);  // synthetic users are 1..40
  EXPECT_EQ(buffers["item_ids"][0].item<int64_t>(), 1);
  buffers["user_ids"][3].fill_(999);  // as a checkpoint of other data would load it
  const std::string message = error_of([&] { t->train_step(); });
  EXPECT_NE(message.find("trained on other data: the user at index 3 is id 999 in the checkpoint, 4 in the data (1 user differs)"), std::string::npos) << message;
  // The same ids in another order (a sorted or shuffled copy of the ratings): said as such, not as other data.
  buffers["user_ids"][3].fill_(5);
  buffers["user_ids"][4].fill_(4);
  const std::string reordered = error_of([&] { t->train_step(); });
  EXPECT_NE(reordered.find("the data names the run's users in another order (2 of 40 at other indices: the user at index 3 is "
                           "id 5 in the checkpoint, 4 in the data)"), std::string::npos) << reordered;
}

TEST_F(Gpt2RecommenderTest, RmseIsTheRootOfTheMeanSquaredError) {
  // The model reports the squared errors' sum; the host's mean of it, through metric_value, is
  // reported as its root (Model 2.1), while the loss stays the mean squared error.
  auto t = make_trainer(config("rmse", {"data.task=rating"}));
  t->train_step();
  const auto e = t->evaluate(Split::kTest);
  EXPECT_NEAR(e.metrics.at("rmse"), std::sqrt(e.loss), 1e-6 * std::sqrt(e.loss));
  EXPECT_LT(e.metrics.at("mae"), e.metrics.at("rmse") + 1e-9);
}

}  // namespace
