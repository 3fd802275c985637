// bench_gemm_cuda: the GEMM rate of the CUDA backend's Linear forward, the ceiling that
// bench/gpu_vs_pytorch.py compares training with and races against torch.matmul.
//
// Times Backend::linear_forward (make_cuda_backend, backend/cuda/cuda_backend.h) on
//   y[M, N] = x[M, K] · Wᵀ + b       (W stored [N, K], PyTorch's layout; b [N])
// once per precision asked for. Each timing covers kCallsPerTiming calls back to back on the
// host clock between two cudaDeviceSynchronize() calls (the backend's stream is private, so
// no events on it), divided by their number: the synchronisation's ~10–20 µs, ~1% of one
// 8192³ bf16 call, is spread over them, as torch.cuda.Event timing has none. Figures:
//   GFLOP/s = 2·M·N·K / median seconds per call / 1e9      (the bias add is not counted)
// and a correctness column: y is poisoned with NaN first, every element must be written
// (Backend::any_non_finite over all of y), and 64 sampled outputs are compared with a
// double-precision dot product of the unrounded inputs: |y − ref| / (Σ_k |x·w| + |b|) must
// stay under 1e-5 (fp32), 2e-3 (tf32, fp16) or 1e-2 (bf16), so that a broken kernel cannot
// post a fast time. For the reduced precisions these are bounds, not guesses: rounding both
// factors of a term moves it by at most (2u + u²)·|x·w|, u = 2^-11 (tf32, fp16: 9.8e-4) or
// 2^-8 (bf16: 7.8e-3), and the fp32 sums of K = 8192 terms add at most ~5e-4 more. Inputs
// are uniform in [−1, 1), never zeros. A precision the backend refuses is reported as not
// run with the backend's reason.
//
// bf16 and fp16 go through the backend's 16-bit path (linear.cu): each call rounds x and W
// to 16-bit copies (two memory-bound conversion kernels, timed with the GEMM: they are
// part of what our Linear costs) and multiplies those with fp32 accumulation into fp32 y.
//
// Usage: bench_gemm_cuda [M N K] [--repeats R] [--precisions fp32,tf32,bf16,fp16] [--device D]
//        (defaults 8192 8192 8192, 20 repeats after 3 warm-up calls, fp32,tf32,bf16, GPU 0)
// Prints one JSON document on stdout. Exit status 0; 1 when a result is wrong; 2 on bad
// arguments or without a usable GPU (the JSON then says why).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"

namespace pipeshard {
namespace {

using Json = nlohmann::ordered_json;

constexpr int kCallsPerTiming = 5;  // calls between the two synchronisations of one timing

struct Options {
  int64_t m = 8192, n = 8192, k = 8192;
  int repeats = 20;
  int device = 0;
  std::vector<std::string> precisions = {"fp32", "tf32", "bf16"};
};

// Fails (exit 2, JSON on stdout) when a CUDA call of this file does not succeed.
void cuda_ok(cudaError_t rc, const char* what) {
  if (rc == cudaSuccess) return;
  Json out = {{"bench", "bench_gemm_cuda"}, {"error", std::string(what) + ": " + cudaGetErrorString(rc)}};
  std::printf("%s\n", out.dump(2).c_str());
  std::exit(2);
}

bool parse_precision(const std::string& name, Precision* p) {
  for (Precision q : {Precision::kFp32, Precision::kTf32, Precision::kBf16, Precision::kFp16}) {
    if (name == precision_name(q)) {
      *p = q;
      return true;
    }
  }
  return false;
}

double tolerance(Precision p) {
  switch (p) {
    case Precision::kFp32: return 1e-5;
    case Precision::kTf32:
    case Precision::kFp16: return 2e-3;
    case Precision::kBf16: return 1e-2;
  }
  return 0.0;
}

// Uniform in [-1, 1) from splitmix64: fast enough for 2·8192² values.
std::vector<float> random_uniform(size_t count, uint64_t seed) {
  std::vector<float> v(count);
  uint64_t s = seed;
  for (float& f : v) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    f = static_cast<float>(static_cast<double>(z >> 40) / static_cast<double>(1ULL << 24) * 2.0 - 1.0);
  }
  return v;
}

struct Inputs {
  Options opt;
  std::vector<float> x, w, b;  // x [m, k], w [n, k], b [n]
};

// One precision: correctness first (poisoned output, sampled double references), then
// `repeats` timed calls. The backend and its buffers are released before returning.
Json run_precision(const Inputs& in, const std::string& name) {
  const Options& o = in.opt;
  Json r = {{"precision", name}};
  Precision precision = Precision::kFp32;
  if (!parse_precision(name, &precision)) {
    r["status"] = "not run";
    r["why"] = "unknown precision";
    return r;
  }
  Result<std::unique_ptr<Backend>> made = make_cuda_backend(o.device, precision);
  if (!made) {
    r["status"] = "not run";
    r["why"] = made.status().message();
    return r;
  }
  Backend& be = **made;
  const int64_t mk = o.m * o.k, nk = o.n * o.k, mn = o.m * o.n;
  DeviceBuffer x(be, mk), w(be, nk), b(be, o.n), y(be, mn);
  be.upload(x.data(), in.x.data(), mk);
  be.upload(w.data(), in.w.data(), nk);
  be.upload(b.data(), in.b.data(), o.n);
  LinearShape shape;
  shape.rows = o.m;
  shape.in = o.k;
  shape.out = o.n;
  shape.layout = WeightLayout::kOutIn;

  be.fill(y.data(), std::numeric_limits<float>::quiet_NaN(), mn);
  be.linear_forward(y.data(), x.data(), w.data(), b.data(), shape);
  const bool all_written = !be.any_non_finite(y.data(), mn);
  std::vector<float> host_y(static_cast<size_t>(mn));
  be.download(host_y.data(), y.data(), mn);
  double worst = 0.0;
  uint64_t pick = 12345;
  for (int s = 0; s < 64; ++s) {
    pick = pick * 6364136223846793005ULL + 1442695040888963407ULL;
    const int64_t i = static_cast<int64_t>((pick >> 33) % static_cast<uint64_t>(o.m));
    const int64_t j = static_cast<int64_t>((pick >> 13) % static_cast<uint64_t>(o.n));
    double ref = in.b[j], mag = std::fabs(in.b[j]);
    for (int64_t p = 0; p < o.k; ++p) {
      const double t = static_cast<double>(in.x[i * o.k + p]) * in.w[j * o.k + p];
      ref += t;
      mag += std::fabs(t);
    }
    const double err = std::fabs(host_y[i * o.n + j] - ref) / std::max(mag, 1e-30);
    worst = std::max(worst, std::isnan(err) ? std::numeric_limits<double>::infinity() : err);
  }
  const bool ok = all_written && worst <= tolerance(precision);

  for (int i = 0; i < 3; ++i) be.linear_forward(y.data(), x.data(), w.data(), b.data(), shape);
  cuda_ok(cudaDeviceSynchronize(), "warm-up");
  std::vector<double> seconds;
  for (int i = 0; i < o.repeats; ++i) {
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const auto t0 = std::chrono::steady_clock::now();
    for (int c = 0; c < kCallsPerTiming; ++c) be.linear_forward(y.data(), x.data(), w.data(), b.data(), shape);
    cuda_ok(cudaDeviceSynchronize(), "linear_forward");
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kCallsPerTiming);
  }
  cuda_ok(cudaGetLastError(), "after the timed calls");
  std::vector<double> sorted = seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const double flop = 2.0 * static_cast<double>(o.m) * static_cast<double>(o.n) * static_cast<double>(o.k);
  r["status"] = "ran";
  r["ms_median"] = median * 1e3;
  r["ms_min"] = sorted.front() * 1e3;
  r["ms_max"] = sorted.back() * 1e3;
  r["gflops"] = flop / median / 1e9;
  r["all_outputs_written"] = all_written;
  r["max_rel_err"] = worst;
  r["tolerance"] = tolerance(precision);
  r["correct"] = ok;
  return r;
}

int usage(const char* why) {
  std::fprintf(stderr,
               "bench_gemm_cuda: %s\nusage: bench_gemm_cuda [M N K] [--repeats R] "
               "[--precisions fp32,tf32,bf16,fp16] [--device D]\n",
               why);
  return 2;
}

int run(int argc, char** argv) {
  Options o;
  std::vector<int64_t> dims;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--repeats" && has_value) {
      o.repeats = std::atoi(argv[++i]);
    } else if (a == "--device" && has_value) {
      o.device = std::atoi(argv[++i]);
    } else if (a == "--precisions" && has_value) {
      o.precisions.clear();
      std::stringstream list(argv[++i]);
      for (std::string item; std::getline(list, item, ',');) {
        Precision p = Precision::kFp32;
        if (!parse_precision(item, &p)) return usage(("unknown precision '" + item + "'").c_str());
        o.precisions.push_back(item);
      }
    } else if (!a.empty() && a[0] != '-') {
      dims.push_back(std::atoll(a.c_str()));
    } else {
      return usage(("unknown argument '" + a + "'").c_str());
    }
  }
  if (dims.size() == 3) {
    o.m = dims[0];
    o.n = dims[1];
    o.k = dims[2];
  } else if (!dims.empty()) {
    return usage("give all three of M N K or none");
  }
  if (o.m <= 0 || o.n <= 0 || o.k <= 0 || o.repeats <= 0 || o.precisions.empty()) return usage("bad sizes");

  Json out = {{"bench", "bench_gemm_cuda"},
              {"m", o.m},
              {"n", o.n},
              {"k", o.k},
              {"repeats", o.repeats},
              {"calls_per_timing", kCallsPerTiming},
              {"formula", "GFLOP/s = 2*M*N*K / median seconds of one Backend::linear_forward / 1e9"},
              {"op", "y[M,N] = x[M,K] * W^T + b, W [N,K] (kOutIn), through make_cuda_backend"}};
  std::string why;
  if (cuda_usable_gpus(&why) <= o.device) {
    out["error"] = "no usable GPU " + std::to_string(o.device) + ": " + (why.empty() ? "fewer GPUs visible" : why);
    std::printf("%s\n", out.dump(2).c_str());
    return 2;
  }
  cudaDeviceProp prop{};
  cuda_ok(cudaGetDeviceProperties(&prop, o.device), "cudaGetDeviceProperties");
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  out["gpu"] = {{"name", prop.name},
                {"compute_capability", std::to_string(prop.major) + "." + std::to_string(prop.minor)},
                {"multiprocessors", prop.multiProcessorCount},
                {"memory_gib", static_cast<double>(prop.totalGlobalMem) / (1 << 30)},
                {"cuda_runtime", runtime},
                {"cuda_driver", driver}};

  Inputs in;
  in.opt = o;
  in.x = random_uniform(static_cast<size_t>(o.m * o.k), 1);
  in.w = random_uniform(static_cast<size_t>(o.n * o.k), 2);
  in.b = random_uniform(static_cast<size_t>(o.n), 3);
  bool all_ok = true;
  out["results"] = Json::array();
  for (const std::string& p : o.precisions) {
    Json r = run_precision(in, p);
    if (r.value("status", "") == "ran" && !r.value("correct", false)) all_ok = false;
    out["results"].push_back(std::move(r));
  }
  std::printf("%s\n", out.dump(2).c_str());
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace pipeshard

int main(int argc, char** argv) { return pipeshard::run(argc, argv); }
