// The checkpoint file: named whole-model tensors and the step count, with a checksum on
// every part, so that a file damaged on disk or cut short is refused, naming the part,
// instead of resuming a run from wrong weights. What goes in it, and how a rank takes
// its slices back out, is the Trainer's business (runtime/trainer.h).
//
// Format 2 (all integers little-endian):
//   [0, 8)         magic "PSCKPT02"
//   [8, 16)        n: the length of the header, uint64
//   [16, 16+n)     header, JSON: {"format": 2, "step", "updates", "optimizer",
//                  "tensors": [{"name", "role", "elements", "crc32c"}, ...]}
//                  ("updates", the steps not skipped for non-finite gradients, may be
//                  absent: files written before it existed had no skipped steps; a run
//                  with loss scaling adds "loss_scale": {"scale", "good_steps"})
//   [16+n, 20+n)   CRC-32C (common/crc32c.h) of bytes [0, 16+n): magic, length and header
//   [20+n, end)    the tensors' float32 data, in the header's order; each tensor's
//                  "crc32c" is that of its 4·elements bytes. Nothing follows the last.
// Format 1 ("PSCKPT01", written before checksums existed) is the same without the header
// CRC and without "crc32c": it is still read, unverified.
#ifndef PIPESHARD_RUNTIME_CHECKPOINT_FILE_H_
#define PIPESHARD_RUNTIME_CHECKPOINT_FILE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pipeshard {

struct CheckpointTensor {
  std::string name;         // the initializer's name in the model
  std::string role;         // "value", or "slot<s>": the optimizer's state s for it
  std::vector<float> data;  // [elements], the whole model's tensor
};

struct Checkpoint {
  int64_t step = 0;       // optimizer steps taken
  int64_t updates = 0;    // of those, the steps that updated the weights (not skipped)
  std::string optimizer;  // "sgd", "adam" or "adamw"
  // Loss scaling's state (runtime/trainer.h, LossScaling): the next step's scale, 0 when
  // the run had none, and the updates since the dynamic scale last changed.
  double loss_scale = 0;
  int64_t loss_scale_good_steps = 0;
  std::vector<CheckpointTensor> tensors;
};

// The bytes of `checkpoint` in format 2.
std::string encode_checkpoint(const Checkpoint& checkpoint);

// Parses `bytes` (format 2 or 1) after checking every checksum and that the sizes add up
// to the file's. Errors name the damaged part: "corrupt checkpoint header (...)",
// "corrupt checkpoint: tensor 'fc1.weight' (value) fails its CRC-32C check", "truncated
// checkpoint: tensor ... needs 4096 bytes, 100 remain".
Result<Checkpoint> decode_checkpoint(std::string_view bytes);

}  // namespace pipeshard

#endif  // PIPESHARD_RUNTIME_CHECKPOINT_FILE_H_
