// linear.cu (cuBLASLt, its epilogues and their fallbacks) against the CPU backend, the
// reference, on the same inputs: both weight layouts, every activation fused with and
// without `pre`, scaled and unscaled bias, both GradWrite modes (kOverwrite into NaN, which
// must not leak through), odd and degenerate shapes, and pointers at the alignments the
// epilogue choices hinge on. fp32 is held to backend_check.h's forward tolerance (1e-5 of
// the output's scale); TF32 to 1e-2, where any mapping error (a wrong transpose, leading
// dimension or epilogue) is of order one. Without a usable GPU every test skips, saying why.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "executor/backend.h"
#include "executor/cuda/launchers.h"
#include "tests/backend_check.h"

namespace pipeshard::cuda {
namespace {

namespace check = ::pipeshard::testing;
using check::Floats;

void cuda_ok(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    std::fprintf(stderr, "linear_test: %s: %s\n", what, cudaGetErrorString(rc));
    std::abort();
  }
}

// A device copy of a host vector, starting `offset` floats past a 256-byte boundary: offset
// 1 gives cuBLASLt 4-byte aligned pointers, 4 gives 16-byte ones, 0 gives 256.
class DeviceFloats {
 public:
  DeviceFloats(const Floats& host, int64_t offset) : n_(host.size()), offset_(offset) {
    cuda_ok(cudaMalloc(&base_, sizeof(float) * (n_ + offset_ + 1)), "cudaMalloc");
    if (n_ > 0) cuda_ok(cudaMemcpy(data(), host.data(), sizeof(float) * n_, cudaMemcpyHostToDevice), "upload");
  }
  ~DeviceFloats() { cudaFree(base_); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;

  float* data() const { return base_ + offset_; }
  Floats host() const {
    Floats out(n_);
    if (n_ > 0) cuda_ok(cudaMemcpy(out.data(), data(), sizeof(float) * n_, cudaMemcpyDeviceToHost), "download");
    return out;
  }

 private:
  size_t n_;
  int64_t offset_;
  float* base_ = nullptr;
};

std::string shape_name(const LinearShape& s) {
  return std::string(s.layout == WeightLayout::kOutIn ? "[out,in]" : "[in,out]") + " rows=" + std::to_string(s.rows) +
         " in=" + std::to_string(s.in) + " out=" + std::to_string(s.out) + " alpha=" + std::to_string(s.alpha) +
         " beta=" + std::to_string(s.beta);
}

// The parameter: TF32 (true) or fp32 GEMMs.
class CudaLinearTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess || count == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no usable GPU (cudaGetDeviceCount: " << cudaGetErrorString(rc) << ", " << count
                   << " devices); the cuBLASLt check runs on a machine with one";
    }
    cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    context_ = create_linear_context(GetParam());
  }
  void TearDown() override {
    if (context_ == nullptr) return;
    cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    destroy_linear_context(context_);
    cudaStreamDestroy(stream_);
  }

  double rtol() const { return GetParam() ? 1e-2 : check::kForwardRtol; }
  Floats random(int64_t n) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    Floats v(static_cast<size_t>(n));
    for (float& x : v) x = dist(rng_);
    return v;
  }
  void expect_near(const Floats& got, const Floats& want, const std::string& what) {
    check::expect_values_near(got, check::to_double(want), what, rtol());
  }
  void sync() { cuda_ok(cudaStreamSynchronize(stream_), "linear on the GPU"); }

  // y (and pre) from the GPU against the CPU backend.
  void check_forward(const LinearShape& s, bool with_bias, const Activation* act, bool want_pre, int64_t offset,
                     const std::string& what) {
    const Floats x = random(s.rows * s.in), w = random(s.in * s.out), b = random(s.out);
    const Floats before(static_cast<size_t>(s.rows * s.out), 7.0f);  // rows = 0 must leave it
    Floats y = before, pre = before;
    cpu_->linear_forward(y.data(), x.data(), w.data(), with_bias ? b.data() : nullptr, s, act,
                         want_pre ? pre.data() : nullptr);
    DeviceFloats gx(x, offset), gw(w, offset), gb(b, offset), gy(before, offset), gpre(before, offset);
    linear_forward(context_, gy.data(), gx.data(), gw.data(), with_bias ? gb.data() : nullptr, s, act,
                   want_pre ? gpre.data() : nullptr, stream_);
    sync();
    expect_near(gy.host(), y, what + " y");
    expect_near(gpre.host(), pre, what + " pre");
  }

  // dx, dw, db from the GPU against the CPU backend; kAdd adds into random gradients,
  // kOverwrite overwrites NaN.
  void check_backward(const LinearShape& s, bool want_dx, bool want_dw, bool want_db, GradWrite params,
                      GradWrite input, int64_t offset, const std::string& what) {
    const Floats x = random(s.rows * s.in), w = random(s.in * s.out), dy = random(s.rows * s.out);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    auto start = [&](int64_t n, GradWrite mode) {
      return mode == GradWrite::kAdd ? random(n) : Floats(static_cast<size_t>(n), nan);
    };
    Floats dx = start(s.rows * s.in, input), dw = start(s.in * s.out, params), db = start(s.out, params);
    DeviceFloats gx(x, offset), gw(w, offset), gdy(dy, offset), gdx(dx, offset), gdw(dw, offset), gdb(db, offset);
    cpu_->linear_backward(want_dx ? dx.data() : nullptr, want_dw ? dw.data() : nullptr, want_db ? db.data() : nullptr,
                          dy.data(), x.data(), w.data(), s, params, input);
    linear_backward(context_, want_dx ? gdx.data() : nullptr, want_dw ? gdw.data() : nullptr,
                    want_db ? gdb.data() : nullptr, gdy.data(), gx.data(), gw.data(), s, params, input, stream_);
    sync();
    if (want_dx) expect_near(gdx.host(), dx, what + " dx");
    if (want_dw) expect_near(gdw.host(), dw, what + " dw");
    if (want_db) expect_near(gdb.host(), db, what + " db");
    expect_near(gdy.host(), dy, what + " dy is not modified");
  }

  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  std::mt19937 rng_{20240611};
  cudaStream_t stream_ = nullptr;
  LinearContext* context_ = nullptr;
};

TEST_P(CudaLinearTest, ForwardAndBackwardInBothLayouts) {
  for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    for (const auto& [alpha, beta] : {std::pair{1.0f, 1.0f}, std::pair{0.7f, -1.3f}}) {
      for (int64_t rows : {1, 3, 64}) {
        for (int64_t in : {1, 5, 128}) {
          for (int64_t out : {1, 8, 33, 128}) {
            const LinearShape s{rows, in, out, layout, alpha, beta};
            const std::string what = shape_name(s);
            check_forward(s, true, nullptr, false, 0, what + " bias");
            check_forward(s, false, nullptr, false, 0, what + " no bias");
            check_backward(s, true, true, true, GradWrite::kAdd, GradWrite::kAdd, 0, what + " add");
            check_backward(s, true, true, true, GradWrite::kOverwrite, GradWrite::kOverwrite, 0, what + " overwrite");
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

// Every activation, fused with and without `pre`, at shapes where cuBLASLt's GELU aux
// applies (out a multiple of 8, aligned pre) and where it does not.
TEST_P(CudaLinearTest, FusedActivations) {
  for (ActivationKind kind : check::kAllActivations) {
    const Activation act{kind, 0.05f};
    for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
      for (const LinearShape& s : {LinearShape{7, 5, 33, layout, 0.9f, 1.0f}, LinearShape{16, 32, 64, layout},
                                   LinearShape{5, 3, 8, layout, 1.0f, 1.1f}}) {
        for (int64_t offset : {0, 1}) {
          const std::string what = check::kind_name(kind) + " " + shape_name(s) + " offset " + std::to_string(offset);
          for (bool bias : {true, false}) {
            check_forward(s, bias, &act, true, offset, what + (bias ? " bias" : "") + " with pre");
            check_forward(s, bias, &act, false, offset, what + (bias ? " bias" : "") + " without pre");
          }
          if (HasFailure()) return;
        }
      }
    }
  }
}

// 4-, 8- and 16-byte aligned buffers: the epilogues' alignment fallbacks, and cuBLASLt
// plans chosen for each alignment class (a plan for 256-byte pointers must not serve these).
TEST_P(CudaLinearTest, MisalignedBuffers) {
  const Activation gelu_tanh{ActivationKind::kGeluTanh}, relu{ActivationKind::kRelu};
  for (int64_t offset : {0, 1, 2, 4, 1, 0}) {  // back and forth through the plan cache
    for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
      const LinearShape s{24, 40, 64, layout};
      const std::string what = shape_name(s) + " offset " + std::to_string(offset);
      check_forward(s, true, nullptr, false, offset, what);
      check_forward(s, true, &relu, false, offset, what + " relu");
      check_forward(s, true, &gelu_tanh, true, offset, what + " gelu-tanh with pre");
      check_backward(s, true, true, true, GradWrite::kOverwrite, GradWrite::kOverwrite, offset, what + " overwrite");
      check_backward(s, true, true, true, GradWrite::kAdd, GradWrite::kAdd, offset, what + " add");
      if (HasFailure()) return;
    }
  }
}

TEST_P(CudaLinearTest, SomeGradientsOnly) {
  for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    const LinearShape s{9, 17, 24, layout};
    for (GradWrite mode : {GradWrite::kAdd, GradWrite::kOverwrite}) {
      const std::string what = shape_name(s) + (mode == GradWrite::kAdd ? " add" : " overwrite");
      check_backward(s, false, true, false, mode, mode, 0, what + " dw");
      check_backward(s, false, false, true, mode, mode, 0, what + " db");
      check_backward(s, true, false, false, mode, mode, 0, what + " dx");
      check_backward(s, false, true, true, mode, GradWrite::kAdd, 0, what + " dw db");
    }
  }
}

// No rows leaves y alone; no input features give y = act(beta·b); no outputs is a no-op;
// overwritten gradients of an empty product are zero.
TEST_P(CudaLinearTest, EmptyShapes) {
  const Activation sigmoid{ActivationKind::kSigmoid};
  for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    for (const LinearShape& s : {LinearShape{0, 3, 2, layout}, LinearShape{4, 0, 3, layout, 1.0f, 0.5f},
                                 LinearShape{4, 3, 0, layout}}) {
      const std::string what = shape_name(s);
      check_forward(s, true, nullptr, false, 0, what);
      check_forward(s, true, &sigmoid, true, 0, what + " sigmoid");
      check_backward(s, true, true, true, GradWrite::kAdd, GradWrite::kAdd, 0, what + " add");
      check_backward(s, true, true, true, GradWrite::kOverwrite, GradWrite::kOverwrite, 0, what + " overwrite");
    }
  }
}

// Sizes where cuBLASLt picks tensor-core kernels, split-K and its workspace.
TEST_P(CudaLinearTest, LargerLayers) {
  const Activation gelu_tanh{ActivationKind::kGeluTanh};
  for (WeightLayout layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    const LinearShape s{512, 1024, 256, layout};
    check_forward(s, true, &gelu_tanh, true, 0, shape_name(s) + " gelu-tanh");
    check_backward(s, true, true, true, GradWrite::kOverwrite, GradWrite::kOverwrite, 0, shape_name(s));
    const LinearShape k_heavy{8, 4096, 16, layout};
    check_forward(k_heavy, true, nullptr, false, 0, shape_name(k_heavy));
    check_backward(k_heavy, true, true, true, GradWrite::kAdd, GradWrite::kAdd, 0, shape_name(k_heavy));
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaLinearTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Tf32" : "Fp32"; });

}  // namespace
}  // namespace pipeshard::cuda
