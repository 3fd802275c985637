// The softmax, loss, LayerNorm and BatchNorm launchers (backend/cuda/launchers.h) on a
// GPU against the CPU backend on the same inputs: shapes that take each launch path
// (warp rows up to 1024 wide, block rows above; BatchNorm's channel tiles for inner == 1
// and block-wide channels above; loss grids that loop), += into gradients, rows == 0,
// synchronized BatchNorm through a reducer of device doubles, and results that repeat
// bit for bit. Calls the launchers directly, so it needs only their .cu files and
// reduce_scratch_bytes(). Skips, saying so, where no GPU is usable.
//
// Tolerances: the GPU adds rows as trees where the CPU adds them in order, so values
// agree to float rounding: kForwardRtol (backend_check.h) for values made from one row or
// channel, kSumRtol for gradients summed over hundreds of rows (dw, db).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/launchers.h"
#include "tests/backend/backend_check.h"
#include "tests/cuda/gpu_test_util.h"

namespace pipeshard {
namespace {

using namespace pipeshard::testing;  // NOLINT: the checks and fixture of backend_check.h

constexpr double kSumRtol = 1e-4;

#define EXPECT_CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// A device copy of a host vector; download() waits for the stream.
class DeviceFloats {
 public:
  DeviceFloats(const Floats& host, cudaStream_t stream) : n_(host.size()), stream_(stream) {
    EXPECT_EQ(cudaMalloc(&p_, std::max<size_t>(n_, 1) * sizeof(float)), cudaSuccess);
    if (n_ > 0) {
      EXPECT_EQ(cudaMemcpy(p_, host.data(), n_ * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~DeviceFloats() { cudaFree(p_); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
  float* get() const { return p_; }
  Floats download() const {
    Floats host(n_);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    if (n_ > 0) {
      EXPECT_EQ(cudaMemcpy(host.data(), p_, n_ * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return host;
  }

 private:
  float* p_ = nullptr;
  size_t n_;
  cudaStream_t stream_;
};

class NormKernelsTest : public BackendTest {
 protected:
  void SetUp() override {
    if (const std::string why = testing::no_usable_gpu(); !why.empty()) {
      GTEST_SKIP() << why << "; the kernel checks run on a machine with one";
    }
    // Blocking: DeviceFloats uploads with cudaMemcpy on the legacy stream, which a pageable
    // upload may leave unfinished when it returns; a blocking stream waits for it.
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&scratch_, cuda::reduce_scratch_bytes()), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      cudaFree(scratch_);
      cudaStreamDestroy(stream_);
    }
  }
  std::unique_ptr<DeviceFloats> dev(const Floats& host) { return std::make_unique<DeviceFloats>(host, stream_); }

  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
};

void expect_near_cpu(const Floats& gpu, const Floats& cpu, const std::string& what, double rtol = kForwardRtol) {
  expect_values_near(gpu, to_double(cpu), what, rtol);
}

std::string shape_name(int64_t rows, int64_t width) {
  return " rows=" + std::to_string(rows) + " width=" + std::to_string(width);
}

// ---- softmax ----

TEST_F(NormKernelsTest, SoftmaxMatchesTheCpuBackend) {
  for (bool log : {false, true}) {
    for (int64_t rows : {1, 3, 300}) {
      for (int64_t width : {1, 5, 33, 1024, 1025, 4099}) {
        const std::string what = std::string(log ? "log-softmax" : "softmax") + shape_name(rows, width);
        const int64_t n = rows * width;
        const Floats x = random(n, -8.0f, 8.0f), dy = random(n), dx0 = random(n);
        Floats y_cpu(n), dx_cpu = dx0;
        be_->softmax_forward(y_cpu.data(), x.data(), rows, width, log);
        be_->softmax_backward(dx_cpu.data(), dy.data(), y_cpu.data(), rows, width, log);
        auto gx = dev(x), gy = dev(Floats(n)), gdy = dev(dy), gdx = dev(dx0);
        cuda::softmax_forward(gy->get(), gx->get(), rows, width, log, stream_);
        cuda::softmax_backward(gdx->get(), gdy->get(), gy->get(), rows, width, log, stream_);
        expect_near_cpu(gy->download(), y_cpu, what + " y");
        expect_near_cpu(gdx->download(), dx_cpu, what + " dx (added)");
      }
    }
  }
  cuda::softmax_forward(nullptr, nullptr, 0, 7, true, stream_);  // rows == 0: nothing to launch
  cuda::softmax_backward(nullptr, nullptr, nullptr, 0, 7, true, stream_);
  EXPECT_CUDA_OK(cudaStreamSynchronize(stream_));
}

// ---- losses ----

TEST_F(NormKernelsTest, CrossEntropyMatchesTheCpuBackendAndRepeats) {
  for (bool log_probs : {false, true}) {
    for (int64_t rows : {1, 7, 20000}) {  // 20000 rows of 10: more rows than the grid's row groups
      for (int64_t classes : {1, 10, 1025}) {
        if (rows * classes > 4'000'000) continue;
        const std::string what = std::string(log_probs ? "nll" : "cross-entropy") + shape_name(rows, classes);
        const int64_t n = rows * classes;
        Floats logits = random(n, -20.0f, 20.0f);
        if (log_probs) {  // log-probabilities, as a LogSoftmax would give
          const Floats raw = logits;
          be_->softmax_forward(logits.data(), raw.data(), rows, classes, true);
        }
        Floats labels(rows);
        std::uniform_int_distribution<int64_t> pick(0, classes - 1);
        for (float& l : labels) l = static_cast<float>(pick(rng_));
        const double den = 2.0 * rows + 1.0;
        Floats d_cpu(n);
        const double want =
            be_->cross_entropy(d_cpu.data(), logits.data(), labels.data(), rows, classes, den, log_probs);
        auto gl = dev(logits), glab = dev(labels), gd = dev(random(n));
        const double got =
            cuda::cross_entropy(gd->get(), gl->get(), glab->get(), rows, classes, den, log_probs, scratch_, stream_);
        EXPECT_NEAR(got, want, 1e-6 * (1.0 + std::fabs(want))) << what;
        expect_near_cpu(gd->download(), d_cpu, what + " dlogits (written)");
        EXPECT_EQ(
            cuda::cross_entropy(nullptr, gl->get(), glab->get(), rows, classes, den, log_probs, scratch_, stream_), got)
            << what << ": without dlogits, and bit for bit again";
      }
    }
  }
  EXPECT_EQ(cuda::cross_entropy(nullptr, nullptr, nullptr, 0, 3, 1.0, false, scratch_, stream_), 0.0);
}

TEST_F(NormKernelsTest, CrossEntropyRefusesALabelOutsideTheClasses) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (float bad : {3.0f, -1.0f, 1.5f}) {
    auto run = [&] {
      auto gl = dev(random(6));
      auto gd = dev(Floats(6));
      auto glab = dev({0.0f, bad});
      cuda::cross_entropy(gd->get(), gl->get(), glab->get(), 2, 3, 2.0, false, scratch_, stream_);
    };
    EXPECT_DEATH(run(), "row 1: label") << bad;
  }
}

TEST_F(NormKernelsTest, MeanSquaredErrorMatchesTheCpuBackendAndRepeats) {
  for (int64_t n : {1, 5, 1000, 1 << 20}) {  // 2²⁰: each thread of the 1024-block grid takes 4
    const Floats pred = random(n, -3.0f, 3.0f), target = random(n, -3.0f, 3.0f);
    const double den = n + 3.0;
    Floats d_cpu(n);
    const double want = be_->mean_squared_error(d_cpu.data(), pred.data(), target.data(), n, den);
    auto gp = dev(pred), gt = dev(target), gd = dev(Floats(n));
    const double got = cuda::mean_squared_error(gd->get(), gp->get(), gt->get(), n, den, scratch_, stream_);
    EXPECT_NEAR(got, want, 1e-12 * want) << n;
    EXPECT_EQ(gd->download(), d_cpu) << "one float product per element, as on the CPU; n=" << n;
    EXPECT_EQ(cuda::mean_squared_error(nullptr, gp->get(), gt->get(), n, den, scratch_, stream_), got) << n;
  }
  EXPECT_EQ(cuda::mean_squared_error(nullptr, nullptr, nullptr, 0, 1.0, scratch_, stream_), 0.0);
}

// ---- LayerNorm ----

TEST_F(NormKernelsTest, LayerNormMatchesTheCpuBackendAndRepeats) {
  const float eps = 1e-5f;
  for (int affine = 0; affine < 4; ++affine) {  // bit 0: w, bit 1: b
    for (int64_t rows : {1, 3, 300}) {
      for (int64_t width : {1, 33, 1024, 1025, 3000}) {
        const std::string what =
            "layernorm w=" + std::to_string(affine & 1) + " b=" + std::to_string(affine >> 1) + shape_name(rows, width);
        const int64_t n = rows * width;
        const Floats x = random(n, -2.0f, 3.0f), w = random(width, 0.5f, 1.5f), b = random(width), dy = random(n);
        const Floats dx0 = random(n), dw0 = random(width), db0 = random(width);
        const float* pw = (affine & 1) ? w.data() : nullptr;
        const float* pb = (affine & 2) ? b.data() : nullptr;
        Floats y_cpu(n), mean_cpu(rows), rstd_cpu(rows), dx_cpu = dx0, dw_cpu = dw0, db_cpu = db0;
        be_->layernorm_forward(y_cpu.data(), mean_cpu.data(), rstd_cpu.data(), x.data(), pw, pb, rows, width, eps);
        be_->layernorm_backward(dx_cpu.data(), dw_cpu.data(), db_cpu.data(), dy.data(), x.data(), pw, mean_cpu.data(),
                                rstd_cpu.data(), rows, width);

        auto gx = dev(x), gw = dev(w), gb = dev(b), gy = dev(Floats(n)), gmean = dev(Floats(rows)),
             grstd = dev(Floats(rows)), gdy = dev(dy), gdx = dev(dx0), gdw = dev(dw0), gdb = dev(db0);
        const float* gpw = (affine & 1) ? gw->get() : nullptr;
        cuda::layernorm_forward(gy->get(), gmean->get(), grstd->get(), gx->get(), gpw,
                                (affine & 2) ? gb->get() : nullptr, rows, width, eps, stream_);
        expect_near_cpu(gy->download(), y_cpu, what + " y");
        expect_near_cpu(gmean->download(), mean_cpu, what + " mean");
        expect_near_cpu(grstd->download(), rstd_cpu, what + " rstd");
        // Backward from the CPU's statistics, so that only backward is compared.
        auto cmean = dev(mean_cpu), crstd = dev(rstd_cpu);
        cuda::layernorm_backward(gdx->get(), gdw->get(), gdb->get(), gdy->get(), gx->get(), gpw, cmean->get(),
                                 crstd->get(), rows, width, stream_);
        const Floats dw1 = gdw->download(), db1 = gdb->download();
        expect_near_cpu(gdx->download(), dx_cpu, what + " dx");
        expect_near_cpu(dw1, dw_cpu, what + " dw", kSumRtol);
        expect_near_cpu(db1, db_cpu, what + " db", kSumRtol);
        auto rdw = dev(dw0), rdb = dev(db0);
        cuda::layernorm_backward(nullptr, rdw->get(), rdb->get(), gdy->get(), gx->get(), gpw, cmean->get(),
                                 crstd->get(), rows, width, stream_);
        EXPECT_EQ(rdw->download(), dw1) << what << ": dw again, bit for bit";
        EXPECT_EQ(rdb->download(), db1) << what << ": db again, bit for bit";
      }
    }
  }
}

// ---- BatchNorm ----

struct BnDims {  // x [batch, channels, inner]
  int64_t batch, channels, inner;
  int64_t size() const { return batch * channels * inner; }
};

class BatchNormKernelsTest : public NormKernelsTest {
 protected:
  // `replicas` > 1: synchronized BatchNorm over that many processes holding the same batch
  // (the reducer multiplies every sum, the count included); 1: no reducer.
  void check(const BnDims& d, bool training, int replicas, bool affine) {
    const std::string what = std::string(training ? "training" : "inference") + " [" + std::to_string(d.batch) + ", " +
                             std::to_string(d.channels) + ", " + std::to_string(d.inner) + "] replicas " +
                             std::to_string(replicas) + (affine ? " affine" : " plain");
    const float eps = 1e-5f, momentum = 0.9f;
    const int64_t n = d.size(), c = d.channels;
    const Floats x = random(n, -2.0f, 3.0f), w = random(c, 0.5f, 1.5f), b = random(c), dy = random(n);
    const Floats rm = random(c), rv = random(c, 0.5f, 2.0f), dx0 = random(n), dw0 = random(c), db0 = random(c);
    const float* pw = affine ? w.data() : nullptr;
    const float* pb = affine ? b.data() : nullptr;
    const ChannelReducer host_reducer = [replicas](double* data, int64_t count) {
      for (int64_t i = 0; i < count; ++i) data[i] *= replicas;
    };
    int device_calls = 0;
    const ChannelReducer device_reducer = [&](double* data, int64_t count) {  // device doubles
      ++device_calls;
      std::vector<double> host(count);
      ASSERT_EQ(cudaMemcpy(host.data(), data, count * sizeof(double), cudaMemcpyDeviceToHost), cudaSuccess);
      for (double& v : host) v *= replicas;
      ASSERT_EQ(cudaMemcpy(data, host.data(), count * sizeof(double), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // a pageable upload may return before its DMA ends
    };
    const bool sync = replicas > 1;
    cuda::ReducerScratch scratch;  // what a backend owns: grown on first use, kept across calls

    Floats y_cpu(n), mean_cpu(c), rstd_cpu(c), rm_cpu = rm, rv_cpu = rv, dx_cpu = dx0, dw_cpu = dw0, db_cpu = db0;
    be_->batchnorm_forward(y_cpu.data(), mean_cpu.data(), rstd_cpu.data(), rm_cpu.data(), rv_cpu.data(), x.data(), pw,
                           pb, d.batch, d.channels, d.inner, eps, momentum, training, sync ? &host_reducer : nullptr);
    be_->batchnorm_backward(dx_cpu.data(), dw_cpu.data(), db_cpu.data(), dy.data(), x.data(), pw, mean_cpu.data(),
                            rstd_cpu.data(), d.batch, d.channels, d.inner, training, sync ? &host_reducer : nullptr);

    auto gx = dev(x), gw = dev(w), gb = dev(b), gy = dev(Floats(n)), gmean = dev(Floats(c)), grstd = dev(Floats(c)),
         grm = dev(rm), grv = dev(rv), gdy = dev(dy), gdx = dev(dx0), gdw = dev(dw0), gdb = dev(db0);
    const float* gpw = affine ? gw->get() : nullptr;
    cuda::batchnorm_forward(gy->get(), gmean->get(), grstd->get(), grm->get(), grv->get(), gx->get(), gpw,
                            affine ? gb->get() : nullptr, d.batch, d.channels, d.inner, eps, momentum, training,
                            sync ? &device_reducer : nullptr, &scratch, stream_);
    expect_near_cpu(gy->download(), y_cpu, what + " y");
    expect_near_cpu(gmean->download(), mean_cpu, what + " mean");
    expect_near_cpu(grstd->download(), rstd_cpu, what + " rstd");
    expect_near_cpu(grm->download(), rm_cpu, what + " running mean");
    expect_near_cpu(grv->download(), rv_cpu, what + " running var");
    EXPECT_EQ(device_calls, sync && training ? 2 : 0) << what << ": forward reductions";
    // Backward from the CPU's statistics, so that only backward is compared.
    auto cmean = dev(mean_cpu), crstd = dev(rstd_cpu);
    device_calls = 0;
    cuda::batchnorm_backward(gdx->get(), gdw->get(), gdb->get(), gdy->get(), gx->get(), gpw, cmean->get(), crstd->get(),
                             d.batch, d.channels, d.inner, training, sync ? &device_reducer : nullptr, &scratch,
                             stream_);
    EXPECT_EQ(device_calls, sync && training ? 1 : 0) << what << ": backward reductions";
    const Floats dx1 = gdx->download(), dw1 = gdw->download(), db1 = gdb->download();
    expect_near_cpu(dx1, dx_cpu, what + " dx");
    expect_near_cpu(dw1, dw_cpu, what + " dw", kSumRtol);
    expect_near_cpu(db1, db_cpu, what + " db", kSumRtol);
    auto rdx = dev(dx0), rdw = dev(dw0), rdb = dev(db0);
    cuda::batchnorm_backward(rdx->get(), rdw->get(), rdb->get(), gdy->get(), gx->get(), gpw, cmean->get(), crstd->get(),
                             d.batch, d.channels, d.inner, training, sync ? &device_reducer : nullptr, &scratch,
                             stream_);
    EXPECT_EQ(rdx->download(), dx1) << what << ": dx again, bit for bit";
    EXPECT_EQ(rdw->download(), dw1) << what << ": dw again, bit for bit";
  }
};

const BnDims kBnShapes[] = {{2, 1, 1}, {7, 70, 1}, {1000, 3, 1}, {1, 5, 4}, {3, 33, 5}, {16, 4, 300}, {2, 3, 257}};

TEST_F(BatchNormKernelsTest, TrainingMatchesTheCpuBackend) {
  for (const BnDims& d : kBnShapes) {
    for (bool affine : {true, false}) check(d, true, 1, affine);
  }
}

TEST_F(BatchNormKernelsTest, SynchronizedTrainingMatchesTheCpuBackend) {
  for (const BnDims& d : kBnShapes) check(d, true, 2, true);
  check(BnDims{1, 3, 1}, true, 2, true);  // one value here, two over the processes
}

TEST_F(BatchNormKernelsTest, InferenceMatchesTheCpuBackend) {
  check(BnDims{1, 1, 1}, false, 1, true);
  for (const BnDims& d : kBnShapes) {
    for (bool affine : {true, false}) check(d, false, 1, affine);
  }
  check(BnDims{7, 70, 1}, false, 2, true);  // inference ignores the reducer
}

}  // namespace
}  // namespace pipeshard
