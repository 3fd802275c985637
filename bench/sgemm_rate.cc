// bench_sgemm: the sgemm ceiling that bench/cpu_vs_pytorch.py compares training against.
//
// Times cblas_sgemm (the same OpenBLAS the CPU backend links) on the three GEMMs one
// Linear layer runs per training step, for a layer of model B by default:
//   forward   y[M, N]  = x[M, K] · Wᵀ         (W stored [N, K], PyTorch's layout)
//   backward  dx[M, K] = dy[M, N] · W
//   backward  dW[N, K] += dyᵀ · x             (K of this GEMM is the batch M)
// Each has 2·M·N·K float operations. Prints one line per shape and a total line:
//   GFLOP/s = 2·M·N·K / median seconds / 1e9       (per shape)
//   GFLOP/s = 6·M·N·K / Σ median seconds / 1e9     (all three: one layer's step)
// and a correctness column: the largest relative error of 16 sampled outputs against a
// double-precision dot product, so that a broken BLAS cannot post a fast time. Exit status
// 1 when that error passes 1e-5, 2 on bad arguments.
//
// Usage: bench_sgemm [M N K] [repeats]   (default 256 1024 1024, 30 repeats)
// Threads: OpenBLAS's own (OPENBLAS_NUM_THREADS), as in training.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

struct Gemm {
  const char* name;
  CBLAS_TRANSPOSE ta, tb;
  int m, n, k;  // C[m, n] = op(A)[m, k] · op(B)[k, n]
  const float* a;
  int lda;
  const float* b;
  int ldb;
  float* c;
  float beta;
};

void run(const Gemm& g) {
  cblas_sgemm(CblasRowMajor, g.ta, g.tb, g.m, g.n, g.k, 1.0f, g.a, g.lda, g.b, g.ldb, g.beta, g.c, g.n);
}

// Largest relative error over a few sampled C elements of one call with beta = 0.
double check(const Gemm& g, std::mt19937& rng) {
  Gemm once = g;
  once.beta = 0.0f;
  run(once);
  double worst = 0.0;
  for (int s = 0; s < 16; ++s) {
    const int i = static_cast<int>(rng() % g.m), j = static_cast<int>(rng() % g.n);
    double ref = 0.0, mag = 0.0;
    for (int p = 0; p < g.k; ++p) {
      const double av = g.ta == CblasNoTrans ? g.a[i * g.lda + p] : g.a[p * g.lda + i];
      const double bv = g.tb == CblasNoTrans ? g.b[p * g.ldb + j] : g.b[j * g.ldb + p];
      ref += av * bv;
      mag += std::fabs(av * bv);
    }
    worst = std::max(worst, std::fabs(g.c[i * g.n + j] - ref) / std::max(mag, 1e-30));
  }
  return worst;
}

double median_seconds(const Gemm& g, int repeats) {
  for (int w = 0; w < 3; ++w) run(g);  // warm-up: threads started, buffers allocated
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run(g);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int m = argc > 3 ? std::atoi(argv[1]) : 256;
  const int n = argc > 3 ? std::atoi(argv[2]) : 1024;
  const int k = argc > 3 ? std::atoi(argv[3]) : 1024;
  const int repeats = argc == 2 ? std::atoi(argv[1]) : argc > 4 ? std::atoi(argv[4]) : 30;
  if (m <= 0 || n <= 0 || k <= 0 || repeats <= 0) {
    std::fprintf(stderr, "usage: bench_sgemm [M N K] [repeats]\n");
    return 2;
  }
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  auto random = [&](size_t count) {
    std::vector<float> v(count);
    for (float& f : v) f = uni(rng);
    return v;
  };
  // Shapes: x [M, K], W [N, K], dy [M, N].
  const std::vector<float> x = random(size_t(m) * k), w = random(size_t(n) * k), dy = random(size_t(m) * n);
  std::vector<float> y(size_t(m) * n), dx(size_t(m) * k), dw(size_t(n) * k);
  const Gemm gemms[] = {
      {"forward  y=x*W^T ", CblasNoTrans, CblasTrans, m, n, k, x.data(), k, w.data(), k, y.data(), 0.0f},
      {"backward dx=dy*W ", CblasNoTrans, CblasNoTrans, m, k, n, dy.data(), n, w.data(), k, dx.data(), 1.0f},
      {"backward dW+=dy^T*x", CblasTrans, CblasNoTrans, n, k, m, dy.data(), n, x.data(), k, dw.data(), 1.0f},
  };
  std::printf("sgemm ceiling, OpenBLAS %s (core %s, %d threads); median of %d calls\n", openblas_get_config(),
              openblas_get_corename(), openblas_get_num_threads(), repeats);
  std::printf("%-20s %6s %6s %6s %10s %10s %12s\n", "gemm", "M", "N", "K", "ms", "GFLOP/s", "max_rel_err");
  double total_s = 0.0, total_flop = 0.0;
  bool ok = true;
  for (const Gemm& g : gemms) {
    const double err = check(g, rng);
    const double s = median_seconds(g, repeats);
    const double flop = 2.0 * g.m * g.n * g.k;
    total_s += s;
    total_flop += flop;
    ok = ok && err < 1e-5;
    std::printf("%-20s %6d %6d %6d %10.3f %10.1f %12.2e\n", g.name, g.m, g.n, g.k, s * 1e3, flop / s / 1e9, err);
  }
  std::printf("%-20s %6s %6s %6s %10.3f %10.1f %12s\n", "all three (6*M*N*K)", "", "", "", total_s * 1e3,
              total_flop / total_s / 1e9, ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
