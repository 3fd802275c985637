// What the fuzz targets (fuzz/fuzz_onnx.cc, fuzz/fuzz_npy.cc) do with one input, as plain
// functions, so that tests/fuzz_regression_test.cc replays the saved findings through the
// same code in every build, with or without clang and libFuzzer.
//
// Both take bytes as a file would hold them and must return, whatever the bytes: a crash,
// a hang or a sanitizer report on any input is a bug in the code they drive, not in them.
#ifndef PIPESHARD_FUZZ_FUZZ_INPUTS_H_
#define PIPESHARD_FUZZ_FUZZ_INPUTS_H_

#include <string>
#include <string_view>

#include "common/status.h"

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

}  // namespace pipeshard::fuzz

#endif  // PIPESHARD_FUZZ_FUZZ_INPUTS_H_
