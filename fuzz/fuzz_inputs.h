// What the fuzz targets (fuzz/fuzz_onnx.cc, fuzz_npy.cc, fuzz_checkpoint.cc) do with one
// input, as plain functions, so that tests/fuzz/fuzz_regression_test.cc replays the saved
// findings through the same code in every build, with or without clang and libFuzzer.
//
// Each takes bytes as a file would hold them (the checkpoint's after a mode byte) and must
// return, whatever the bytes: a crash, a hang or a sanitizer report on any input is a bug
// in the code they drive, not in them.
#ifndef PIPESHARD_FUZZ_FUZZ_INPUTS_H_
#define PIPESHARD_FUZZ_FUZZ_INPUTS_H_

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pipeshard {
class Trainer;
}  // namespace pipeshard

namespace pipeshard::fuzz {

// An ONNX model file's bytes, named "fuzz.onnx" in messages: import_onnx_bytes (external
// data is looked up in `base_dir`); when that succeeds, make_plan with 2 stages, with
// 1 stage × tensor_parallel 2 and with 2 stages × 2, then plan_json_text, build_stage_model
// for every stage and shard of each plan made, and import_onnx_model on each stage model.
// Returns the import's Status: refusals after a successful import are expected for many
// valid models (too few layers, widths that do not divide by 2) and are not reported.
Status run_onnx_input(std::string_view bytes, const std::string& base_dir);

// A .npy file's bytes, named "fuzz.npy" in messages: parse_npy; when that succeeds,
// make_dataset with the array as the features and as the labels (the other side made to
// fit where it can), for cross-entropy and MSE, against two small models: [batch, 4] ->
// [batch, 3] and [batch, 2, 2] -> [batch, 2, 2]. Returns parse_npy's Status.
Status run_npy_input(std::string_view bytes);

// A checkpoint file (runtime/checkpoint_file.h) after one mode byte, named "fuzz.pipeshard"
// in messages. When the mode byte is odd, every CRC-32C the bytes let it find is
// recomputed first (with_checksums_repaired), so that mutations reach the header and tensor
// checks instead of failing a checksum; when it is even (or absent), the bytes are decoded
// as they are. Then decode_checkpoint; when that succeeds, Trainer::load_checkpoint_bytes
// on every trainer of checkpoint_trainers(), and on each whole-model trainer that took it
// one step, as train --resume would take next (when steps_done() < total_steps). Returns
// the decoding's refusal, or OK when some trainer took the checkpoint, or else the last
// trainer's refusal: each fits one optimizer at most.
Status run_checkpoint_input(std::string_view bytes);

// `file` with its format-2 checksums recomputed as far as its bytes let them be found:
// each tensor's "crc32c" in the header (when the header parses as JSON and lists it as an
// unsigned number; the header is then rewritten), then the header's. Anything else,
// format 1 included, comes back as it is.
std::string with_checksums_repaired(std::string_view file);

// The trainers run_checkpoint_input restores onto, built on first use and kept: a
// BatchNorm MLP (models/batchnorm_train.onnx: 16 -> Linear 32 -> BatchNorm -> ReLU ->
// Linear 10, 938 trainable parameters and 64 running statistics) on 8 samples made up in
// code, trained by plain SGD ("sgd", no optimizer slots), SGD with momentum
// ("sgd_momentum", one slot) and Adam ("adam", two slots), each on the whole model in one
// process; and Adam as the rank holding stage 1, shard 1 of a 2-stage, 2-shard layout
// ("adam_stage1_shard1"), whose communicators refuse every call: restoring needs none, and
// it slices every tensor it holds. Only the whole-model trainers can step or save.
struct CheckpointTrainer {
  std::string name;
  Trainer* trainer = nullptr;
  bool whole = false;  // the whole model in one process
};
const std::vector<CheckpointTrainer>& checkpoint_trainers();

}  // namespace pipeshard::fuzz

#endif  // PIPESHARD_FUZZ_FUZZ_INPUTS_H_
