// libFuzzer target: .npy bytes through the reader and the data set checks (fuzz_inputs.h
// says exactly what runs).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz/fuzz_inputs.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)pipeshard::fuzz::run_npy_input(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
