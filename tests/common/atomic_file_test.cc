// Files written from pieces hold the pieces one after another, whatever their sizes.
#include "common/atomic_file.h"

#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace pipeshard {
namespace {

TEST(AtomicFile, PiecesAreWrittenInOrder) {
  testing::ScratchDir dir("atomic_pieces");
  const std::vector<std::string> pieces = {"", "abc", std::string(70000, 'x'), "", std::string(3, '\0'), "end"};
  std::string joined;
  for (const std::string& p : pieces) joined += p;
  ASSERT_TRUE(write_file_atomically(dir / "a", pieces).is_ok());
  EXPECT_EQ(testing::read_text(dir / "a"), joined);
  ASSERT_TRUE(write_file_synced(dir / "b", pieces).is_ok());
  EXPECT_EQ(testing::read_text(dir / "b"), joined);
  ASSERT_TRUE(write_file_atomically(dir / "a", std::vector<std::string>{}).is_ok());
  EXPECT_EQ(testing::read_text(dir / "a"), "");
  EXPECT_FALSE(write_file_atomically(dir / "missing/c", pieces).is_ok());
}

}  // namespace
}  // namespace pipeshard
