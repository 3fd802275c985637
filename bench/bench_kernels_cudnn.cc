// bench_kernels_cudnn: our softmax and BatchNorm kernels against cuDNN's on the same GPU,
// the same buffers and the same semantics, so that the faster one can be kept (issue 5:
// "use cuDNN where it is the better tool, measured against our own kernels").
//
// Each case runs forward and backward both ways:
//   ours   Backend::softmax_forward/backward and batchnorm_forward/backward (training,
//          batch statistics) of make_cuda_backend, fp32;
//   cuDNN  cudnnSoftmaxForward/Backward (CUDNN_SOFTMAX_ACCURATE or _LOG, per instance) and
//          cudnnBatchNormalizationForwardTraining/Backward (CUDNN_BATCHNORM_SPATIAL and
//          _SPATIAL_PERSISTENT), fp32, NCHW with H = inner, W = 1; backward adds into dx
//          (and dw, db) with beta = 1, as ours does.
// First the results are compared (forward y, and for BatchNorm the saved mean and rstd and
// the running statistics after one update; backward dx, and dw, db), each output's
// max |ours − cuDNN| / max |cuDNN| ≤ 1e-4, so that a time is never compared with one of a
// different computation. Both run on the backend's stream. Then each is timed: a loop of calls
// long enough for ~2 ms between two cudaDeviceSynchronize() on the host clock (so launch
// costs count, as they do in training), 7 samples, the median per call.
//
// Usage: bench_kernels_cudnn [--device D] [--quick]   (--quick: the small cases only)
// Prints one JSON document on stdout. Exit status 0; 1 when a result disagrees; 2 without a
// usable GPU or cuDNN (the JSON then says why).
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"

namespace pipeshard {
namespace {

using Json = nlohmann::ordered_json;
constexpr double kAgreement = 1e-4;

[[noreturn]] void fail(const std::string& what) {
  Json out = {{"bench", "bench_kernels_cudnn"}, {"error", what}};
  std::printf("%s\n", out.dump(2).c_str());
  std::exit(2);
}

void cuda_ok(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorString(rc));
}

void cudnn_ok(cudnnStatus_t rc, const char* what) {
  if (rc != CUDNN_STATUS_SUCCESS) fail(std::string(what) + ": " + cudnnGetErrorString(rc));
}

std::vector<float> random_normal(size_t count, uint64_t seed) {
  std::vector<float> v(count);
  uint64_t s = seed;
  auto uniform = [&] {
    uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return (static_cast<double>(z >> 11) + 0.5) / static_cast<double>(1ULL << 53);
  };
  for (float& f : v)
    f = static_cast<float>(std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform()));
  return v;
}

// Milliseconds per call of `call`, as the header says.
double time_ms(const std::function<void()>& call) {
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  call();
  cuda_ok(cudaDeviceSynchronize(), "warm-up");
  Clock::time_point t0 = Clock::now();
  call();
  cuda_ok(cudaDeviceSynchronize(), "calibration");
  const int iterations = static_cast<int>(std::clamp(2e-3 / std::max(seconds(t0), 1e-7), 1.0, 2000.0));
  std::vector<double> samples;
  for (int s = 0; s < 7; ++s) {
    t0 = Clock::now();
    for (int i = 0; i < iterations; ++i) call();
    cuda_ok(cudaDeviceSynchronize(), "timed calls");
    samples.push_back(seconds(t0) / iterations);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2] * 1e3;
}

// max |a − b| / max |b| over n elements of two device buffers (softmax outputs at width
// 8192 are ~1e-4: no absolute floor).
double difference(Backend& be, const float* a, const float* b, int64_t n) {
  std::vector<float> ha(static_cast<size_t>(n)), hb(static_cast<size_t>(n));
  be.download(ha.data(), a, n);
  be.download(hb.data(), b, n);
  double worst = 0, scale = 1e-30;
  for (int64_t i = 0; i < n; ++i) scale = std::max(scale, static_cast<double>(std::fabs(hb[i])));
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::fabs(static_cast<double>(ha[i]) - hb[i]);
    worst = std::max(worst, std::isnan(d) ? INFINITY : d);
  }
  return worst / scale;
}

struct Tensor4d {
  cudnnTensorDescriptor_t desc = nullptr;
  Tensor4d(int64_t n, int64_t c, int64_t h) {
    if (n > INT32_MAX || c > INT32_MAX || h > INT32_MAX) fail("a cuDNN tensor dimension exceeds int");
    cudnn_ok(cudnnCreateTensorDescriptor(&desc), "cudnnCreateTensorDescriptor");
    cudnn_ok(cudnnSetTensor4dDescriptor(desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, static_cast<int>(n),
                                        static_cast<int>(c), static_cast<int>(h), 1),
             "cudnnSetTensor4dDescriptor");
  }
  ~Tensor4d() { cudnnDestroyTensorDescriptor(desc); }
  Tensor4d(const Tensor4d&) = delete;
  Tensor4d& operator=(const Tensor4d&) = delete;
};

// Fills a result row: times, the faster, and whether the results agree.
Json row(const std::string& op, const std::string& shape, const std::string& variant, double ours_ms, double cudnn_ms,
         double diff) {
  return {{"op", op},
          {"shape", shape},
          {"cudnn_variant", variant},
          {"ours_ms", ours_ms},
          {"cudnn_ms", cudnn_ms},
          {"ours_over_cudnn", ours_ms / cudnn_ms},
          {"faster", ours_ms <= cudnn_ms ? "ours" : "cudnn"},
          {"max_difference", diff},
          {"agree", diff <= kAgreement}};
}

void softmax_case(Backend& be, cudnnHandle_t h, bool log, int64_t rows, int64_t width, Json& out) {
  const int64_t n = rows * width;
  DeviceBuffer x(be, n), dy(be, n), y1(be, n), y2(be, n), dx1(be, n), dx2(be, n);
  const std::vector<float> hx = random_normal(static_cast<size_t>(n), 1),
                           hdy = random_normal(static_cast<size_t>(n), 2);
  be.upload(x.data(), hx.data(), n);
  be.upload(dy.data(), hdy.data(), n);
  Tensor4d t(rows, width, 1);
  const float one = 1.0f, zero = 0.0f;
  const cudnnSoftmaxAlgorithm_t algo = log ? CUDNN_SOFTMAX_LOG : CUDNN_SOFTMAX_ACCURATE;
  auto ours_fwd = [&] { be.softmax_forward(y1.data(), x.data(), rows, width, log); };
  auto cudnn_fwd = [&] {
    cudnn_ok(
        cudnnSoftmaxForward(h, algo, CUDNN_SOFTMAX_MODE_INSTANCE, &one, t.desc, x.data(), &zero, t.desc, y2.data()),
        "cudnnSoftmaxForward");
  };
  auto ours_bwd = [&] { be.softmax_backward(dx1.data(), dy.data(), y1.data(), rows, width, log); };
  auto cudnn_bwd = [&] {
    cudnn_ok(cudnnSoftmaxBackward(h, algo, CUDNN_SOFTMAX_MODE_INSTANCE, &one, t.desc, y2.data(), t.desc, dy.data(),
                                  &one, t.desc, dx2.data()),
             "cudnnSoftmaxBackward");
  };
  ours_fwd();
  cudnn_fwd();
  ours_bwd();
  cudnn_bwd();
  cuda_ok(cudaDeviceSynchronize(), "softmax");
  const double fwd_diff = difference(be, y1.data(), y2.data(), n), bwd_diff = difference(be, dx1.data(), dx2.data(), n);
  const std::string op = log ? "log_softmax" : "softmax", shape = std::to_string(rows) + "x" + std::to_string(width);
  const std::string variant = log ? "CUDNN_SOFTMAX_LOG" : "CUDNN_SOFTMAX_ACCURATE";
  out.push_back(row(op + " forward", shape, variant, time_ms(ours_fwd), time_ms(cudnn_fwd), fwd_diff));
  out.push_back(row(op + " backward", shape, variant, time_ms(ours_bwd), time_ms(cudnn_bwd), bwd_diff));
}

void batchnorm_case(Backend& be, cudnnHandle_t h, int64_t batch, int64_t channels, int64_t inner, Json& out) {
  const int64_t n = batch * channels * inner;
  const float eps = 1e-5f, momentum = 0.9f;  // ONNX momentum: running = 0.9·running + 0.1·batch
  DeviceBuffer x(be, n), dy(be, n), y1(be, n), y2(be, n), dx1(be, n), dx2(be, n);
  DeviceBuffer w(be, channels), b(be, channels), rm1(be, channels), rv1(be, channels), rm2(be, channels),
      rv2(be, channels), mean1(be, channels), rstd1(be, channels), mean2(be, channels), rstd2(be, channels),
      dw1(be, channels), db1(be, channels), dw2(be, channels), db2(be, channels);
  const std::vector<float> hx = random_normal(static_cast<size_t>(n), 3),
                           hdy = random_normal(static_cast<size_t>(n), 4);
  const std::vector<float> hw = random_normal(static_cast<size_t>(channels), 5),
                           hb = random_normal(static_cast<size_t>(channels), 6);
  be.upload(x.data(), hx.data(), n);
  be.upload(dy.data(), hdy.data(), n);
  be.upload(w.data(), hw.data(), channels);
  be.upload(b.data(), hb.data(), channels);
  for (float* v : {rv1.data(), rv2.data()}) be.fill(v, 1.0f, channels);
  Tensor4d t(batch, channels, inner), per_channel(1, channels, 1);
  const float one = 1.0f, zero = 0.0f;
  const std::string shape = std::to_string(batch) + "x" + std::to_string(channels) + "x" + std::to_string(inner);
  auto ours_fwd = [&] {
    be.batchnorm_forward(y1.data(), mean1.data(), rstd1.data(), rm1.data(), rv1.data(), x.data(), w.data(), b.data(),
                         batch, channels, inner, eps, momentum, true);
  };
  auto ours_bwd = [&] {
    be.batchnorm_backward(dx1.data(), dw1.data(), db1.data(), dy.data(), x.data(), w.data(), mean1.data(), rstd1.data(),
                          batch, channels, inner, true);
  };
  ours_fwd();
  ours_bwd();
  const double ours_fwd_ms = time_ms(ours_fwd), ours_bwd_ms = time_ms(ours_bwd);
  for (cudnnBatchNormMode_t mode : {CUDNN_BATCHNORM_SPATIAL, CUDNN_BATCHNORM_SPATIAL_PERSISTENT}) {
    const std::string variant =
        mode == CUDNN_BATCHNORM_SPATIAL ? "CUDNN_BATCHNORM_SPATIAL" : "CUDNN_BATCHNORM_SPATIAL_PERSISTENT";
    for (float* v : {dx1.data(), dw1.data(), db1.data(), dx2.data(), dw2.data(), db2.data(), rm1.data(), rm2.data()}) {
      be.fill(v, 0.0f, v == dx1.data() || v == dx2.data() ? n : channels);
    }
    for (float* v : {rv1.data(), rv2.data()}) be.fill(v, 1.0f, channels);  // one update from (0, 1) each
    auto cudnn_fwd = [&] {
      cudnn_ok(cudnnBatchNormalizationForwardTraining(h, mode, &one, &zero, t.desc, x.data(), t.desc, y2.data(),
                                                      per_channel.desc, w.data(), b.data(), 1.0 - momentum, rm2.data(),
                                                      rv2.data(), eps, mean2.data(), rstd2.data()),
               "cudnnBatchNormalizationForwardTraining");
    };
    auto cudnn_bwd = [&] {
      cudnn_ok(cudnnBatchNormalizationBackward(h, mode, &one, &one, &one, &one, t.desc, x.data(), t.desc, dy.data(),
                                               t.desc, dx2.data(), per_channel.desc, w.data(), dw2.data(), db2.data(),
                                               eps, mean2.data(), rstd2.data()),
               "cudnnBatchNormalizationBackward");
    };
    cuda_ok(cudaDeviceSynchronize(), "batchnorm");
    ours_fwd();
    ours_bwd();
    cudnn_fwd();
    cudnn_bwd();
    cuda_ok(cudaDeviceSynchronize(), "batchnorm");
    const double fwd_diff =
        std::max({difference(be, y1.data(), y2.data(), n), difference(be, mean1.data(), mean2.data(), channels),
                  difference(be, rstd1.data(), rstd2.data(), channels),
                  difference(be, rm1.data(), rm2.data(), channels), difference(be, rv1.data(), rv2.data(), channels)});
    const double bwd_diff =
        std::max({difference(be, dx1.data(), dx2.data(), n), difference(be, dw1.data(), dw2.data(), channels),
                  difference(be, db1.data(), db2.data(), channels)});
    out.push_back(row("batchnorm forward (training)", shape, variant, ours_fwd_ms, time_ms(cudnn_fwd), fwd_diff));
    out.push_back(row("batchnorm backward", shape, variant, ours_bwd_ms, time_ms(cudnn_bwd), bwd_diff));
  }
}

int run(int argc, char** argv) {
  int device = 0;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--device" && i + 1 < argc) {
      device = std::atoi(argv[++i]);
    } else if (a == "--quick") {
      quick = true;
    } else {
      std::fprintf(stderr,
                   "bench_kernels_cudnn: unknown argument '%s'\nusage: bench_kernels_cudnn [--device D] [--quick]\n",
                   a.c_str());
      return 2;
    }
  }
  std::string why;
  if (cuda_usable_gpus(&why) <= device) fail("no usable GPU " + std::to_string(device) + ": " + why);
  Result<std::unique_ptr<Backend>> made = make_cuda_backend(device, Precision::kFp32);
  if (!made) fail(made.status().message());
  Backend& be = **made;
  cudnnHandle_t h = nullptr;
  cudnn_ok(cudnnCreate(&h), "cudnnCreate");
  cudnn_ok(cudnnSetStream(h, cuda_backend_stream(be)), "cudnnSetStream");  // one stream: calls stay ordered
  Json out = {{"bench", "bench_kernels_cudnn"},
              {"cudnn_version", cudnnGetVersion()},
              {"timing", "median of 7 samples of a ~2 ms loop of calls between cudaDeviceSynchronize(), per call"},
              {"agreement", "max |ours - cuDNN| / max |cuDNN| for each output, must be <= 1e-4"},
              {"results", Json::array()}};
  Json& results = out["results"];
  // The GPU benchmark's shapes: the small MLP's logits (128 x 10), an ImageNet-sized
  // classifier's, the large MLP's (8192 x 8192); BatchNorm1d after an MLP layer, and a
  // BatchNorm2d-shaped [batch, channels, H·W].
  for (bool log : {false, true}) {
    softmax_case(be, h, log, 128, 10, results);
    if (!quick) softmax_case(be, h, log, 4096, 1000, results);
    if (!quick) softmax_case(be, h, log, 8192, 8192, results);
  }
  batchnorm_case(be, h, 128, 512, 1, results);
  if (!quick) batchnorm_case(be, h, 8192, 8192, 1, results);
  if (!quick) batchnorm_case(be, h, 256, 64, 196, results);
  cudnnDestroy(h);
  bool agree = true;
  for (const Json& r : results) agree = agree && r["agree"].get<bool>();
  out["all_agree"] = agree;
  std::printf("%s\n", out.dump(2).c_str());
  return agree ? 0 : 1;
}

}  // namespace
}  // namespace pipeshard

int main(int argc, char** argv) { return pipeshard::run(argc, argv); }
