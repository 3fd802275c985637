// convert.cu's float → bf16/fp16 copies, and the rounding they share with the host
// (backend/math/convert_math.cuh), against CUDA's own conversions:
// - on the host (no GPU needed, so these run wherever the toolkit is): convert_math.cuh
//   against cuda_bf16.h's __float2bfloat16_rn and cuda_fp16.h's __float2half_rn, whose
//   host versions are software round-to-nearest-even, bit for bit (NaN: any NaN) over
//   every rounding decision of both formats and a sweep over the float bit patterns;
// - on the GPU (skipped without one, saying why): convert_to_16bit at every alignment and
//   length class of its two paths (float4 groups with a tail, one element at a time) equals
//   the host function bit for bit.
// tests/backend/cuda_math_test.cc checks convert_math.cuh itself against known bit patterns and an
// independent reference.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/launchers.h"
#include "backend/math/convert_math.cuh"
#include "tests/cuda/gpu_test_util.h"

namespace pipeshard::cuda {
namespace {

using Floats = std::vector<float>;

float from_bits(uint32_t u) { return math::float_from_bits(u); }

// Every value of both 16-bit formats, the midpoints to their neighbours and one float ulp
// either side (both signs), every 251st float bit pattern, and the special values.
Floats inputs() {
  Floats x;
  for (uint32_t h = 0; h < 0x7FFFu; ++h) {
    for (bool bf16 : {true, false}) {
      const auto p = static_cast<uint16_t>(h);
      const float v = bf16 ? math::bf16_to_float(p) : math::fp16_to_float(p);
      const float next =
          bf16 ? math::bf16_to_float(static_cast<uint16_t>(p + 1)) : math::fp16_to_float(static_cast<uint16_t>(p + 1));
      if (!std::isfinite(v) || !std::isfinite(next)) continue;
      const auto mid = static_cast<float>((static_cast<double>(v) + next) / 2);
      for (float f : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, next)}) {
        x.push_back(f);
        x.push_back(-f);
      }
    }
  }
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 251) x.push_back(from_bits(static_cast<uint32_t>(u)));
  const float inf = std::numeric_limits<float>::infinity();
  for (float f : {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), 65504.0f, 65520.0f, 0x1p-24f,
                  0x1p-25f, from_bits(0x7F7F8000u), from_bits(0x7F7FFFFFu)}) {
    x.push_back(f);
  }
  return x;
}

bool same_16(uint16_t got, uint16_t want, bool bf16) {
  if (got == want) return true;
  const float a = bf16 ? math::bf16_to_float(got) : math::fp16_to_float(got);
  const float b = bf16 ? math::bf16_to_float(want) : math::fp16_to_float(want);
  return std::isnan(a) && std::isnan(b);
}

TEST(CudaConvert, HeaderRoundingIsCudasOnTheHost) {
  int failures = 0;
  for (float f : inputs()) {
    uint16_t cuda_bf16, cuda_fp16;
    const __nv_bfloat16 b = __float2bfloat16_rn(f);
    const __half h = __float2half_rn(f);
    std::memcpy(&cuda_bf16, &b, sizeof(cuda_bf16));
    std::memcpy(&cuda_fp16, &h, sizeof(cuda_fp16));
    const uint16_t ours_bf16 = math::float_to_bf16_rn(f), ours_fp16 = math::float_to_fp16_rn(f);
    if (!same_16(ours_bf16, cuda_bf16, true) && failures++ < 5) {
      ADD_FAILURE() << "bf16 of " << f << " (0x" << std::hex << math::float_bits(f) << "): ours 0x" << ours_bf16
                    << ", __float2bfloat16_rn 0x" << cuda_bf16;
    }
    if (!same_16(ours_fp16, cuda_fp16, false) && failures++ < 5) {
      ADD_FAILURE() << "fp16 of " << f << " (0x" << std::hex << math::float_bits(f) << "): ours 0x" << ours_fp16
                    << ", __float2half_rn 0x" << cuda_fp16;
    }
  }
  EXPECT_EQ(failures, 0);
}

void cuda_ok(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    std::fprintf(stderr, "convert_test: %s: %s\n", what, cudaGetErrorString(rc));
    std::abort();
  }
}

class CudaConvertTest : public ::testing::TestWithParam<Precision> {
 protected:
  void SetUp() override {
    if (const std::string why = testing::no_usable_gpu(); !why.empty()) {
      GTEST_SKIP() << why << "; the conversion kernel check runs on a machine with one";
    }
    // Blocking: the set-up cudaMemcpy/cudaMemset run on the legacy stream, and a pageable
    // upload may return before its DMA ends; a blocking stream waits for both.
    cuda_ok(cudaStreamCreate(&stream_), "cudaStreamCreate");
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

// src at float offsets 0..3 from a 256-byte boundary (16-, 4-, 8-, 4-byte aligned) and dst
// at 16-bit offsets 0..3 (8-, 2-, 4-, 2-byte aligned), lengths with every remainder mod 4;
// the elements around the converted range must stay untouched.
TEST_P(CudaConvertTest, KernelEqualsTheHostFunctionBitForBit) {
  const bool bf16 = GetParam() == Precision::kBf16;
  Floats all = inputs();
  std::mt19937 rng(5);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(std::min<size_t>(all.size(), 1 << 20));
  const int64_t n_max = static_cast<int64_t>(all.size());
  float* src = nullptr;
  uint16_t* dst = nullptr;
  cuda_ok(cudaMalloc(&src, sizeof(float) * (n_max + 4)), "cudaMalloc");
  cuda_ok(cudaMalloc(&dst, sizeof(uint16_t) * (n_max + 8)), "cudaMalloc");
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{4}, int64_t{5}, int64_t{1023}, n_max - 2, n_max - 3}) {
    for (int64_t src_offset = 0; src_offset < 4; ++src_offset) {
      for (int64_t dst_offset : {0, 1, 2, 3}) {
        cuda_ok(cudaMemcpy(src + src_offset, all.data(), sizeof(float) * n, cudaMemcpyHostToDevice), "upload");
        cuda_ok(cudaMemset(dst, 0xAB, sizeof(uint16_t) * (n_max + 8)), "cudaMemset");
        convert_to_16bit(dst + dst_offset, src + src_offset, n, GetParam(), stream_);
        cuda_ok(cudaStreamSynchronize(stream_), "convert_to_16bit");
        std::vector<uint16_t> got(static_cast<size_t>(n + 8));
        cuda_ok(cudaMemcpy(got.data(), dst, sizeof(uint16_t) * got.size(), cudaMemcpyDeviceToHost), "download");
        const std::string what = std::string(precision_name(GetParam())) + " n=" + std::to_string(n) + " src offset " +
                                 std::to_string(src_offset) + " dst offset " + std::to_string(dst_offset);
        int failures = 0;
        for (int64_t i = 0; i < n + 8; ++i) {
          const bool inside = i >= dst_offset && i < dst_offset + n;
          const float f = inside ? all[static_cast<size_t>(i - dst_offset)] : 0.0f;
          const uint16_t rounded = bf16 ? math::float_to_bf16_rn(f) : math::float_to_fp16_rn(f);
          const uint16_t want = inside ? rounded : uint16_t{0xABAB};
          if (got[static_cast<size_t>(i)] != want && failures++ < 5) {
            ADD_FAILURE() << what << " [" << i << "] " << (inside ? "" : "(outside the range) ") << "of " << f << ": 0x"
                          << std::hex << got[static_cast<size_t>(i)] << ", want 0x" << want;
          }
        }
        if (HasFailure()) break;
      }
    }
  }
  cudaFree(src);
  cudaFree(dst);
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaConvertTest, ::testing::Values(Precision::kBf16, Precision::kFp16),
                         [](const ::testing::TestParamInfo<Precision>& info) {
                           return info.param == Precision::kBf16 ? std::string("Bf16") : std::string("Fp16");
                         });

}  // namespace
}  // namespace pipeshard::cuda
