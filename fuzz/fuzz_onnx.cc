// libFuzzer target: ONNX model bytes through the importer, the partitioner and the stage
// writer (fuzz_inputs.h says exactly what runs). External data resolves in models/, so
// that seeds such as external_data.onnx keep their data file.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz/fuzz_inputs.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)pipeshard::fuzz::run_onnx_input(std::string_view(reinterpret_cast<const char*>(data), size),
                                        PIPESHARD_SOURCE_DIR "/models");
  return 0;
}
