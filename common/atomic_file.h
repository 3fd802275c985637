// Writing files so that readers only ever see the old or the new content.
#ifndef PIPESHARD_COMMON_ATOMIC_FILE_H_
#define PIPESHARD_COMMON_ATOMIC_FILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace pipeshard {

// For crash tests only: a point inside write_file_atomically where the process kills
// itself with SIGKILL, as a crash or an out-of-memory kill would end it there. `train`
// sets it from PIPESHARD_FAULT_AT (tools/train/main.cc); nothing else does.
struct CrashPoint {
  enum class Where {
    kNever,
    kAfterBytes,    // after writing min(bytes, size) bytes of the temporary file, before its fsync
    kBeforeRename,  // the temporary file complete and fsynced, not yet renamed
    kAfterRename,   // renamed over the target, the folder not yet fsynced
  };
  Where where = Where::kNever;
  int64_t bytes = 0;  // kAfterBytes only
};

// Writes `bytes` to `path` and fsyncs it (no rename); removes the file on failure.
Status write_file_synced(const std::string& path, const std::string& bytes);
// The same for a file made of `pieces` one after another (parts of a large file that
// exist apart need not be joined in memory first).
Status write_file_synced(const std::string& path, const std::vector<std::string>& pieces);

// Writes `bytes` to `path` atomically: a temporary file in the same folder
// (`path`.tmp<pid>), fsync, rename over `path`, fsync of the folder. A crash at any
// point leaves either the old file or the new one, and at worst a stray temporary file.
// Errors name `path` (not the temporary file) and the OS's reason: "cannot write
// 'out/model.onnx' (No space left on device)".
Status write_file_atomically(const std::string& path, const std::string& bytes, const CrashPoint& crash = {});
Status write_file_atomically(const std::string& path, const std::vector<std::string>& pieces,
                             const CrashPoint& crash = {});

// Whether files can be created in `folder`, asked of the file system itself (permissions,
// a read-only mount, ACLs; root passes mode bits but not a read-only mount): creates and
// removes an empty probe file there. `folder` must exist. The error gives the OS's reason:
// "cannot create files in 'out' (Read-only file system)". For outputs a run writes only at
// its end, checked before the work starts.
Status check_writable_folder(const std::string& folder);

// The same for a folder a run will create if need be (--checkpoint DIR, partition --out):
// `folder` itself when it exists (it must be a folder), otherwise its nearest existing
// ancestor, in which the missing part will be created.
Status check_creatable_folder(const std::string& folder);

}  // namespace pipeshard

#endif  // PIPESHARD_COMMON_ATOMIC_FILE_H_
