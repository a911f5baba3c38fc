// What the recommender's two datasets share (docs/recommender.md): a catalogue of items with
// text, interactions between users and items, the filter and the splits, and what the datasets
// hand the model: samples (user, item, rating), attributes (the catalogue's text and titles, the
// original ids, the task) and tables (each user's known items). `interactions` reads MovieLens
// into a RawData, `synthetic_interactions` generates one; InteractionDataset does the rest.
#pragma once

#include <loom/sdk/options.hpp>
#include <loom/sdk/tensor_dataset.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace loom::plugins::recommender {

/// One item of the catalogue as the data describes it.
struct Item {
  std::string id;      ///< the data's own id ("1193")
  std::string title;   ///< "One Flew Over the Cuckoo's Nest (1975)"
  std::string genres;  ///< "Drama" or "Animation, Children's, Comedy"
  std::string tags;    ///< users' tags, "" when the data has none
  /// What GPT-2 reads: "title | genres | tags", one line.
  std::string text() const;
};

/// Interactions as read or generated: dense user and item indices (items index the catalogue).
struct RawData {
  std::vector<Item> items;
  std::vector<std::string> user_ids;  ///< dense user -> the data's id
  std::vector<int64_t> user, item;    ///< one entry per interaction
  std::vector<float> rating;
  std::vector<int64_t> time;          ///< for the chronological split; ties keep the file's order
};

enum class Task { kRating, kRanking };

Task parse_task(const std::string& name);  ///< "rating" | "ranking"
const char* task_name(Task task);

struct SplitOptions {
  Task task = Task::kRanking;
  std::string split = "auto";  ///< auto (leave_last_out for ranking, random for rating) | leave_last_out | random
  int64_t min_interactions = 5;
  double holdout = 0.1;        ///< random: the test share, and the validation share
  uint64_t seed = 0;
  /// From a dataset's options (LOOM_RECOMMENDER_SPLIT_OPTIONS, datasets.hpp).
  static SplitOptions from(const sdk::Options& o);
  /// Whether the split is per user by time (auto: for ranking).
  bool leave_last_out() const { return split == "leave_last_out" || (split == "auto" && task == Task::kRanking); }
};

/// A dataset of interactions: samples are (user, item, rating) with every field a scalar (user
/// and item int64, rating float; 1 for every interaction of a ranking task).
class InteractionDataset : public sdk::TensorDataset {
 public:
  sdk::DataSpec spec() const override { return spec_; }
  /// "seen.indptr" [users + 1] and "seen.items" [n] (int64): each user's items of every split (the
  /// mask of full-catalogue ranking, which unmasks the item ranked), sorted and unique (compressed rows: user u's are items[indptr[u]:indptr[u+1]]).
  sdk::TensorMap tables() const override { return tables_; }

 protected:
  explicit InteractionDataset(std::string name) : TensorDataset(name), name_(std::move(name)) {}

  /// Filters users with fewer than min_interactions, splits and stores `data`; from setup().
  /// `source` says where the data came from, for the log.
  void build(RawData data, const SplitOptions& options, const std::string& source);
  /// One more attribute of the spec (after build).
  void set_attribute(const std::string& key, std::string value) { spec_.attributes[key] = std::move(value); }

 private:
  std::string name_;
  sdk::DataSpec spec_;
  sdk::TensorMap tables_;
};

/// `text` as UTF-8: unchanged when it is valid UTF-8, else read as Latin-1 (MovieLens 100k and 1M
/// are Latin-1). Newlines, tabs and the other control characters (a NUL) become spaces: one item
/// is one line of the attributes.
std::string to_utf8_line(const std::string& text);

}  // namespace loom::plugins::recommender
