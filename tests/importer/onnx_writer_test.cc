// Writing trained models back: inline while they fit in one protobuf message, with their
// weights in external data beside the file when they do not.
#include "importer/onnx_writer.h"

#include <filesystem>

#include <gtest/gtest.h>

#include "importer/onnx_importer.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::ScratchDir;
using testing::source_path;

// simple.onnx (100-256-128-10) with every parameter changed, written with `inline_limit`,
// must import with the changed values.
void round_trip(int64_t inline_limit, bool expect_external) {
  Result<ImportedModel> m = import_onnx_file(source_path("models/simple.onnx"));
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  Graph trained = m->graph;
  for (Parameter& p : trained.params)
    for (float& v : p.data) v = v * 0.5f + 0.25f;
  ScratchDir dir("writer");
  const std::filesystem::path path = dir / "trained.onnx";
  Status written = write_trained_model(*m, trained, path.string(), inline_limit);
  ASSERT_TRUE(written.is_ok()) << written.message();
  EXPECT_EQ(std::filesystem::exists(path.string() + ".data"), expect_external);
  if (expect_external) {
    EXPECT_LE(std::filesystem::file_size(path), static_cast<uintmax_t>(inline_limit));
  }
  Result<ImportedModel> back = import_onnx_file(path.string());
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  ASSERT_EQ(back->graph.params.size(), trained.params.size());
  for (size_t i = 0; i < trained.params.size(); ++i) {
    EXPECT_EQ(back->graph.params[i].name, trained.params[i].name);
    EXPECT_EQ(back->graph.params[i].data, trained.params[i].data) << trained.params[i].name;
  }
}

TEST(WriteTrainedModel, InlineWhenItFits) { round_trip(kProtobufLimit, false); }

TEST(WriteTrainedModel, ExternalDataWhenItDoesNot) { round_trip(4096, true); }

// Saving over a model that keeps its weights in external data writes the new weights
// under the other of two names, so the old pair stays whole until the new model is in
// place, and then removes the old data; an inline save removes it too.
TEST(WriteTrainedModel, OverwritingAlternatesTheDataFileAndLeavesNoStaleOne) {
  Result<ImportedModel> m = import_onnx_file(source_path("models/simple.onnx"));
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  ScratchDir dir("writer_again");
  const std::filesystem::path path = dir / "trained.onnx";
  const std::string first = path.string() + ".data", second = dir / "trained.onnx.1.data";
  Graph trained = m->graph;
  for (const auto& [limit, data] : {std::pair{int64_t{4096}, first}, std::pair{int64_t{4096}, second},
                                    std::pair{int64_t{4096}, first}, std::pair{kProtobufLimit, std::string()}}) {
    for (Parameter& p : trained.params) p.data[0] += 1.0f;
    ASSERT_TRUE(write_trained_model(*m, trained, path.string(), limit).is_ok());
    EXPECT_EQ(std::filesystem::exists(first), data == first);
    EXPECT_EQ(std::filesystem::exists(second), data == second);
    Result<ImportedModel> back = import_onnx_file(path.string());
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    for (size_t i = 0; i < trained.params.size(); ++i) EXPECT_EQ(back->graph.params[i].data, trained.params[i].data);
  }
}

// Only initializers move: a limit below what the graph's nodes alone need is an error,
// and nothing is written.
TEST(WriteTrainedModel, ALimitTheGraphItselfExceedsIsAnError) {
  Result<ImportedModel> m = import_onnx_file(source_path("models/simple.onnx"));
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  ScratchDir dir("writer_small");
  const std::filesystem::path path = dir / "trained.onnx";
  Status written = write_trained_model(*m, m->graph, path.string(), 16);
  EXPECT_FALSE(written.is_ok());
  EXPECT_NE(written.message().find("larger than protobuf's 2 GiB even with its initializers in external data"),
            std::string::npos)
      << written.message();
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path.string() + ".data"));
}

}  // namespace
}  // namespace pipeshard
