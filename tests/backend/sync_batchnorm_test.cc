// Synchronized BatchNorm: Backend::batchnorm_forward/backward with a ChannelReducer.
//
// D data-parallel replicas are simulated by D threads of one process. Each runs the
// kernels on its contiguous slice of the batch, with a reducer that sums the partial
// statistics over the threads as MPI_Allreduce sums them over ranks. Together they must
// compute what one process computes on the whole batch: y, dx, the saved mean and rstd and
// the running statistics within 1e-5 (the replicas add the same numbers in another
// order), every replica holding the same running statistics, and dw, db whose sum over the
// replicas (the gradient all-reduce) is the whole batch's.
//
// Without a reducer the kernels must keep their arithmetic bit for bit; a recomputation
// below follows it step by step.
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_kernels.h"
#include "tests/backend/backend_check.h"

namespace pipeshard {
namespace {

using namespace pipeshard::testing;  // NOLINT: the checks and fixture of backend_check.h

// The reducer of a group of threads. Each thread calls with its own data[n] and gets back
// the sum over the group, which every thread adds up itself in rank order, so that all
// hold the same bits (as every rank does after MPI_Allreduce).
class ThreadGroupSum {
 public:
  explicit ThreadGroupSum(int threads)
      : threads_(threads), sync_(threads), data_(threads), sizes_(threads), calls_(threads, 0) {}

  ChannelReducer reducer(int rank) {
    return [this, rank](double* data, int64_t n) { all_reduce(rank, data, n); };
  }
  int calls(int rank) const { return calls_[rank]; }

 private:
  void all_reduce(int rank, double* data, int64_t n) {
    data_[rank] = data;
    sizes_[rank] = n;
    ++calls_[rank];
    sync_.arrive_and_wait();  // every contribution published
    std::vector<double> total(n, 0.0);
    for (int r = 0; r < threads_; ++r) {
      EXPECT_EQ(sizes_[r], n) << "replicas " << r << " and " << rank << " reduced different sizes";
      for (int64_t i = 0; i < std::min(n, sizes_[r]); ++i) total[i] += data_[r][i];
    }
    sync_.arrive_and_wait();  // every contribution read before anyone overwrites its own
    std::copy(total.begin(), total.end(), data);
  }

  int threads_;
  std::barrier<> sync_;
  std::vector<double*> data_;   // [threads]: each thread's buffer during a call
  std::vector<int64_t> sizes_;  // [threads]
  std::vector<int> calls_;      // [threads]: reductions each thread asked for
};

struct BatchNormShape {
  int64_t batch, channels, inner;
};

std::string describe(const BatchNormShape& s, int replicas) {
  // Appended piece by piece: GCC 12 warns (-Wrestrict, falsely) on "[" + std::string&&.
  std::string text = "[";
  text += std::to_string(s.batch) + ", " + std::to_string(s.channels) + ", " + std::to_string(s.inner);
  text += "] over " + std::to_string(replicas) + " replicas";
  return text;
}

struct BatchNormInputs {
  Floats x, dy;                      // [batch, channels, inner]
  Floats w, b;                       // [channels]
  Floats running_mean, running_var;  // [channels], before the step
};

// What one forward + backward in training mode leaves behind.
struct BatchNormResults {
  Floats y, dx;                      // [rows of this replica, channels, inner]
  Floats mean, rstd;                 // [channels], saved by forward
  Floats running_mean, running_var;  // [channels], after the step
  Floats dw, db;                     // [channels]
};

class SyncBatchNormTest : public BackendTest {
 protected:
  BatchNormInputs inputs(const BatchNormShape& s) {
    const int64_t n = s.batch * s.channels * s.inner;
    // An offset mean, so that a replica's local mean differs from the global one.
    return {random(n, -1.0f, 3.0f), random(n),          random(s.channels, 0.5f, 1.5f),
            random(s.channels),     random(s.channels), random(s.channels, 0.5f, 2.0f)};
  }

  // Rows [row0, row1) of the batch through forward and backward; dx is not asked for
  // unless want_dx.
  BatchNormResults run(const BatchNormInputs& in, const BatchNormShape& s, int64_t row0, int64_t row1,
                       const ChannelReducer* reduce, bool want_dx = true) {
    const int64_t per_row = s.channels * s.inner, rows = row1 - row0, n = rows * per_row;
    const Floats x(in.x.begin() + row0 * per_row, in.x.begin() + row1 * per_row);
    const Floats dy(in.dy.begin() + row0 * per_row, in.dy.begin() + row1 * per_row);
    DeviceBuffer bx = buffer(x), bdy = buffer(dy), bw = buffer(in.w), bb = buffer(in.b);
    DeviceBuffer rm = buffer(in.running_mean), rv = buffer(in.running_var);
    DeviceBuffer y = zeros(n), mean = zeros(s.channels), rstd = zeros(s.channels), dx = zeros(n),
                 dw = zeros(s.channels), db = zeros(s.channels);
    be_->batchnorm_forward(y.data(), mean.data(), rstd.data(), rm.data(), rv.data(), bx.data(), bw.data(), bb.data(),
                           rows, s.channels, s.inner, 1e-5f, 0.9f, true, reduce);
    be_->batchnorm_backward(want_dx ? dx.data() : nullptr, dw.data(), db.data(), bdy.data(), bx.data(), bw.data(),
                            mean.data(), rstd.data(), rows, s.channels, s.inner, true, reduce);
    return {host(y), host(dx), host(mean), host(rstd), host(rm), host(rv), host(dw), host(db)};
  }

  // Each of `replicas` threads on its contiguous slice of the batch (sizes differ by at
  // most one row), summing through `group`.
  std::vector<BatchNormResults> run_replicas(const BatchNormInputs& in, const BatchNormShape& s, int replicas,
                                             ThreadGroupSum& group, bool want_dx = true) {
    std::vector<BatchNormResults> results(replicas);
    std::vector<std::thread> threads;
    for (int r = 0; r < replicas; ++r) {
      threads.emplace_back([&, r] {
        const ChannelReducer reduce = group.reducer(r);
        results[r] = run(in, s, s.batch * r / replicas, s.batch * (r + 1) / replicas, &reduce, want_dx);
      });
    }
    for (std::thread& t : threads) t.join();
    return results;
  }

  // The replicas against one process on the whole batch.
  void expect_replicas_match_one_process(const BatchNormShape& s, int replicas) {
    const std::string what = describe(s, replicas);
    const BatchNormInputs in = inputs(s);
    const BatchNormResults whole = run(in, s, 0, s.batch, nullptr);
    ThreadGroupSum group(replicas);
    const std::vector<BatchNormResults> parts = run_replicas(in, s, replicas, group);

    Floats y, dx, dw(s.channels, 0.0f), db(s.channels, 0.0f);
    for (int r = 0; r < replicas; ++r) {
      const BatchNormResults& p = parts[r];
      const std::string replica = what + ", replica " + std::to_string(r);
      EXPECT_EQ(group.calls(r), 3) << replica << ": two reductions in forward, one in backward";
      y.insert(y.end(), p.y.begin(), p.y.end());
      dx.insert(dx.end(), p.dx.begin(), p.dx.end());
      for (int64_t c = 0; c < s.channels; ++c) {
        dw[c] += p.dw[c];
        db[c] += p.db[c];
      }
      expect_values_near(p.mean, to_double(whole.mean), replica + ": mean");
      expect_values_near(p.rstd, to_double(whole.rstd), replica + ": rstd");
      expect_values_near(p.running_mean, to_double(whole.running_mean), replica + ": running_mean");
      expect_values_near(p.running_var, to_double(whole.running_var), replica + ": running_var");
      // Bit for bit alike on every replica: the statistics must not drift apart.
      EXPECT_EQ(p.running_mean, parts[0].running_mean) << replica;
      EXPECT_EQ(p.running_var, parts[0].running_var) << replica;
      EXPECT_EQ(p.mean, parts[0].mean) << replica;
      EXPECT_EQ(p.rstd, parts[0].rstd) << replica;
    }
    expect_values_near(y, to_double(whole.y), what + ": y");
    expect_values_near(dx, to_double(whole.dx), what + ": dx");
    expect_values_near(dw, to_double(whole.dw), what + ": dw summed over replicas");
    expect_values_near(db, to_double(whole.db), what + ": db summed over replicas");
  }
};

TEST_F(SyncBatchNormTest, FeaturesOverTwoAndThreeReplicasEqualOneProcess) {
  // [batch, features]: inner == 1, including odd and uneven slices and > 64 channels.
  for (int replicas : {2, 3}) {
    for (const BatchNormShape& s : {BatchNormShape{12, 5, 1}, BatchNormShape{9, 70, 1}, BatchNormShape{11, 131, 1}}) {
      expect_replicas_match_one_process(s, replicas);
    }
  }
}

TEST_F(SyncBatchNormTest, ChannelsWithInnerDimensionOverTwoAndThreeReplicasEqualOneProcess) {
  // [batch, channels, length]: inner > 1, odd sizes, one and several channel blocks.
  for (int replicas : {2, 3}) {
    for (const BatchNormShape& s : {BatchNormShape{6, 3, 7}, BatchNormShape{7, 67, 5}, BatchNormShape{10, 130, 3}}) {
      expect_replicas_match_one_process(s, replicas);
    }
  }
}

TEST_F(SyncBatchNormTest, OneValuePerReplicaIsEnoughWhenTheGroupHasMore) {
  // Each replica holds one value per channel; the group holds two or three (PyTorch's
  // SyncBatchNorm allows this too).
  expect_replicas_match_one_process({2, 4, 1}, 2);
  expect_replicas_match_one_process({3, 66, 1}, 3);
}

TEST_F(SyncBatchNormTest, ThreadedChannelBlocksEqualOneProcess) {
  // Every channel-block loop on OpenMP threads inside each replica's thread.
  const cpu::ScopedParallelMinWork every_loop_threaded(1);
  expect_replicas_match_one_process({9, 200, 1}, 3);
  expect_replicas_match_one_process({8, 140, 4}, 2);
}

TEST_F(SyncBatchNormTest, BackwardWithoutDxReducesNothingAndKeepsLocalParameterGradients) {
  const BatchNormShape s{10, 70, 2};
  const BatchNormInputs in = inputs(s);
  const BatchNormResults whole = run(in, s, 0, s.batch, nullptr);
  ThreadGroupSum group(2);
  const std::vector<BatchNormResults> parts = run_replicas(in, s, 2, group, /*want_dx=*/false);
  Floats dw(s.channels, 0.0f), db(s.channels, 0.0f);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(group.calls(r), 2) << "replica " << r << ": forward's two reductions only";
    for (int64_t c = 0; c < s.channels; ++c) {
      dw[c] += parts[r].dw[c];
      db[c] += parts[r].db[c];
    }
  }
  expect_values_near(dw, to_double(whole.dw), "dw summed over replicas");
  expect_values_near(db, to_double(whole.db), "db summed over replicas");
}

TEST_F(SyncBatchNormTest, OneReplicaIsBitwiseTheUnsynchronizedKernel) {
  // A group of one sums nothing: the synchronized passes must do a channel's arithmetic
  // exactly as the fused one does.
  for (const BatchNormShape& s : {BatchNormShape{7, 130, 1}, BatchNormShape{5, 67, 6}}) {
    const BatchNormInputs in = inputs(s);
    const BatchNormResults plain = run(in, s, 0, s.batch, nullptr);
    ThreadGroupSum group(1);
    const ChannelReducer reduce = group.reducer(0);
    const BatchNormResults synced = run(in, s, 0, s.batch, &reduce);
    EXPECT_EQ(group.calls(0), 3);
    EXPECT_EQ(synced.y, plain.y);
    EXPECT_EQ(synced.dx, plain.dx);
    EXPECT_EQ(synced.mean, plain.mean);
    EXPECT_EQ(synced.rstd, plain.rstd);
    EXPECT_EQ(synced.running_mean, plain.running_mean);
    EXPECT_EQ(synced.running_var, plain.running_var);
    EXPECT_EQ(synced.dw, plain.dw);
    EXPECT_EQ(synced.db, plain.db);
  }
}

TEST_F(SyncBatchNormTest, InferenceIgnoresTheReducer) {
  const BatchNormShape s{6, 70, 3};
  const BatchNormInputs in = inputs(s);
  const int64_t n = s.batch * s.channels * s.inner;
  const ChannelReducer never = [](double*, int64_t) { ADD_FAILURE() << "inference BatchNorm reduced"; };
  DeviceBuffer x = buffer(in.x), dy = buffer(in.dy), w = buffer(in.w), b = buffer(in.b);
  DeviceBuffer rm = buffer(in.running_mean), rv = buffer(in.running_var);
  Floats outputs[2];
  for (const ChannelReducer* reduce : {static_cast<const ChannelReducer*>(nullptr), &never}) {
    DeviceBuffer y = zeros(n), mean = zeros(s.channels), rstd = zeros(s.channels), dx = zeros(n),
                 dw = zeros(s.channels), db = zeros(s.channels);
    be_->batchnorm_forward(y.data(), mean.data(), rstd.data(), rm.data(), rv.data(), x.data(), w.data(), b.data(),
                           s.batch, s.channels, s.inner, 1e-5f, 0.9f, false, reduce);
    be_->batchnorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(),
                            s.batch, s.channels, s.inner, false, reduce);
    Floats& all = outputs[reduce == nullptr ? 0 : 1];
    for (const DeviceBuffer* buf : {&y, &dx, &dw, &db}) {
      const Floats h = host(*buf);
      all.insert(all.end(), h.begin(), h.end());
    }
  }
  EXPECT_EQ(outputs[1], outputs[0]);
}

// ---- without a reducer: the arithmetic of the kernels as they were before it ----

// The unsynchronized training forward and backward, one channel at a time, in the order
// and precision of cpu_normalization.cc: double sums over b then k, statistics rounded to
// float once, float normalisation and dx.
BatchNormResults batchnorm_step_by_step(const BatchNormInputs& in, const BatchNormShape& s, float eps, float momentum) {
  const int64_t C = s.channels, L = s.inner, n = s.batch * L;
  BatchNormResults r{Floats(in.x.size()), Floats(in.x.size(), 0.0f), Floats(C),      Floats(C), in.running_mean,
                     in.running_var,      Floats(C, 0.0f),           Floats(C, 0.0f)};
  auto at = [&](int64_t b, int64_t c) { return (b * C + c) * L; };
  for (int64_t c = 0; c < C; ++c) {
    double sum = 0.0, sq = 0.0, s1 = 0.0, s2 = 0.0;
    for (int64_t b = 0; b < s.batch; ++b) {
      double part = 0.0;
      for (int64_t k = 0; k < L; ++k) part += static_cast<double>(in.x[at(b, c) + k]);
      sum += part;
    }
    const double mean = sum / static_cast<double>(n);
    for (int64_t b = 0; b < s.batch; ++b) {
      double part = 0.0;
      for (int64_t k = 0; k < L; ++k) part += (in.x[at(b, c) + k] - mean) * (in.x[at(b, c) + k] - mean);
      sq += part;
    }
    const double rstd = 1.0 / std::sqrt(sq / static_cast<double>(n) + static_cast<double>(eps));
    r.running_mean[c] = static_cast<float>(momentum * static_cast<double>(r.running_mean[c]) + (1.0 - momentum) * mean);
    r.running_var[c] = static_cast<float>(momentum * static_cast<double>(r.running_var[c]) +
                                          (1.0 - momentum) * (sq / static_cast<double>(n - 1)));
    const float m = static_cast<float>(mean), scale = static_cast<float>(in.w[c] * rstd), shift = in.b[c];
    r.mean[c] = m;
    r.rstd[c] = static_cast<float>(rstd);
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t k = 0; k < L; ++k) r.y[at(b, c) + k] = (in.x[at(b, c) + k] - m) * scale + shift;
    }
    // Backward from the saved float statistics.
    const double mc = r.mean[c], sc = r.rstd[c];
    for (int64_t b = 0; b < s.batch; ++b) {
      double part1 = 0.0, part2 = 0.0;
      for (int64_t k = 0; k < L; ++k) part1 += static_cast<double>(in.dy[at(b, c) + k]);
      for (int64_t k = 0; k < L; ++k) part2 += in.dy[at(b, c) + k] * ((in.x[at(b, c) + k] - mc) * sc);
      s1 += part1;
      s2 += part2;
    }
    r.dw[c] += static_cast<float>(s2);
    r.db[c] += static_cast<float>(s1);
    const double gain = in.w[c] * static_cast<double>(r.rstd[c]);
    const float k_dy = static_cast<float>(gain), k_mean = static_cast<float>(gain * s1 / static_cast<double>(n)),
                k_xhat = static_cast<float>(gain * s2 / static_cast<double>(n));
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t k = 0; k < L; ++k) {
        const int64_t i = at(b, c) + k;
        const float xhat = (in.x[i] - r.mean[c]) * r.rstd[c];
        r.dx[i] += k_dy * in.dy[i] - k_mean - k_xhat * xhat;
      }
    }
  }
  return r;
}

TEST_F(SyncBatchNormTest, WithoutReducerTheKernelsKeepTheirArithmeticBitForBit) {
  for (const BatchNormShape& s : {BatchNormShape{12, 5, 1}, BatchNormShape{9, 131, 1}, BatchNormShape{7, 67, 5}}) {
    const std::string what = describe(s, 1);
    const BatchNormInputs in = inputs(s);
    const BatchNormResults got = run(in, s, 0, s.batch, nullptr);
    const BatchNormResults want = batchnorm_step_by_step(in, s, 1e-5f, 0.9f);
    EXPECT_EQ(got.y, want.y) << what;
    EXPECT_EQ(got.mean, want.mean) << what;
    EXPECT_EQ(got.rstd, want.rstd) << what;
    EXPECT_EQ(got.running_mean, want.running_mean) << what;
    EXPECT_EQ(got.running_var, want.running_var) << what;
    EXPECT_EQ(got.dx, want.dx) << what;
    EXPECT_EQ(got.dw, want.dw) << what;
    EXPECT_EQ(got.db, want.db) << what;
  }
}

}  // namespace
}  // namespace pipeshard
