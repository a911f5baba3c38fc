// The recommender plugin's two datasets (docs/recommender.md): `interactions` reads MovieLens
// (movielens.cpp), `synthetic_interactions` generates a catalogue whose best achievable metric is
// known (synthetic_interactions.cpp). Both are InteractionDatasets: the same samples, attributes
// and tables, so the model cannot tell them apart.
#pragma once

#include "interaction_data.hpp"

#include <loom/sdk/options.hpp>

namespace loom::plugins::recommender {

#define LOOM_RECOMMENDER_SPLIT_OPTIONS(task_default, min_default)                                                   \
  sdk::option_enum("task", task_default, "rating|ranking",                                                          \
                   "rating: predict explicit ratings (MSE; RMSE, MAE); ranking: implicit feedback, every "          \
                   "interaction a positive (HR@10, NDCG@10, MRR against the full catalogue)"),                      \
      sdk::option_enum("split", "auto", "auto|leave_last_out|random",                                               \
                       "auto: leave_last_out for ranking (each user's last item is test, the one before it "        \
                       "validation), random for rating"),                                                           \
      sdk::option_int("min_interactions", min_default, "users with fewer interactions are left out", "1.."),      \
      sdk::option_float("holdout", "0.1", "random split: the test share, and the validation share", "0..0.49"),     \
      sdk::option_int("seed", "1234", "seed of the random split (and of generated data)", "0..")

class Interactions final : public InteractionDataset {
 public:
  static constexpr loom_option_spec kOptions[] = {
      sdk::option_string("root", "", "the MovieLens folder as downloaded and unpacked (ml-100k, ml-1m, ml-latest-small, ml-latest)"),
      sdk::option_enum("format", "auto", "auto|ml-100k|ml-1m|ml-latest",
                       "auto: from the files present (u.data, ratings.dat, ratings.csv)"),
      sdk::option_int("max_tags", "8", "ml-latest: users' tags added to an item's text, at most", "0..1000"),
      LOOM_RECOMMENDER_SPLIT_OPTIONS("ranking", "5"),
  };
  explicit Interactions(const sdk::Options& o);
  void setup() override;

 private:
  std::string root_, format_;
  int64_t max_tags_;
  SplitOptions split_;
};

class SyntheticInteractions final : public InteractionDataset {
 public:
  static constexpr loom_option_spec kOptions[] = {
      sdk::option_int("users", "400", "users", "1..10000000"),
      sdk::option_int("items", "240", "items in the catalogue", "20..10000000"),
      sdk::option_int("genres", "8", "genres; each item has one, each user prefers one", "2..64"),
      sdk::option_int("per_user", "30", "interactions of each user", "3..100000"),
      sdk::option_float("affinity", "0.9", "ranking: the share of a user's items from the preferred genre (above 0, below 1)", "0.000001..0.999999"),
      sdk::option_float("noise", "0.5", "rating: the standard deviation of the rating noise (the best RMSE)", "0..10"),
      LOOM_RECOMMENDER_SPLIT_OPTIONS("ranking", "3"),
  };
  explicit SyntheticInteractions(const sdk::Options& o);
  void setup() override;

 private:
  int64_t users_, items_, genres_, per_user_;
  double affinity_, noise_;
  SplitOptions split_;
};

}  // namespace loom::plugins::recommender
