// The launchers of elementwise.cu, reduce.cu and optimizer.cu (backend/cuda/launchers.h)
// against the CPU backend on the same inputs, on a GPU; the tests skip, saying so, on a
// machine without one. Launchers are called directly on cudaMalloc'd buffers, so this
// needs none of the other kernel families.
//
// Expected agreement (elementwise_math.cuh says why): bitwise for everything without a
// transcendental function — copies, fills, axpy, scale, add, bias adds, ReLU/LeakyReLU,
// the dropout mask and both optimizers (NaN matching any NaN); within 1e-5·(|cpu| + 1) for
// the activations that call exp/erf/tanh (CUDA's differ from glibc's by a few ulp); sums
// (bias_backward, sum_squares) within their rounding, and sum_squares identical bit for
// bit when run twice. Each shape runs on 16-byte-aligned buffers (the float4 paths) and on
// buffers one float off (the scalar paths).
//
// Built and run by tests/CMakeLists.txt as cuda_elementwise_reduce_optimizer_test (label gpu).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/launchers.h"
#include "tests/cuda/gpu_test_util.h"

namespace pipeshard::cuda {
namespace {

using Floats = std::vector<float>;

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

// A device copy of a host array, `shift` floats past a cudaMalloc'd (256-byte-aligned)
// base: shift 0 takes the float4 paths, shift 1 the scalar ones.
class DeviceArray {
 public:
  DeviceArray(const Floats& host, int64_t shift) : n_(static_cast<int64_t>(host.size())) {
    EXPECT_EQ(cudaMalloc(&base_, sizeof(float) * static_cast<size_t>(n_ + shift + 1)), cudaSuccess);
    data_ = base_ + shift;
    if (n_ > 0) {
      EXPECT_EQ(cudaMemcpy(data_, host.data(), bytes(), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~DeviceArray() { cudaFree(base_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  float* data() const { return data_; }
  // Waits for the device (cudaMemcpy synchronises with the legacy stream; the tests'
  // stream is a blocking one) and copies the array back.
  Floats get() const {
    Floats host(static_cast<size_t>(n_));
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (n_ > 0) {
      EXPECT_EQ(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return host;
  }

 private:
  size_t bytes() const { return sizeof(float) * static_cast<size_t>(n_); }
  float* base_ = nullptr;
  float* data_ = nullptr;
  int64_t n_;
};

bool same_float(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) || (std::isnan(a) && std::isnan(b));
}

void expect_bitwise(const Floats& want, const Floats& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!same_float(want[i], got[i]) && bad++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: cpu " << want[i] << ", cuda " << got[i];
  }
  EXPECT_EQ(bad, 0) << what;
}

void expect_near(const Floats& want, const Floats& got, double rtol, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const bool ok = std::isfinite(want[i]) ? std::fabs(double{got[i]} - want[i]) <= rtol * (std::fabs(want[i]) + 1.0)
                                           : same_float(want[i], got[i]);
    if (!ok && bad++ < 5) ADD_FAILURE() << what << "[" << i << "]: cpu " << want[i] << ", cuda " << got[i];
  }
  EXPECT_EQ(bad, 0) << what;
}

Floats normal(size_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  Floats v(n);
  for (float& f : v) f = d(rng);
  return v;
}

const int64_t kSizes[] = {0, 1, 3, 4, 5, 1027, 100003};
const int64_t kShifts[] = {0, 1};

std::string at(int64_t n, int64_t shift) { return " n " + std::to_string(n) + " shift " + std::to_string(shift); }

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = testing::no_usable_gpu(); !why.empty()) {
      GTEST_SKIP() << why << "; these checks run on a machine with one";
    }
    ASSERT_CUDA(cudaStreamCreate(&stream_));  // blocking: DeviceArray's cudaMemcpy waits for it
    ASSERT_CUDA(cudaMalloc(&scratch_, reduce_scratch_bytes()));
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      cudaStreamDestroy(stream_);
    }
    cudaFree(scratch_);
  }

  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
};

TEST_F(CudaKernels, FillAxpyScaleAddAreBitwiseTheCpus) {
  for (int64_t n : kSizes) {
    for (int64_t shift : kShifts) {
      const Floats x = normal(n, 1), y0 = normal(n, 2);
      for (float value : {1.5f, 0.0f, -0.0f}) {
        Floats want(n, 7.0f);
        cpu_->fill(want.data(), value, n);
        DeviceArray d(Floats(n, 7.0f), shift);
        fill(d.data(), value, n, stream_);
        expect_bitwise(want, d.get(), "fill " + std::to_string(value) + at(n, shift));
      }
      {
        Floats want = y0;
        cpu_->axpy(want.data(), 0.3f, x.data(), n);
        DeviceArray dy(y0, shift), dx(x, shift);
        axpy(dy.data(), 0.3f, dx.data(), n, stream_);
        expect_bitwise(want, dy.get(), "axpy" + at(n, shift));
      }
      {
        Floats want = y0;
        cpu_->scale(want.data(), -0.7f, n);
        DeviceArray d(y0, shift);
        scale(d.data(), -0.7f, n, stream_);
        expect_bitwise(want, d.get(), "scale" + at(n, shift));
      }
      {
        Floats want(n);
        cpu_->add_forward(want.data(), x.data(), y0.data(), n);
        DeviceArray da(x, shift), db(y0, 0), dout(Floats(n), shift);  // b aligned, a not: mixed
        add(dout.data(), da.data(), db.data(), n, stream_);
        expect_bitwise(want, dout.get(), "add" + at(n, shift));
      }
    }
  }
}

TEST_F(CudaKernels, CopyRowsAndAddBiasAreBitwiseTheCpus) {
  struct Shape {
    int64_t rows, width, dst_stride, src_stride;
  };
  // 70000 rows: more than one grid row per block row (gridDim.y stops at 65535).
  for (const Shape s : {Shape{1, 1, 1, 1}, Shape{5, 33, 40, 35}, Shape{70000, 3, 7, 3}, Shape{64, 300, 300, 900}}) {
    const std::string what = " rows " + std::to_string(s.rows) + " width " + std::to_string(s.width);
    const Floats src = normal(s.rows * s.src_stride, 3), dst0 = normal(s.rows * s.dst_stride, 4);
    for (bool add_into : {false, true}) {
      Floats want = dst0;
      cpu_->copy_rows(want.data(), s.dst_stride, src.data(), s.src_stride, s.rows, s.width, add_into);
      DeviceArray dd(dst0, 1), ds(src, 0);
      copy_rows(dd.data(), s.dst_stride, ds.data(), s.src_stride, s.rows, s.width, add_into, stream_);
      expect_bitwise(want, dd.get(), std::string(add_into ? "copy_rows add" : "copy_rows") + what);
    }
    const Floats y0 = normal(s.rows * s.width, 5), b = normal(s.width, 6);
    Floats want = y0;
    cpu_->add_bias(want.data(), b.data(), s.rows, s.width);
    DeviceArray dy(y0, 0), dbias(b, 1);
    add_bias(dy.data(), dbias.data(), s.rows, s.width, stream_);
    expect_bitwise(want, dy.get(), "add_bias" + what);
  }
  copy_rows(nullptr, 1, nullptr, 1, 0, 5, false, stream_);  // nothing to do: no launch
  add_bias(nullptr, nullptr, 3, 0, stream_);
}

TEST_F(CudaKernels, ActivationsMatchTheCpu) {
  const float inf = std::numeric_limits<float>::infinity();
  Floats x = {0.0f, -0.0f, 1e-45f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), 88.7f, -88.7f, 1e30f, -1e30f};
  for (int i = -30000; i <= 30000; ++i) x.push_back(static_cast<float>(i) * 1e-3f);
  const auto n = static_cast<int64_t>(x.size());
  const Floats dy = normal(n, 7, 3.0f), dx0 = normal(n, 8);
  const ActivationKind kinds[] = {ActivationKind::kRelu, ActivationKind::kLeakyRelu, ActivationKind::kSigmoid,
                                  ActivationKind::kTanh, ActivationKind::kGelu,      ActivationKind::kGeluTanh,
                                  ActivationKind::kSilu};
  for (ActivationKind kind : kinds) {
    const Activation act{kind, 0.2f};
    const bool exact = kind == ActivationKind::kRelu || kind == ActivationKind::kLeakyRelu;
    for (int64_t shift : kShifts) {
      const std::string what = std::string(activation_name(kind)) + at(n, shift);
      Floats y(n);
      cpu_->activation_forward(y.data(), x.data(), n, act);
      DeviceArray dx_in(x, shift), dy_out(Floats(n), shift);
      activation_forward(dy_out.data(), dx_in.data(), n, act, stream_);
      const Floats got_y = dy_out.get();
      exact ? expect_bitwise(y, got_y, "forward " + what) : expect_near(y, got_y, 1e-5, "forward " + what);
      for (bool with_y : {true, false}) {
        Floats want = dx0;
        cpu_->activation_backward(want.data(), dy.data(), x.data(), with_y ? y.data() : nullptr, n, act);
        DeviceArray ddx(dx0, shift), ddy(dy, shift), dyv(y, shift);
        activation_backward(ddx.data(), ddy.data(), dx_in.data(), with_y ? dyv.data() : nullptr, n, act, stream_);
        const std::string bwhat = "backward " + what + (with_y ? " with y" : " without y");
        exact ? expect_bitwise(want, ddx.get(), bwhat) : expect_near(want, ddx.get(), 1e-5, bwhat);
      }
    }
  }
}

TEST_F(CudaKernels, DropoutIsBitwiseTheCpus) {
  for (int64_t n : kSizes) {
    for (int64_t shift : kShifts) {
      for (float ratio : {0.0f, 0.1f, 0.5f, 1.0f}) {
        for (uint64_t offset : {uint64_t{0}, uint64_t{3}, ~uint64_t{0} - 7}) {
          const std::string what =
              at(n, shift) + " ratio " + std::to_string(ratio) + " offset " + std::to_string(offset);
          const Floats x = normal(n, 9);
          Floats y(n), mask(n);
          cpu_->dropout_forward(y.data(), mask.data(), x.data(), n, ratio, 1234, offset);
          DeviceArray dx(x, shift), dy(Floats(n), shift), dmask(Floats(n), shift);
          dropout_forward(dy.data(), dmask.data(), dx.data(), n, ratio, 1234, offset, stream_);
          expect_bitwise(mask, dmask.get(), "dropout mask" + what);
          expect_bitwise(y, dy.get(), "dropout y" + what);
          const Floats g = normal(n, 10), dx0 = normal(n, 11);
          Floats want = dx0;
          cpu_->dropout_backward(want.data(), g.data(), mask.data(), n);
          DeviceArray ddx(dx0, shift), dg(g, 0);
          dropout_backward(ddx.data(), dg.data(), dmask.data(), n, stream_);
          expect_bitwise(want, ddx.get(), "dropout backward" + what);
        }
      }
    }
  }
}

TEST_F(CudaKernels, BiasBackwardAddsColumnSums) {
  for (auto [rows, width] : {std::pair<int64_t, int64_t>{1, 1}, {64, 10}, {1000, 77}, {3, 5000}, {20000, 33}}) {
    const Floats dy = normal(rows * width, 12), db0 = normal(width, 13);
    Floats want = db0;
    cpu_->bias_backward(want.data(), dy.data(), rows, width);
    DeviceArray ddb(db0, 1), ddy(dy, 0);
    bias_backward(ddb.data(), ddy.data(), rows, width, stream_);
    const Floats got = ddb.get();
    // Both are float sums of the same terms in different orders: they differ by a few
    // roundings of the partial sums, far below 1e-6 of Σ|terms|; a lost or doubled row
    // would differ by a whole term.
    const std::string what = "bias_backward rows " + std::to_string(rows) + " width " + std::to_string(width);
    int bad = 0;
    for (int64_t j = 0; j < width; ++j) {
      double magnitude = std::fabs(db0[j]);
      for (int64_t r = 0; r < rows; ++r) magnitude += std::fabs(dy[r * width + j]);
      if (!(std::fabs(double{got[j]} - want[j]) <= 1e-6 * magnitude) && bad++ < 5) {
        ADD_FAILURE() << what << "[" << j << "]: cpu " << want[j] << ", cuda " << got[j];
      }
    }
    EXPECT_EQ(bad, 0) << what;
  }
}

TEST_F(CudaKernels, SumSquaresIsCloseToTheCpusAndDeterministic) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1027}, int64_t{10'000'019}}) {
    for (int64_t shift : kShifts) {
      const Floats x = normal(n, 14);
      const double want = cpu_->sum_squares(x.data(), n);
      DeviceArray d(x, shift);
      const double first = sum_squares(d.data(), n, scratch_, stream_);
      const double second = sum_squares(d.data(), n, scratch_, stream_);
      EXPECT_NEAR(first, want, 1e-12 * want) << at(n, shift);
      EXPECT_EQ(std::bit_cast<uint64_t>(first), std::bit_cast<uint64_t>(second)) << "not deterministic" << at(n, shift);
    }
  }
}

TEST_F(CudaKernels, AnyNonFiniteFindsInfAndNaNAnywhere) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t n : {int64_t{1}, int64_t{1027}, int64_t{1'000'003}}) {
    for (int64_t where : {int64_t{-1}, int64_t{0}, n - 1, n / 2}) {
      for (float bad : {inf, -inf, nan}) {
        Floats x = normal(n, 15);
        x[0] = 3e38f;  // finite
        if (where >= 0) x[where] = bad;
        DeviceArray d(x, 1);
        EXPECT_EQ(any_non_finite(d.data(), n, scratch_, stream_), cpu_->any_non_finite(x.data(), n))
            << "n " << n << " at " << where << " value " << bad;
      }
    }
  }
  EXPECT_FALSE(any_non_finite(nullptr, 0, scratch_, stream_));
}

TEST_F(CudaKernels, OptimizersAreBitwiseTheCpus) {
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t n : {int64_t{1}, int64_t{1027}, int64_t{100003}}) {
    for (int64_t shift : kShifts) {
      for (float bad : {0.0f, inf}) {
        const std::string what = at(n, shift) + (bad != 0.0f ? " with inf" : "");
        Floats p = normal(n, 16), buf(n, 0.0f), m(n, 0.0f), v(n, 0.0f);
        DeviceArray dp(p, shift), dbuf(buf, shift), dp2(p, shift), dm(m, shift), dv(v, shift);
        Floats p2 = p;
        for (int step = 1; step <= 3; ++step) {
          Floats g = normal(n, 17 + step, 0.5f);
          if (bad != 0.0f) g[n / 2] = bad;
          DeviceArray dg(g, shift);
          const SgdStep sgd{0.1f, 0.9f, 1e-2f, step == 2, step == 1};
          const bool want_sgd = cpu_->sgd_step(p.data(), g.data(), buf.data(), n, sgd);
          EXPECT_EQ(sgd_step(dp.data(), dg.data(), dbuf.data(), n, sgd, scratch_, stream_), want_sgd) << what;
          const AdamStep adam{1e-3f, 0.9f, 0.999f, 1e-8f, 1e-2f, step != 2, step};
          const bool want_adam = cpu_->adam_step(p2.data(), g.data(), m.data(), v.data(), n, adam);
          EXPECT_EQ(adam_step(dp2.data(), dg.data(), dm.data(), dv.data(), n, adam, scratch_, stream_), want_adam)
              << what;
        }
        expect_bitwise(p, dp.get(), "sgd param" + what);
        expect_bitwise(buf, dbuf.get(), "sgd momentum" + what);
        expect_bitwise(p2, dp2.get(), "adam param" + what);
        expect_bitwise(m, dm.get(), "adam exp_avg" + what);
        expect_bitwise(v, dv.get(), "adam exp_avg_sq" + what);
      }
    }
  }
  // SGD without momentum never touches its (absent) buffer.
  Floats p = normal(5, 20), g = normal(5, 21), want = p;
  cpu_->sgd_step(want.data(), g.data(), nullptr, 5, SgdStep{0.1f, 0.0f, 0.0f, false, true});
  DeviceArray dp(p, 0), dg(g, 0);
  EXPECT_TRUE(sgd_step(dp.data(), dg.data(), nullptr, 5, SgdStep{0.1f, 0.0f, 0.0f, false, true}, scratch_, stream_));
  expect_bitwise(want, dp.get(), "sgd without momentum");
  EXPECT_TRUE(adam_step(nullptr, nullptr, nullptr, nullptr, 0, AdamStep{}, scratch_, stream_));
}

// Indices past 2³¹: 64-bit grid-stride loops. 8.6 GB; skipped where it does not fit.
TEST_F(CudaKernels, IndicesBeyondTwoToThe31) {
  const int64_t n = (int64_t{1} << 31) + 9;
  float* x = nullptr;
  if (cudaMalloc(&x, sizeof(float) * static_cast<size_t>(n)) != cudaSuccess) {
    cudaGetLastError();
    GTEST_SKIP() << "no room for " << n << " floats";
  }
  fill(x, 2.0f, n, stream_);
  scale(x + 1, 1.5f, n - 1, stream_);  // misaligned: the scalar path's indices
  const float inf = std::numeric_limits<float>::infinity();
  ASSERT_CUDA(cudaMemcpyAsync(x + n - 1, &inf, sizeof(float), cudaMemcpyHostToDevice, stream_));
  EXPECT_TRUE(any_non_finite(x, n, scratch_, stream_));
  ASSERT_CUDA(cudaMemsetAsync(x + n - 1, 0, sizeof(float), stream_));
  EXPECT_FALSE(any_non_finite(x, n, scratch_, stream_));
  // 2² + (n − 2)·3² + 0², exact in double.
  EXPECT_EQ(sum_squares(x, n, scratch_, stream_), 4.0 + 9.0 * static_cast<double>(n - 2));
  Floats tail(3);
  ASSERT_CUDA(cudaMemcpy(tail.data(), x + n - 4, sizeof(float) * 3, cudaMemcpyDeviceToHost));
  EXPECT_EQ(tail, (Floats{3.0f, 3.0f, 3.0f}));
  cudaFree(x);
}

}  // namespace
}  // namespace pipeshard::cuda
