// Loading the example models in models/ for tests.
#ifndef PIPESHARD_TESTS_MODEL_UTIL_H_
#define PIPESHARD_TESTS_MODEL_UTIL_H_

#include <string>
#include <utility>

#include <gtest/gtest.h>

#include "importer/onnx_importer.h"
#include "tests/test_util.h"

namespace pipeshard::testing {

// models/NAME.onnx, imported; a failure to import fails the test that asked.
inline ImportedModel load_model(const std::string& name) {
  Result<ImportedModel> m = import_onnx_file(source_path("models/" + name + ".onnx"));
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  return std::move(m).value();
}

}  // namespace pipeshard::testing

#endif  // PIPESHARD_TESTS_MODEL_UTIL_H_
