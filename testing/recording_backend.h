// A Backend that records as a CUDA graph does, over any other backend (the CPU one in the
// tests): Backend::record() runs the work's host code once while every backend call it
// makes is queued with its arguments copied, not run; replay() runs the queue again. So a
// caller that changes an argument between replays (instead of a buffer's contents), or
// asks a recorded call for a host value, allocates or copies from the host inside a
// recording — each a bug on a real GPU — goes wrong or stops here too, on any machine.
#ifndef PIPESHARD_TESTING_RECORDING_BACKEND_H_
#define PIPESHARD_TESTING_RECORDING_BACKEND_H_

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "common/status.h"

namespace pipeshard::testing {

class RecordingBackend final : public Backend {
 public:
  explicit RecordingBackend(Backend& inner) : inner_(inner) {}

  const char* name() const override { return inner_.name(); }

  // Activation kinds whose fused epilogue this backend says it cannot recompute bit for
  // bit, as the CUDA backend says of GeluTanh below fp32; the inner backend's answer for
  // the rest.
  std::vector<ActivationKind> inexact_epilogues;

  int synchronizations = 0;  // synchronize() calls
  int recordings = 0;        // record() calls
  int replays = 0;           // replay() calls, over all recordings
  int64_t recorded_calls = 0;

  std::unique_ptr<RecordedWork> record(const std::function<void()>& work) override {
    PIPESHARD_CHECK(!recording_, "a recording inside a recording");
    recording_ = true;
    queue_.clear();
    work();
    recording_ = false;
    ++recordings;
    recorded_calls += static_cast<int64_t>(queue_.size());
    return std::make_unique<Replay>(std::move(queue_), &replays);
  }

  float* allocate(int64_t n) override {
    host_only("allocate");
    return inner_.allocate(n);
  }
  void deallocate(float* p) override {
    host_only("deallocate");
    inner_.deallocate(p);
  }
  MemoryUse memory_use() const override { return inner_.memory_use(); }
  void synchronize() override {
    host_only("synchronize");
    ++synchronizations;
    inner_.synchronize();
  }
  bool epilogue_recomputes_exactly(const Activation& a) const override {
    const bool inexact =
        std::find(inexact_epilogues.begin(), inexact_epilogues.end(), a.kind) != inexact_epilogues.end();
    return !inexact && inner_.epilogue_recomputes_exactly(a);
  }
  void upload(float* dst, const float* host, int64_t n) override {
    host_only("upload");
    inner_.upload(dst, host, n);
  }
  void download(float* host, const float* src, int64_t n) override {
    host_only("download");
    inner_.download(host, src, n);
  }
  void fill(float* dst, float value, int64_t n) override {
    run([=, this] { inner_.fill(dst, value, n); });
  }
  void copy(float* dst, const float* src, int64_t n) override {
    run([=, this] { inner_.copy(dst, src, n); });
  }
  void axpy(float* y, float a, const float* x, int64_t n) override {
    run([=, this] { inner_.axpy(y, a, x, n); });
  }
  void scale(float* x, float a, int64_t n) override {
    run([=, this] { inner_.scale(x, a, n); });
  }
  void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows, int64_t width,
                 bool add) override {
    run([=, this] { inner_.copy_rows(dst, dst_stride, src, src_stride, rows, width, add); });
  }
  void add_bias(float* y, const float* b, int64_t rows, int64_t width) override {
    run([=, this] { inner_.add_bias(y, b, rows, width); });
  }
  void bias_backward(float* db, const float* dy, int64_t rows, int64_t width) override {
    run([=, this] { inner_.bias_backward(db, dy, rows, width); });
  }
  double sum_squares(const float* x, int64_t n) override {
    host_only("sum_squares");
    return inner_.sum_squares(x, n);
  }
  bool any_non_finite(const float* x, int64_t n) override {
    host_only("any_non_finite");
    return inner_.any_non_finite(x, n);
  }

  void linear_forward(float* y, const float* x, const float* w, const float* b, const LinearShape& s,
                      const Activation* epilogue, float* pre) override {
    const std::optional<Activation> e = epilogue ? std::optional<Activation>(*epilogue) : std::nullopt;
    run([=, this] { inner_.linear_forward(y, x, w, b, s, e ? &*e : nullptr, pre); });
  }
  void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                       const LinearShape& s, GradWrite param_grads, GradWrite input_grad) override {
    run([=, this] { inner_.linear_backward(dx, dw, db, dy, x, w, s, param_grads, input_grad); });
  }

  void activation_forward(float* y, const float* x, int64_t n, const Activation& a) override {
    run([=, this] { inner_.activation_forward(y, x, n, a); });
  }
  void activation_backward(float* dx, const float* dy, const float* x, const float* y, int64_t n,
                           const Activation& a) override {
    run([=, this] { inner_.activation_backward(dx, dy, x, y, n, a); });
  }
  void add_forward(float* y, const float* a, const float* b, int64_t n) override {
    run([=, this] { inner_.add_forward(y, a, b, n); });
  }

  void softmax_forward(float* y, const float* x, int64_t rows, int64_t width, bool log) override {
    run([=, this] { inner_.softmax_forward(y, x, rows, width, log); });
  }
  void softmax_backward(float* dx, const float* dy, const float* y, int64_t rows, int64_t width, bool log) override {
    run([=, this] { inner_.softmax_backward(dx, dy, y, rows, width, log); });
  }

  void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                         int64_t rows, int64_t width, float eps) override {
    run([=, this] { inner_.layernorm_forward(y, mean, rstd, x, w, b, rows, width, eps); });
  }
  void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                          const float* mean, const float* rstd, int64_t rows, int64_t width) override {
    run([=, this] { inner_.layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, rows, width); });
  }

  void batchnorm_forward(float* y, float* mean, float* rstd, float* running_mean, float* running_var, const float* x,
                         const float* w, const float* b, int64_t batch, int64_t channels, int64_t inner, float eps,
                         float momentum, bool training, const ChannelReducer* reduce) override {
    PIPESHARD_CHECK(!recording_ || reduce == nullptr, "a BatchNorm reducer (host communication) in a recording");
    run([=, this] {
      inner_.batchnorm_forward(y, mean, rstd, running_mean, running_var, x, w, b, batch, channels, inner, eps, momentum,
                               training, reduce);
    });
  }
  void batchnorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                          const float* mean, const float* rstd, int64_t batch, int64_t channels, int64_t inner,
                          bool training, const ChannelReducer* reduce) override {
    PIPESHARD_CHECK(!recording_ || reduce == nullptr, "a BatchNorm reducer (host communication) in a recording");
    run([=, this] {
      inner_.batchnorm_backward(dx, dw, db, dy, x, w, mean, rstd, batch, channels, inner, training, reduce);
    });
  }

  void dropout_forward(float* y, float* mask, const float* x, int64_t n, float ratio, uint64_t seed,
                       uint64_t offset) override {
    run([=, this] { inner_.dropout_forward(y, mask, x, n, ratio, seed, offset); });
  }
  void dropout_backward(float* dx, const float* dy, const float* mask, int64_t n) override {
    run([=, this] { inner_.dropout_backward(dx, dy, mask, n); });
  }

  double cross_entropy(float* dlogits, const float* logits, const float* labels, int64_t rows, int64_t classes,
                       double denominator, bool log_probs) override {
    host_only("cross_entropy");
    return inner_.cross_entropy(dlogits, logits, labels, rows, classes, denominator, log_probs);
  }
  double mean_squared_error(float* dpred, const float* pred, const float* target, int64_t n,
                            double denominator) override {
    host_only("mean_squared_error");
    return inner_.mean_squared_error(dpred, pred, target, n, denominator);
  }

  bool sgd_step(float* param, const float* grad, float* momentum_buffer, int64_t n, const SgdStep& s) override {
    host_only("sgd_step");
    return inner_.sgd_step(param, grad, momentum_buffer, n, s);
  }
  bool adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                 const AdamStep& s) override {
    host_only("adam_step");
    return inner_.adam_step(param, grad, exp_avg, exp_avg_sq, n, s);
  }

 private:
  class Replay final : public RecordedWork {
   public:
    Replay(std::vector<std::function<void()>> calls, int* replays) : calls_(std::move(calls)), replays_(replays) {}
    void replay() override {
      ++*replays_;
      for (const auto& call : calls_) call();
    }

   private:
    std::vector<std::function<void()>> calls_;
    int* replays_;
  };

  template <typename Call>
  void run(Call&& call) {
    if (recording_) {
      queue_.emplace_back(std::forward<Call>(call));
    } else {
      call();
    }
  }
  void host_only(const char* call) const {
    PIPESHARD_CHECK(!recording_, std::string(call) + " inside a recording (a CUDA graph cannot hold it)");
  }

  Backend& inner_;
  bool recording_ = false;
  std::vector<std::function<void()>> queue_;
};

}  // namespace pipeshard::testing

#endif  // PIPESHARD_TESTING_RECORDING_BACKEND_H_
