// libFuzzer target: a mode byte and checkpoint bytes through decode_checkpoint and the
// resume path, Trainer::load_checkpoint_bytes, on trainers of three optimizers and on a
// rank of a cut model (fuzz_inputs.h says exactly what runs).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz/fuzz_inputs.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)pipeshard::fuzz::run_checkpoint_input(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
