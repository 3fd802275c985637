// The CUDA build path: the probe links against the CUDA runtime everywhere the toolkit
// exists. Where a GPU is usable it must compute; elsewhere the test skips and says so.
#include <gtest/gtest.h>

#include "backend/cuda/device_query.h"

namespace pipeshard::cuda {
namespace {

TEST(CudaDevice, QueryAnswersWithoutCrashing) {
  DeviceQuery q = query_devices();
  EXPECT_GE(q.devices, 0);
  if (q.devices == 0) {
    EXPECT_FALSE(q.message.empty()) << "a failed query must say why";
  }
}

TEST(CudaDevice, AddsVectorsOnTheGpu) {
  DeviceQuery q = query_devices();
  if (q.devices == 0) {
    GTEST_SKIP() << "no usable GPU on this machine (cudaGetDeviceCount: error " << q.error_code << ", " << q.message
                 << "); the GPU check runs on a machine with one";
  }
  const int n = 1000;  // not a multiple of the block size
  std::vector<float> a(n), b(n), out(n, -1.0f);
  for (int i = 0; i < n; ++i) {
    a[i] = 0.5f * i;
    b[i] = 1.0f - i;
  }
  std::string message;
  ASSERT_TRUE(add_vectors_on_device(a.data(), b.data(), out.data(), n, &message)) << message;
  for (int i = 0; i < n; ++i) EXPECT_EQ(out[i], a[i] + b[i]) << i;
}

}  // namespace
}  // namespace pipeshard::cuda
