// The backend registry (backend/registry.h): its rows' facts, and make_backend's errors,
// which speak of values. The CUDA row is asked only what it answers without a GPU.
#include <string>

#include <gtest/gtest.h>

#include "backend/registry.h"

namespace pipeshard {
namespace {

TEST(BackendRegistry, HasTheCpuFirstAndTheCuda) {
  ASSERT_EQ(backend_kinds().size(), 2u);
  EXPECT_STREQ(backend_kinds()[0].name, "cpu");
  EXPECT_STREQ(backend_kinds()[1].name, "cuda");
  EXPECT_EQ(find_backend("cuda"), &backend_kinds()[1]);
  EXPECT_EQ(find_backend("tpu"), nullptr);
}

TEST(BackendRegistry, TheCpuRowSaysWhatTheCpuBackendDoes) {
  const BackendKind& cpu = *find_backend("cpu");
  EXPECT_TRUE(cpu.computes_in(Precision::kFp32));
  EXPECT_FALSE(cpu.computes_in(Precision::kBf16));
  EXPECT_EQ(precision_list(cpu), "fp32");
  EXPECT_FALSE(cpu.records_work);
  EXPECT_EQ(cpu.memory, BackendMemory::kHost);
  EXPECT_EQ(cpu.usable_devices(nullptr), 1);
  EXPECT_TRUE(check_usable(cpu).is_ok());
  int64_t free = 0, total = 0;
  EXPECT_FALSE(cpu.device_memory(0, &free, &total));  // host memory: common/host_memory.h
}

TEST(BackendRegistry, TheCudaRowKnowsItsFactsWithoutItsPlugin) {
  const BackendKind& cuda = *find_backend("cuda");
  EXPECT_EQ(precision_list(cuda), "fp32, tf32, bf16 or fp16");
  EXPECT_TRUE(cuda.records_work);
  EXPECT_EQ(cuda.memory, BackendMemory::kDevice);
  EXPECT_EQ(backend_names_where([](const BackendKind& k) { return k.computes_in(Precision::kFp16); }), "cuda");
  EXPECT_EQ(backend_names_where([](const BackendKind&) { return true; }), "cpu or cuda");
}

TEST(BackendRegistry, MakesACpuBackendThatItRecognises) {
  Result<std::unique_ptr<Backend>> cpu = make_backend("cpu", {});
  ASSERT_TRUE(cpu.is_ok()) << cpu.status().message();
  EXPECT_EQ(backend_kind_of(**cpu), find_backend("cpu"));
  EXPECT_EQ(find_backend("cpu")->work_queue(**cpu), nullptr);
}

TEST(BackendRegistry, ErrorsSpeakOfValues) {
  Result<std::unique_ptr<Backend>> bf16 = make_backend("cpu", {.precision = Precision::kBf16});
  ASSERT_FALSE(bf16.is_ok());
  EXPECT_EQ(bf16.status().message(), "the CPU backend computes in fp32 only, not bf16");
  Result<std::unique_ptr<Backend>> tpu = make_backend("tpu", {});
  ASSERT_FALSE(tpu.is_ok());
  EXPECT_EQ(tpu.status().message(), "no backend 'tpu' in this build: cpu or cuda");
}

// Here (no driver, or no plugin in a build without the toolkit) the CUDA row says why in
// one line; on a machine with a GPU it makes a backend.
TEST(BackendRegistry, CudaWithoutAUsableGpuSaysWhy) {
  Result<std::unique_ptr<Backend>> gpu = make_backend("cuda", {});
  if (gpu.is_ok()) GTEST_SKIP() << "this machine has a usable GPU";
  const std::string& why = gpu.status().message();
  EXPECT_EQ(why.rfind("no usable GPU (", 0), 0u) << why;
  EXPECT_TRUE(why.find("cudaGetDeviceCount: error ") != std::string::npos ||
              why.find("this build has no CUDA backend") != std::string::npos)
      << why;
  EXPECT_EQ(check_usable(*find_backend("cuda")).message(), why);
}

}  // namespace
}  // namespace pipeshard
