// Bad arguments to the partition tool, on a good model: each ends as malformed_input_test.cc's
// cases do, with exit status 2, one line on stderr that starts "partition: error: " and
// names the flag, nothing on stdout, and no output folder (or, where the folder is in the
// way, nothing left in it); --help alone exits 0.
#include <filesystem>
#include <string>
#include <vector>

#include "tests/tools/malformed_util.h"

namespace pipeshard::testing {
namespace {

namespace fs = std::filesystem;

class MalformedArguments : public Malformed {
 protected:
  CommandResult partition_simple(const std::string& args) {
    return run_partition(source_path(kSimple), out_dir(), args);
  }
};

TEST_F(MalformedArguments, ZeroStages) {
  EXPECT_TRUE(refused(partition_simple("--stages 0"), out_dir(), {"--stages", "0"}));
}

TEST_F(MalformedArguments, NegativeStages) {
  EXPECT_TRUE(refused(partition_simple("--stages -1"), out_dir(), {"--stages"}));
}

TEST_F(MalformedArguments, StagesNotANumber) {
  EXPECT_TRUE(refused(partition_simple("--stages two"), out_dir(), {"--stages", "two"}));
}

TEST_F(MalformedArguments, StagesOverflowInt) {
  EXPECT_TRUE(refused(partition_simple("--stages 99999999999"), out_dir(), {"--stages"}));
}

TEST_F(MalformedArguments, MoreStagesThanLayers) {
  EXPECT_TRUE(refused(partition_simple("--stages 4"), out_dir(), {"cannot make 4 non-empty stages from 3 layers"}));
}

// One stage pairs /0/Gemm (256 outputs) with /2/Gemm; with two stages /0/Gemm stays
// replicated and /2/Gemm (128 outputs) pairs with /4/Gemm.
TEST_F(MalformedArguments, TensorParallelNotDividingWidth) {
  EXPECT_TRUE(refused(partition_simple("--stages 1 --tensor-parallel 3"), out_dir(),
                      {"node '/0/Gemm'", "256 output features", "3 tensor-parallel shards"}));
  EXPECT_TRUE(refused(partition_simple("--stages 2 --tensor-parallel 3"), out_dir(),
                      {"node '/2/Gemm'", "128 output features", "3 tensor-parallel shards"}));
}

TEST_F(MalformedArguments, ZeroTensorParallel) {
  EXPECT_TRUE(refused(partition_simple("--tensor-parallel 0"), out_dir(), {"--tensor-parallel", "0"}));
}

TEST_F(MalformedArguments, UnknownFlag) {
  EXPECT_TRUE(refused(partition_simple("--stages 2 --bogus"), out_dir(), {"--bogus"}));
}

TEST_F(MalformedArguments, UnknownBalance) {
  EXPECT_TRUE(refused(partition_simple("--balance bogus"), out_dir(), {"--balance", "bogus"}));
}

TEST_F(MalformedArguments, BadZeroStageOrReplicas) {
  EXPECT_TRUE(refused(partition_simple("--zero 3 --replicas 2"), out_dir(), {"--zero", "3"}));
  EXPECT_TRUE(refused(partition_simple("--zero 1 --replicas 0"), out_dir(), {"--replicas", "0"}));
  EXPECT_TRUE(refused(partition_simple("--zero 2 --replicas 2 --bucket-mb 0"), out_dir(), {"--bucket-mb"}));
  EXPECT_TRUE(refused(partition_simple("--zero 2 --replicas 2 --bucket-mb 1e9"), out_dir(), {"--bucket-mb"}));
}

TEST_F(MalformedArguments, ZeroBatchSize) {
  EXPECT_TRUE(refused(partition_simple("--batch-size 0"), out_dir(), {"--batch-size"}));
}

TEST_F(MalformedArguments, NegativeMicroBatches) {
  EXPECT_TRUE(refused(partition_simple("--micro-batches -2"), out_dir(), {"--micro-batches"}));
}

// A batch this large overflows the memory estimate: refuse it rather than print a wrong
// estimate or an internal message about negative costs.
TEST_F(MalformedArguments, HugeBatchSize) {
  EXPECT_TRUE(refused(partition_simple("--stages 2 --batch-size 9223372036854775807"), out_dir(), {"--batch-size"}));
  EXPECT_TRUE(refused(partition_simple("--stages 2 --balance memory --batch-size 9223372036854775807"), out_dir(),
                      {"--batch-size"}));
}

TEST_F(MalformedArguments, MissingModel) {
  EXPECT_TRUE(refused(run_partition("", out_dir(), "--stages 2"), out_dir(), {"model", "required"}));
}

TEST_F(MalformedArguments, OutputFolderIsAFile) {
  write_bytes(out_dir(), "keep me\n");
  EXPECT_TRUE(refused(partition_simple("--stages 2"), "", {"output folder"}));
  EXPECT_EQ(read_text(out_dir()), "keep me\n");
}

// The output folder exists and plan.json in it is a folder, so the last file cannot be
// written: the stage files must not be left behind either.
TEST_F(MalformedArguments, OutputBlockedHalfway) {
  fs::create_directories(out_dir() + "/plan.json");
  EXPECT_TRUE(refused(partition_simple("--stages 2"), "", {"plan.json"}));
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(out_dir())) left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{"plan.json"}) << "files left in the output folder";
}

TEST_F(MalformedArguments, HelpExitsZero) {
  const CommandResult r = partition_simple("--help");
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("Usage"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--stages"), std::string::npos) << r.out;
  EXPECT_EQ(r.err, "");
  EXPECT_FALSE(fs::exists(out_dir()));
}

}  // namespace
}  // namespace pipeshard::testing
