// Writing files so that readers only ever see the old or the new content.
#ifndef PIPESHARD_COMMON_ATOMIC_FILE_H_
#define PIPESHARD_COMMON_ATOMIC_FILE_H_

#include <string>

#include "common/status.h"

namespace pipeshard {

// Writes `bytes` to `path` and fsyncs it (no rename); removes the file on failure.
Status write_file_synced(const std::string& path, const std::string& bytes);

// Writes `bytes` to `path` atomically: a temporary file in the same folder, fsync,
// rename over `path`, fsync of the folder. A crash at any point leaves either the old
// file or the new one.
Status write_file_atomically(const std::string& path, const std::string& bytes);

}  // namespace pipeshard

#endif  // PIPESHARD_COMMON_ATOMIC_FILE_H_
