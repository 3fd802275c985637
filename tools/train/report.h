// The end of a finished run: what train reports and writes once the last step is done.
#ifndef PIPESHARD_TOOLS_TRAIN_REPORT_H_
#define PIPESHARD_TOOLS_TRAIN_REPORT_H_

#include <string>
#include <vector>

#include "runtime/trainer.h"

namespace pipeshard::train_cli {

// "peak …: …" from every process's peak of backend memory (decimal byte counts) and
// what rank 0's holds.
std::string peak_memory_line(const std::vector<std::string>& peaks, const std::string& device,
                             const Trainer::Memory& mine);

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_REPORT_H_
