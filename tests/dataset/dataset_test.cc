// Data sets read where they lie: .npy files mapped (map_npy), split over shards (a folder
// or a glob), their rows gathered across shard boundaries, and bad values (NaN, inf, a
// label out of range) refused naming the file, row and column: at load for arrays up to
// kCheckAtLoadBytes, as batches read them above.
#include "dataset/dataset.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "dataset/npy.h"
#include "tests/model_util.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::load_model;
using testing::ScratchDir;
using testing::source_path;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Rows [first, first + rows) of a [*, width] array whose element (r, c) is r * 1000 + c.
std::vector<float> numbered(int64_t first, int64_t rows, int64_t width) {
  std::vector<float> v;
  for (int64_t r = first; r < first + rows; ++r)
    for (int64_t c = 0; c < width; ++c) v.push_back(static_cast<float>(r * 1000 + c));
  return v;
}

class DataFiles : public ::testing::Test {
 protected:
  ScratchDir dir_{"dataset"};
  std::string floats(const std::string& name, const std::vector<float>& v, int64_t width) {
    const std::string path = dir_ / name;
    EXPECT_TRUE(write_npy(path, {static_cast<int64_t>(v.size()) / width, width}, v.data()).is_ok());
    return path;
  }
  std::string labels(const std::string& name, const std::vector<int64_t>& v) {
    const std::string path = dir_ / name;
    EXPECT_TRUE(write_npy(path, {static_cast<int64_t>(v.size())}, v.data()).is_ok());
    return path;
  }
};

TEST_F(DataFiles, MappedArrayHoldsWhatReadNpyReads) {
  const std::string path = floats("x.npy", numbered(0, 5, 3), 3);
  Result<NpyView> view = map_npy(path);
  Result<NpyArray> array = read_npy(path);
  ASSERT_TRUE(view.is_ok()) << view.status().message();
  ASSERT_TRUE(array.is_ok());
  EXPECT_EQ(view->shape, array->shape);
  EXPECT_EQ(view->type, NpyType::kFloat32);
  ASSERT_EQ(view->bytes(), static_cast<int64_t>(array->bytes.size()));
  EXPECT_EQ(std::memcmp(view->data, array->bytes.data(), array->bytes.size()), 0);
}

TEST_F(DataFiles, MappingRefusesWhatReadingRefuses) {
  const std::string path = floats("x.npy", numbered(0, 5, 3), 3);
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 4);
  Result<NpyView> view = map_npy(path);
  Result<NpyArray> array = read_npy(path);
  ASSERT_FALSE(view.is_ok());
  ASSERT_FALSE(array.is_ok());
  EXPECT_EQ(view.status().message(), array.status().message());
  EXPECT_NE(view.status().message().find("truncated"), std::string::npos) << view.status().message();
}

TEST_F(DataFiles, AFolderIsItsNpyFilesInNameOrder) {
  floats("b.npy", numbered(0, 1, 2), 2);
  floats("a.npy", numbered(0, 1, 2), 2);
  floats("c.npy.txt", numbered(0, 1, 2), 2);
  std::filesystem::create_directory(dir_ / "d.npy");  // a folder named like a shard is not one
  Result<std::vector<std::string>> files = data_files(dir_.path());
  ASSERT_TRUE(files.is_ok()) << files.status().message();
  EXPECT_EQ(*files, (std::vector<std::string>{dir_ / "a.npy", dir_ / "b.npy"}));
  Result<std::vector<std::string>> globbed = data_files(dir_ / "[ab].npy");
  ASSERT_TRUE(globbed.is_ok()) << globbed.status().message();
  EXPECT_EQ(*globbed, *files);
  EXPECT_EQ(*data_files(dir_ / "a.npy"), std::vector<std::string>{dir_ / "a.npy"});
}

TEST_F(DataFiles, NothingToReadIsSaidPlainly) {
  std::filesystem::create_directory(dir_ / "empty");
  Result<std::vector<std::string>> none = data_files(dir_ / "empty");
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.status().message().find("empty: the folder holds no .npy files"), std::string::npos)
      << none.status().message();
  Result<std::vector<std::string>> unmatched = data_files(dir_ / "x*.npy");
  ASSERT_FALSE(unmatched.is_ok());
  EXPECT_NE(unmatched.status().message().find("x*.npy' matches no file"), std::string::npos)
      << unmatched.status().message();
}

TEST_F(DataFiles, RowsAreGatheredAcrossShards) {
  std::vector<NpyView> parts;
  for (auto [name, first, rows] : {std::tuple{"0.npy", 0, 3}, {"1.npy", 3, 0}, {"2.npy", 3, 4}, {"3.npy", 7, 1}}) {
    const std::vector<float> v = numbered(first, rows, 2);
    ASSERT_TRUE(write_npy(dir_ / name, {rows, 2}, v.data()).is_ok());
    parts.push_back(*map_npy(dir_ / name));
  }
  Rows rows(std::move(parts), 2, RowRule::kFinite, "features");
  ASSERT_EQ(rows.count(), 8);
  std::vector<float> out;
  ASSERT_TRUE(rows.gather({7, 0, 3, 2, 6}, out).is_ok());
  std::vector<float> want;
  for (int64_t r : {7, 0, 3, 2, 6})
    for (float x : numbered(r, 1, 2)) want.push_back(x);
  EXPECT_EQ(out, want);
  // In place only within one shard.
  ASSERT_NE(rows.in_place(3, 4), nullptr);
  EXPECT_EQ(rows.in_place(3, 4)[0], 3000.0f);
  EXPECT_EQ(rows.in_place(2, 2), nullptr);
}

TEST_F(DataFiles, ShardedAndWholeFilesLoadTheSameRows) {
  ImportedModel m = load_model("simple_digits");  // 64 features, 10 classes
  std::filesystem::create_directories(dir_ / "x");
  std::filesystem::create_directories(dir_ / "y");
  const std::vector<float> all = numbered(0, 10, 64);
  std::vector<int64_t> classes(10);
  std::iota(classes.begin(), classes.end(), 0);
  floats("x/part-00.npy", std::vector<float>(all.begin(), all.begin() + 4 * 64), 64);
  floats("x/part-01.npy", std::vector<float>(all.begin() + 4 * 64, all.end()), 64);
  labels("y/00.npy", {classes.begin(), classes.begin() + 7});
  labels("y/01.npy", {classes.begin() + 7, classes.end()});
  Result<Dataset> sharded = load_dataset(dir_ / "x", dir_ / "y/*.npy", m.graph, Targets::kClassIndices);
  ASSERT_TRUE(sharded.is_ok()) << sharded.status().message();
  EXPECT_EQ(sharded->samples, 10);
  std::vector<int64_t> every(10);
  std::iota(every.begin(), every.end(), 0);
  std::vector<float> x, y;
  ASSERT_TRUE(sharded->features.gather(every, x).is_ok());
  ASSERT_TRUE(sharded->targets.gather(every, y).is_ok());
  EXPECT_EQ(x, all);
  EXPECT_EQ(y, std::vector<float>(classes.begin(), classes.end()));
  EXPECT_TRUE(sharded->features.checked()) << "small data is checked at load";
}

// Loads `x` (floats [rows, 64]) and `y` against simple_digits; the message of the refusal.
class BadValues : public DataFiles {
 protected:
  std::string refusal(const std::string& x, const std::string& y, Targets targets = Targets::kClassIndices) {
    ImportedModel m = load_model("simple_digits");
    Result<Dataset> d = load_dataset(x, y, m.graph, targets);
    EXPECT_FALSE(d.is_ok()) << "loaded";
    return d.is_ok() ? "" : d.status().message();
  }
};

TEST_F(BadValues, NanFeatureIsRefusedAtLoadWithItsRowAndColumn) {
  std::vector<float> x = numbered(0, 4, 64);
  x[2 * 64 + 5] = kNan;
  const std::string msg = refusal(floats("x.npy", x, 64), labels("y.npy", {0, 1, 2, 3}));
  EXPECT_NE(msg.find("x.npy: row 2, column 5 holds nan; features must be finite numbers (the data is bad"),
            std::string::npos)
      << msg;
}

TEST_F(BadValues, InfInALaterShardNamesThatShardAndItsRow) {
  std::filesystem::create_directories(dir_ / "x");
  floats("x/a.npy", numbered(0, 2, 64), 64);
  std::vector<float> b = numbered(2, 2, 64);
  b[64 + 63] = -kInf;
  floats("x/b.npy", b, 64);
  const std::string msg = refusal(dir_ / "x", labels("y.npy", {0, 1, 2, 3}));
  EXPECT_NE(msg.find("b.npy: row 1, column 63 holds -inf"), std::string::npos) << msg;
}

TEST_F(BadValues, NonFiniteRegressionTargetIsRefusedAtLoad) {
  std::vector<float> y = numbered(0, 3, 10);  // simple_digits' output: [N, 10]
  y[10] = kInf;
  const std::string msg = refusal(floats("x.npy", numbered(0, 3, 64), 64), floats("y.npy", y, 10), Targets::kValues);
  EXPECT_NE(msg.find("y.npy: row 1, column 0 holds inf; targets must be finite numbers"), std::string::npos) << msg;
}

// Above kCheckAtLoadBytes rows are checked as they are read: every read of a bad row
// says so, and still copies the whole batch.
TEST(Rows, UncheckedRowsAreCheckedAsTheyAreRead) {
  std::vector<float> v = numbered(0, 4, 3);
  v[3 * 3 + 1] = kNan;
  Rows rows = Rows::of_floats(v, 3);
  EXPECT_FALSE(rows.checked());
  std::vector<float> out;
  EXPECT_TRUE(rows.gather({0, 2, 1}, out).is_ok());
  Status bad = rows.gather({0, 3}, out);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.message().find("row 3, column 1 holds nan"), std::string::npos) << bad.message();
  EXPECT_EQ(out.size(), 6u);
  EXPECT_FALSE(rows.check_rows(2, 2).is_ok());
  EXPECT_TRUE(rows.check_rows(0, 3).is_ok());
  EXPECT_FALSE(rows.check_all().is_ok());
  EXPECT_FALSE(rows.checked());
}

TEST(Rows, ClassLabelsAreCheckedAgainstTheClassCount) {
  NpyArray a;
  a.path = "y.npy";
  a.type = NpyType::kInt32;
  a.shape = {3};
  const int32_t labels[3] = {1, 4, 2};
  a.bytes.assign(reinterpret_cast<const uint8_t*>(labels), reinterpret_cast<const uint8_t*>(labels) + sizeof labels);
  Rows rows({view_npy(a)}, 1, RowRule::kClassIndex, "labels", 4);
  std::vector<float> out;
  Status s = rows.gather({0, 1, 2}, out);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("y.npy: label 4 at row 1 is outside the model's 4 classes [0, 3]"), std::string::npos)
      << s.message();
  EXPECT_EQ(out, (std::vector<float>{1, 4, 2}));
}

}  // namespace
}  // namespace pipeshard
