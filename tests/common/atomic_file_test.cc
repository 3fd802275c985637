// Files written from pieces hold the pieces one after another, whatever their sizes; a
// failed write names the file asked for, not its temporary name, and the OS's reason; and
// an output folder is probed for files before a run, missing parts created later.
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
  const std::string missing = dir / "missing/c";
  EXPECT_EQ(write_file_atomically(missing, pieces).message(),
            "cannot write '" + missing + "' (No such file or directory)");
}

TEST(AtomicFile, FoldersAreProbedForNewFiles) {
  testing::ScratchDir dir("atomic_probe");
  EXPECT_TRUE(check_writable_folder(dir.path()).is_ok());
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "the probe file is removed";
  EXPECT_TRUE(check_creatable_folder(dir / "a/b/c").is_ok()) << "created later, under a folder that takes files";
  EXPECT_FALSE(std::filesystem::exists(dir / "a")) << "and not created by the check";
  const std::string file = dir / "file";
  ASSERT_TRUE(write_file_atomically(file, std::string("x")).is_ok());
  const std::string not_a_folder = "'" + file + "' is a file, not a folder";
  EXPECT_EQ(check_creatable_folder(file).message(), not_a_folder);
  EXPECT_EQ(check_creatable_folder(file + "/sub").message(), not_a_folder);
  if (check_writable_folder("/sys").is_ok()) GTEST_SKIP() << "/sys takes files on this machine";
  EXPECT_EQ(check_writable_folder("/sys").message().rfind("cannot create files in '/sys' (", 0), 0u);
}

}  // namespace
}  // namespace pipeshard
