// The data loader: a seed fixes the order, a position resumes it exactly (also across a change
// of micro-batch), ranks get disjoint shares, worker threads change nothing but speed.
#include <loom/core/data_loader.hpp>
#include <loom/core/device_memory.hpp>

#include <loom/sdk/tensor_dataset.hpp>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <regex>
#include <set>
#include <stdexcept>
#include <thread>

using namespace loom::core;

namespace {

/// Sample i is the number i.
class Numbers final : public loom::sdk::Dataset {
 public:
  explicit Numbers(int64_t n) : n_(n) {}
  void setup() override {}
  loom::sdk::DataSpec spec() const override { return {}; }
  int64_t size(loom::sdk::Split) const override { return n_; }
  loom::sdk::Batch get_batch(loom::sdk::Split, const std::vector<int64_t>& indices) const override {
    return {{"x", at::tensor(indices, at::TensorOptions().dtype(at::kLong))}};
  }

 private:
  int64_t n_;
};

/// Sample i is x = (i, i + 0.5), y = i, held as tensors: a TensorDataset, which implements
/// get_batch_into (Dataset 1.3), so the loader fetches into its reused buffers.
class Table final : public loom::sdk::TensorDataset {
 public:
  explicit Table(int64_t n) : TensorDataset("table"), n_(n) {}
  void setup() override {
    at::Tensor x = at::arange(n_, at::TensorOptions().dtype(at::kFloat)).unsqueeze(1).repeat({1, 2});
    x.select(1, 1).add_(0.5);
    set_split(loom::sdk::Split::kTrain, {{"x", x}, {"y", at::arange(n_, at::TensorOptions().dtype(at::kLong))}});
  }
  loom::sdk::DataSpec spec() const override { return {}; }

 private:
  int64_t n_;
};

std::vector<int64_t> take(DataLoader& loader, int batches) {
  std::vector<int64_t> out;
  for (int i = 0; i < batches; ++i) {
    const auto b = loader.next().at("x");
    for (int64_t j = 0; j < b.size(0); ++j) out.push_back(b[j].item<int64_t>());
  }
  return out;
}

DataLoader::Options options(int64_t micro, int64_t workers, uint64_t seed = 3) {
  DataLoader::Options o;
  o.micro_batch = micro;
  o.workers = workers;
  o.seed = seed;
  return o;
}

TEST(DataLoader, SeedFixesTheOrderAndWorkersDoNotChangeIt) {
  auto data = std::make_shared<Numbers>(100);
  DataLoader sync(data, loom::sdk::Split::kTrain, options(10, 0));
  DataLoader threaded(data, loom::sdk::Split::kTrain, options(10, 3));
  const auto a = take(sync, 25), b = take(threaded, 25);  // two and a half epochs
  EXPECT_EQ(a, b);
  // Each epoch is a permutation, and the next epoch is a different one.
  std::set<int64_t> first(a.begin(), a.begin() + 100);
  EXPECT_EQ(first.size(), 100u);
  EXPECT_NE(std::vector<int64_t>(a.begin(), a.begin() + 100), std::vector<int64_t>(a.begin() + 100, a.begin() + 200));
  DataLoader other_seed(data, loom::sdk::Split::kTrain, options(10, 0, 4));
  EXPECT_NE(take(other_seed, 10), std::vector<int64_t>(a.begin(), a.begin() + 100));
}

TEST(DataLoader, ASubsetDrawsOnlyItsOwnSamplesEachOncePerEpoch) {
  // How a validation share is held out of train: the two loaders never see each other's samples.
  auto data = std::make_shared<Numbers>(100);
  DataLoader::Options held = options(5, 0), kept = options(10, 0);
  for (int64_t i = 0; i < 100; ++i) (i % 4 == 0 ? held.subset : kept.subset).push_back(i);
  DataLoader validation(data, loom::sdk::Split::kTrain, held), train(data, loom::sdk::Split::kTrain, kept);
  EXPECT_EQ(validation.samples_per_epoch(), 25);
  EXPECT_EQ(train.samples_per_epoch(), 70);  // whole micro-batches of 10 (the 5 left are dropped)
  const auto v = take(validation, 5);
  const auto t = take(train, 7);  // 70 of the 75
  EXPECT_EQ(std::set<int64_t>(v.begin(), v.end()), std::set<int64_t>(held.subset.begin(), held.subset.end()));
  for (int64_t x : t) EXPECT_NE(x % 4, 0) << x << " is held out, yet the training loader gave it";
  EXPECT_EQ(std::set<int64_t>(t.begin(), t.end()).size(), t.size());
}

TEST(DataLoader, PositionResumesExactlyEvenWithAnotherMicroBatch) {
  auto data = std::make_shared<Numbers>(96);
  DataLoader a(data, loom::sdk::Split::kTrain, options(8, 2));
  take(a, 5);
  const DataLoader::Position at = a.position();
  EXPECT_EQ(at.epoch, 0);
  EXPECT_EQ(at.offset, 40);
  const auto rest = take(a, 12);  // crosses into epoch 1

  DataLoader b(data, loom::sdk::Split::kTrain, options(8, 2));
  b.seek(at);
  EXPECT_EQ(take(b, 12), rest);

  DataLoader c(data, loom::sdk::Split::kTrain, options(8, 2));
  c.seek(at);
  c.set_micro_batch(4, 8);  // OOM recovery halves the micro-batch (the step stays 8): the same samples follow
  const auto halves = take(c, 14);
  EXPECT_EQ(std::vector<int64_t>(halves.begin(), halves.begin() + 56), std::vector<int64_t>(rest.begin(), rest.begin() + 56));
}

TEST(DataLoader, AnEpochHoldsWholeStepsWhateverTheMicroBatch) {
  // 120 samples, steps of 32: three steps an epoch (96), whether a step is 2 micro-batches of 16
  // or 4 of 8 (OOM recovery). An epoch that ended at the last whole micro-batch held 112 or 120,
  // so the run that halved its micro-batch trained on other samples from the first epoch's end
  // on, and a step took the end of one epoch and the start of the next.
  auto data = std::make_shared<Numbers>(120);
  auto o = options(16, 0);
  o.step_samples = 32;
  DataLoader halves(data, loom::sdk::Split::kTrain, o);
  EXPECT_EQ(halves.samples_per_epoch(), 96);
  EXPECT_EQ(halves.batches_per_epoch(), 6);
  const auto planned = take(halves, 3 * 6);  // three epochs
  DataLoader quarters(data, loom::sdk::Split::kTrain, o);
  quarters.set_micro_batch(8, 32);
  EXPECT_EQ(quarters.batches_per_epoch(), 12);
  EXPECT_EQ(take(quarters, 3 * 12), planned);
  // ... and recovered mid-epoch: the samples of the plan that never changed, epoch after epoch
  DataLoader recovered(data, loom::sdk::Split::kTrain, o);
  auto got = take(recovered, 3);
  recovered.set_micro_batch(8, 32);
  const auto rest = take(recovered, 30);
  got.insert(got.end(), rest.begin(), rest.end());
  EXPECT_EQ(got, planned);
  for (size_t step = 0; step < planned.size(); step += 32) {  // no sample twice in a step
    const std::set<int64_t> in_step(planned.begin() + static_cast<std::ptrdiff_t>(step),
                                    planned.begin() + static_cast<std::ptrdiff_t>(step + 32));
    EXPECT_EQ(in_step.size(), 32u) << "step " << step / 32 + 1;
  }
  EXPECT_THROW(quarters.set_micro_batch(12, 32), std::exception);  // (no whole number of micro-batches)
  // An epoch made longer after its order was drawn (steps of 32 -> 4: 96 -> 120 samples) is
  // drawn whole, not read past the 96 it had.
  DataLoader longer(data, loom::sdk::Split::kTrain, o);
  auto epoch = take(longer, 1);
  longer.set_micro_batch(4, 4);
  const auto more = take(longer, (120 - 16) / 4);
  epoch.insert(epoch.end(), more.begin(), more.end());
  EXPECT_EQ(std::set<int64_t>(epoch.begin(), epoch.end()).size(), 120u);
}

TEST(DataLoader, RanksTakeDisjointShares) {
  auto data = std::make_shared<Numbers>(103);
  std::set<int64_t> seen;
  for (int64_t rank = 0; rank < 4; ++rank) {
    auto o = options(5, 1);
    o.rank = rank;
    o.world_size = 4;
    DataLoader l(data, loom::sdk::Split::kTrain, o);
    EXPECT_EQ(l.samples_per_epoch(), 25);
    EXPECT_EQ(l.batches_per_epoch(), 5);
    for (int64_t v : take(l, 5)) EXPECT_TRUE(seen.insert(v).second) << v << " given to two ranks";
  }
  EXPECT_EQ(seen.size(), 100u);  // 3 samples of the tail dropped so every rank steps alike
}

TEST(DataLoader, EvaluationOrderCoversEverySampleOnce) {
  auto data = std::make_shared<Numbers>(23);
  auto o = options(5, 1);
  o.shuffle = false;
  o.drop_last = false;
  DataLoader l(data, loom::sdk::Split::kTest, o);
  EXPECT_EQ(l.batches_per_epoch(), 5);
  const auto all = take(l, 5);
  ASSERT_EQ(all.size(), 23u);
  for (int64_t i = 0; i < 23; ++i) EXPECT_EQ(all[i], i);
}

// Evaluation on several ranks keeps the tail: rank r takes samples r, r + world, ..., so the
// ranks' sums and counts add up to the whole split's (23 samples over 4 ranks: 6, 6, 6, 5).
TEST(DataLoader, EvaluationSharesOfRanksCoverTheSplitWithItsTail) {
  auto data = std::make_shared<Numbers>(23);
  std::set<int64_t> seen;
  for (int64_t rank = 0; rank < 4; ++rank) {
    auto o = options(5, 1);
    o.shuffle = false;
    o.drop_last = false;
    o.rank = rank;
    o.world_size = 4;
    DataLoader l(data, loom::sdk::Split::kTest, o);
    EXPECT_EQ(l.samples_per_epoch(), rank < 3 ? 6 : 5);
    EXPECT_EQ(l.batches_per_epoch(), rank < 3 ? 2 : 1);  // ranks may evaluate different counts of batches
    for (int64_t v : take(l, l.batches_per_epoch())) {
      EXPECT_EQ(v % 4, rank);
      EXPECT_TRUE(seen.insert(v).second) << v << " given to two ranks";
    }
  }
  EXPECT_EQ(seen.size(), 23u);
}

/// A broken dataset: one sample fewer than asked for.
class ShortBatches final : public loom::sdk::Dataset {
 public:
  void setup() override {}
  loom::sdk::DataSpec spec() const override { return {}; }
  int64_t size(loom::sdk::Split) const override { return 64; }
  loom::sdk::Batch get_batch(loom::sdk::Split, const std::vector<int64_t>& indices) const override {
    std::vector<int64_t> fewer(indices.begin(), indices.end() - 1);
    return {{"x", at::tensor(fewer, at::TensorOptions().dtype(at::kLong))}};
  }
};

TEST(DataLoader, ABatchOfAnotherNumberOfSamplesThanAskedIsAnError) {
  // (it trained, and its figures counted samples that were never there)
  for (const int64_t workers : {0, 2}) {
    DataLoader l(std::make_shared<ShortBatches>(), loom::sdk::Split::kTrain, options(8, workers));
    try {
      l.next();
      ADD_FAILURE() << "a short batch was taken";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("get_batch of 8 samples gave field 'x' of shape [7]"), std::string::npos) << e.what();
    }
  }
}

/// A broken dataset: its batches are not what its spec() says (a field missing, of another shape
/// or type, on another device), as `what` asks.
class OffSpec final : public loom::sdk::Dataset {
 public:
  explicit OffSpec(std::string what) : what_(std::move(what)) {}
  void setup() override {}
  loom::sdk::DataSpec spec() const override {
    loom::sdk::DataSpec s;
    s.fields["x"] = {{3, 4}, at::kFloat};
    s.fields["y"] = {{}, at::kLong};
    return s;
  }
  int64_t size(loom::sdk::Split) const override { return 64; }
  loom::sdk::Batch get_batch(loom::sdk::Split, const std::vector<int64_t>& indices) const override {
    const auto n = static_cast<int64_t>(indices.size());
    loom::sdk::Batch b{{"x", at::zeros({n, 3, 4})}, {"y", at::zeros({n}, at::kLong)}};
    if (what_ == "missing") b.erase("y");
    if (what_ == "shape") b["x"] = at::zeros({n, 4, 3});
    if (what_ == "dtype") b["x"] = at::zeros({n, 3, 4}, at::kDouble);
    if (what_ == "meta") b["x"] = at::zeros({n, 3, 4}, at::TensorOptions().device(at::kMeta));
    return b;
  }

 private:
  std::string what_;
};

TEST(DataLoader, ABatchThatIsNotWhatTheSpecSaysIsTheDatasetsError) {
  // (the model was blamed: "model 'x': map::at", "mat1 and mat2 shapes cannot be multiplied")
  const std::map<std::string, std::string> said = {
      {"missing", "gave field 'y' not at all; its spec() says Long [8] on the CPU"},
      {"shape", "gave field 'x' as Float [8, 4, 3] on cpu; its spec() says Float [8, 3, 4] on the CPU"},
      {"dtype", "gave field 'x' as Double [8, 3, 4] on cpu; its spec() says Float [8, 3, 4]"},
      {"meta", "gave field 'x' as Float [8, 3, 4] on meta; its spec() says Float [8, 3, 4] on the CPU"}};
  for (const auto& [what, message] : said) {
    auto o = options(8, 0);
    o.name = "off_spec";
    DataLoader l(std::make_shared<OffSpec>(what), loom::sdk::Split::kTrain, o);
    try {
      l.next();
      ADD_FAILURE() << what << ": the batch was taken";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("dataset 'off_spec': get_batch of 8 samples " + message), std::string::npos) << e.what();
    }
  }
  DataLoader fine(std::make_shared<OffSpec>("none"), loom::sdk::Split::kTrain, options(8, 0));
  EXPECT_EQ(fine.next().at("x").size(0), 8);
}

/// A broken dataset: its get_batch throws what a std::vector's at() throws.
class OutOfRange final : public loom::sdk::Dataset {
 public:
  void setup() override {}
  loom::sdk::DataSpec spec() const override { return {}; }
  int64_t size(loom::sdk::Split) const override { return 64; }
  loom::sdk::Batch get_batch(loom::sdk::Split, const std::vector<int64_t>&) const override {
    throw std::out_of_range("vector::_M_range_check");
  }
};

TEST(DataLoader, ADatasetsErrorNamesTheDatasetAndTheCall) {
  // (a third-party dataset's std::out_of_range reached the user as "training step 1: vector::_M_range_check")
  for (const int64_t workers : {0, 2}) {
    auto o = options(8, workers);
    o.name = "my_data";
    DataLoader l(std::make_shared<OutOfRange>(), loom::sdk::Split::kTrain, o);
    // (and which samples, to find a bad one by; asked again, the same error: with no worker the
    // failed batch's job was gone, and the next call read an empty queue)
    for (int again = 0; again < 2; ++again) {
      try {
        l.next();
        ADD_FAILURE() << "a batch was taken";
      } catch (const std::exception& e) {
        EXPECT_TRUE(std::regex_search(std::string(e.what()), std::regex(R"(^dataset 'my_data' \(get_batch of 8 train )"
                                                                         R"(samples: \d+, \d+, \d+, \d+, \.\.\.\): )"
                                                                         R"(vector::_M_range_check$)")))
            << e.what();
      }
    }
  }
}

/// Numbers that count the samples asked for.
class Counted final : public loom::sdk::Dataset {
 public:
  void setup() override {}
  loom::sdk::DataSpec spec() const override { return {}; }
  int64_t size(loom::sdk::Split) const override { return 50; }
  loom::sdk::Batch get_batch(loom::sdk::Split, const std::vector<int64_t>& indices) const override {
    asked += static_cast<int64_t>(indices.size());
    return {{"x", at::tensor(indices, at::TensorOptions().dtype(at::kLong))}};
  }
  mutable std::atomic<int64_t> asked{0};
};

TEST(DataLoader, AnEvaluationPassFetchesNothingPastItsEnd) {
  // An evaluation's loader fetched the next pass's first batches after each pass (and, on CUDA,
  // held one on the device until the next evaluation).
  for (const int64_t workers : {0, 1, 3}) {
    auto data = std::make_shared<Counted>();
    auto o = options(8, workers);
    o.shuffle = false, o.drop_last = false, o.one_epoch = true;
    DataLoader l(data, loom::sdk::Split::kTest, o);
    for (int pass = 1; pass <= 2; ++pass) {
      l.seek({0, 0});
      std::vector<int64_t> seen = take(l, static_cast<int>(l.batches_per_epoch()));  // 7 batches: 6 of 8, 1 of 2
      EXPECT_EQ(seen.size(), 50u);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // (what a worker would prefetch, it has)
      EXPECT_EQ(data->asked.load(), 50 * pass) << workers << " workers";
      EXPECT_THROW(l.next(), std::exception);  // (past the end: an error, not a wait for ever)
    }
  }
}

TEST(DataLoader, TooFewSamplesForOneBatchIsAClearError) {
  auto data = std::make_shared<Numbers>(10);
  try {
    DataLoader l(data, loom::sdk::Split::kTrain, options(16, 0));
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("too few for one micro-batch of 16"), std::string::npos) << e.what();
  }
}

TEST(DataLoader, ASplitWhoseOrderWouldNotFitInMemoryIsRefusedBeforeAnyIsMade) {
  // A dataset that said 3e9 samples (within 2^40) ran set-up out of memory: the kernel killed it
  // after minutes, its stop signal unheard (probe). The order of an epoch is ~32 bytes a sample.
  if (available_memory() <= 0) GTEST_SKIP() << "this machine's available memory cannot be read";
  const int64_t too_many = std::min<int64_t>(int64_t{1} << 40, available_memory() / 32 * 2 + 1000);
  auto data = std::make_shared<Numbers>(too_many);
  auto o = options(16, 0);
  o.name = "numbers";
  try {
    DataLoader l(data, loom::sdk::Split::kTrain, o);
    FAIL() << "a split of " << too_many << " samples was taken";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("dataset 'numbers' says its train split has " + std::to_string(too_many) +
                        " samples: Loom's loader keeps each epoch's order of them in host memory, about 32 bytes a sample ("),
              std::string::npos) << what;
    EXPECT_NE(what.find("its size() is wrong"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(check_order_memory("numbers", loom::sdk::Split::kTrain, 1000000));
  EXPECT_THROW(check_order_memory("numbers", loom::sdk::Split::kTrain, int64_t{1} << 62), std::exception);  // (no overflow)
}

}  // namespace

TEST(DataLoader, ReusedBuffersGiveTheSameBatchesAndAllocateNothingInTheSteadyState) {
  // Note [Reused batch buffers]: a caller that lets go of each batch before the next gets the
  // same batches as from fresh memory, written into a ring of buffers that stops growing.
  auto data = std::make_shared<Table>(100);
  data->setup();
  for (int64_t workers : {0, 2}) {
    SCOPED_TRACE("workers " + std::to_string(workers));
    DataLoader::Options reused = options(16, workers), fresh = options(16, workers);
    reused.drop_last = fresh.drop_last = false;  // a tail of 4 each epoch: the buffers shrink and grow back
    reused.fills_buffers = true;
    DataLoader a(data, loom::sdk::Split::kTrain, reused), b(data, loom::sdk::Split::kTrain, fresh);
    std::set<const void*> memory;
    int64_t fresh_after_warm_up = -1;
    for (int i = 0; i < 70; ++i) {  // ten epochs
      if (i == 35) fresh_after_warm_up = a.fresh_batches();
      const loom::sdk::Batch x = a.next(), y = b.next();
      ASSERT_TRUE(at::equal(x.at("x"), y.at("x")) && at::equal(x.at("y"), y.at("y"))) << "batch " << i;
      if (i >= 35) memory.insert(x.at("x").data_ptr());  // after a buffer first filled by a tail has grown
    }
    const int64_t ring = std::max<int64_t>(1, workers * 2) + workers + 3;
    EXPECT_LE(static_cast<int64_t>(memory.size()), ring) << "the batches' memory is a ring of buffers";
    EXPECT_EQ(a.fresh_batches(), fresh_after_warm_up) << "no fresh memory once every buffer is in use";
    EXPECT_LE(a.fresh_batches(), ring);
    EXPECT_GE(b.fresh_batches(), 70) << "without get_batch_into every batch is fresh on the CPU";
  }
}

TEST(DataLoader, ABatchOrAViewOfItThatACallerKeepsIsNeverOverwritten) {
  auto data = std::make_shared<Table>(100);
  data->setup();
  for (int64_t workers : {0, 2}) {
    SCOPED_TRACE("workers " + std::to_string(workers));
    DataLoader::Options o = options(10, workers);
    o.fills_buffers = true;
    DataLoader loader(data, loom::sdk::Split::kTrain, o);
    std::vector<at::Tensor> kept, views, copies, view_copies;
    for (int i = 0; i < 30; ++i) {
      const at::Tensor x = loader.next().at("x");
      copies.push_back(x.clone());
      if (i % 2 == 0) {
        kept.push_back(x);  // the batch itself
      } else {
        views.push_back(x.select(1, 1));  // only a view: its storage is the buffer's
        view_copies.push_back(views.back().clone());
      }
    }
    for (size_t i = 0; i < kept.size(); ++i) EXPECT_TRUE(at::equal(kept[i], copies[2 * i])) << "kept batch " << 2 * i;
    for (size_t i = 0; i < views.size(); ++i) EXPECT_TRUE(at::equal(views[i], view_copies[i])) << "kept view " << 2 * i + 1;
    EXPECT_GE(loader.fresh_batches(), 20) << "held buffers are not reused: the batches took fresh memory";
  }
}
