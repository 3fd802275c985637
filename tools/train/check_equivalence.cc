// train --check-equivalence (tools/train/check_equivalence.h).
#include "tools/train/check_equivalence.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "comm/watchdog.h"

namespace pipeshard::train_cli {
namespace {

// The most one Adam step can move an element, in units of the learning rate, at update t
// (1-based) whatever the gradients: |m̂_t| / sqrt(v̂_t) (eps only lowers it), bounded by
// Cauchy–Schwarz over the t gradients so far (Kingma & Ba 2015, section 2.1, with the sums
// kept finite):
//   (1 − β1) / (1 − β1^t) · sqrt((1 − β2^t) / (1 − β2)) · sqrt(Σ_{k<t} (β1² / β2)^k).
// 1 at t = 1 (the first step is lr · sign(g)); about 1.004 at t = 3 for betas 0.9, 0.999.
// With β2 = 0 (v̂ is the last gradient squared) only β1 = 0 bounds it.
double adam_step_bound(double beta1, double beta2, int64_t t) {
  if (beta2 <= 0) return beta1 > 0 ? std::numeric_limits<double>::infinity() : 1.0;
  double sum = 0, term = 1;  // Σ_{k<t} (β1²/β2)^k
  for (int64_t k = 0; k < t; ++k, term *= beta1 * beta1 / beta2) sum += term;
  const double td = static_cast<double>(t);
  return (1 - beta1) / (1 - std::pow(beta1, td)) * std::sqrt((1 - std::pow(beta2, td)) / (1 - beta2)) * std::sqrt(sum);
}

// What the one-process reference run did.
struct Reference {
  std::vector<double> losses;                  // [steps]
  std::vector<double> step_bounds;             // [steps]: lr · adam_step_bound, 0 for a skipped step
  std::vector<std::vector<double>> gradients;  // [steps][params]: each parameter's largest |gradient|
  Graph trained;                               // the whole model after the steps
};

Reference train_alone(const Graph& graph, const Dataset& data, const TrainConfig& config, int64_t steps,
                      const std::function<std::unique_ptr<Backend>()>& make_backend) {
  std::unique_ptr<Backend> backend = make_backend();
  TrainConfig one = config;  // the whole batch at once, as one process would train it
  one.micro_batches = 1;
  one.pipeline_schedule = "1f1b";  // one stage: whatever the schedule, forward then backward
  one.virtual_stages = 0;
  one.sync_batchnorm = false;
  auto alone = Trainer::create(graph, data, *backend, one);
  PIPESHARD_CHECK(alone.is_ok(), alone.status().message());
  Reference ref;
  int64_t updates = 0;
  for (int64_t s = 0; s < steps; ++s) {
    const StepResult r = (*alone)->step();
    const bool updated = !r.non_finite && !r.scale_overflow;
    updates += updated ? 1 : 0;
    ref.losses.push_back(r.loss);
    ref.step_bounds.push_back(updated ? r.lr * adam_step_bound(config.optimizer.beta1, config.optimizer.beta2, updates)
                                      : 0.0);
    ref.gradients.push_back((*alone)->gradient_magnitudes());
  }
  ref.trained = graph;
  (*alone)->download_parameters(ref.trained);
  return ref;
}

// One tensor against the reference.
struct TensorCheck {
  double difference = 0;        // largest |ours − reference| over its elements; inf where one is NaN
  double relative = 0;          // difference / the larger of 1 and its largest value
  double allowed = 0;           // absolute
  double gradient = 0;          // its largest |gradient| in the reference's steps (0: a statistic)
  bool rounding_level = false;  // held to Adam's step bound (check_equivalence.h)
  double excess() const { return difference / allowed; }
};

bool normalises_steps(OptimizerKind kind) { return kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW; }

// check_equivalence.h says why: each tensor's difference and what it may be.
std::vector<TensorCheck> check_tensors(const Graph& graph, const Graph& ours, const Reference& ref,
                                       const TrainConfig& config) {
  std::vector<TensorCheck> checks(graph.params.size());
  double adam_bound = 0;  // the most both runs can move an element apart: twice one run's
  for (double b : ref.step_bounds) adam_bound += 2 * b;
  for (size_t p = 0; p < graph.params.size(); ++p) {
    TensorCheck& c = checks[p];
    const std::vector<float>& want = ref.trained.params[p].data;
    float scale = 1.0f;
    for (float v : want) scale = std::max(scale, std::fabs(v));
    for (size_t i = 0; i < want.size(); ++i) {
      const double d = std::fabs(static_cast<double>(ours.params[p].data[i]) - want[i]);
      c.difference = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(c.difference, d);
    }
    c.relative = c.difference / scale;
    c.allowed = kEquivalenceTolerance * scale;
    c.rounding_level = graph.params[p].trainable && normalises_steps(config.optimizer.kind);
    for (const std::vector<double>& step : ref.gradients) {
      const double largest = *std::max_element(step.begin(), step.end());
      c.gradient = std::max(c.gradient, step[p]);
      if (!(largest > 0 && step[p] <= kEquivalenceTolerance * largest)) c.rounding_level = false;
    }
    if (c.rounding_level) c.allowed += adam_bound;
  }
  for (const Node& n : graph.nodes) {  // a BatchNorm's running mean averages the bias before it
    if (n.kind != OpKind::kBatchNorm || n.running_mean < 0) continue;
    const int producer = graph.values[n.inputs[0]].producer;
    const int bias = producer < 0 ? -1 : graph.nodes[producer].bias;
    if (bias < 0 || !checks[bias].rounding_level) continue;
    checks[n.running_mean].rounding_level = true;
    checks[n.running_mean].allowed = std::max(checks[n.running_mean].allowed, checks[bias].allowed);
  }
  return checks;
}

// "'0.bias' (gradient up to 1.16e-08), '3.bias' (...)" for the tensors with gradients, and
// the running means.
void say_rounding_level(const Graph& graph, const std::vector<TensorCheck>& checks, const TrainConfig& config) {
  std::string noisy, means;
  double allowed = 0, largest = 0;
  for (size_t p = 0; p < checks.size(); ++p) {
    if (!checks[p].rounding_level) continue;
    std::string& list = graph.params[p].trainable ? noisy : means;
    list += fmt::format("{}'{}'", list.empty() ? "" : ", ", graph.params[p].name);
    if (graph.params[p].trainable) list += fmt::format(" (gradient up to {:.2e})", checks[p].gradient);
    allowed = std::max(allowed, checks[p].allowed);
    largest = std::max(largest, checks[p].difference);
  }
  if (noisy.empty()) return;
  const char* adam = config.optimizer.kind == OptimizerKind::kAdamW ? "AdamW" : "Adam";
  fmt::print(
      "check-equivalence: gradients at float-rounding level (at most {:.0e} of the model's largest in every step): {}; "
      "{} divides each step by the gradient's size, so rounding noise moves these{} up to the learning rate per step: "
      "they may differ by twice {}'s step bound over the run, {:.2e} (largest difference {:.2e})\n",
      kEquivalenceTolerance, noisy, adam, means.empty() ? "" : " and the running means they feed (" + means + ")", adam,
      allowed, largest);
}

}  // namespace

int check_equivalence(const Graph& graph, const Dataset& data, const TrainConfig& config, Trainer& distributed,
                      int64_t steps, Communicator& world,
                      const std::function<std::unique_ptr<Backend>()>& make_backend) {
  std::vector<double> losses;
  for (int64_t s = 0; s < steps; ++s) losses.push_back(distributed.step().loss);
  Graph ours = graph;
  distributed.download_parameters(ours);
  bool same = true;
  std::string why;  // the worst difference, when there is one to name
  const WatchdogSlowPhase solo("the one-process reference run on rank 0");
  if (world.rank() == 0) {
    const Reference ref = train_alone(graph, data, config, steps, make_backend);
    double loss_diff = -1;
    int64_t loss_step = 0;  // 1-based
    for (int64_t s = 0; s < steps; ++s) {
      double d = std::fabs(losses[s] - ref.losses[s]) / std::max(std::fabs(ref.losses[s]), 1e-12);
      if (std::isnan(d)) d = std::numeric_limits<double>::infinity();
      if (d > loss_diff) {
        loss_diff = d;
        loss_step = s + 1;
      }
    }
    const std::vector<TensorCheck> checks = check_tensors(graph, ours, ref, config);
    size_t worst = 0;
    double weight_diff = 0;  // relative
    for (size_t p = 0; p < checks.size(); ++p) {
      if (checks[p].excess() > checks[worst].excess()) worst = p;
      weight_diff = std::max(weight_diff, checks[p].relative);
    }
    const TensorCheck& w = checks[worst];
    const std::string tensor =
        fmt::format("'{}' differs by {:.2e} ({:.2e} allowed{})", graph.params[worst].name, w.difference, w.allowed,
                    graph.params[worst].trainable ? fmt::format("; its gradient up to {:.2e}", w.gradient)
                                                  : std::string("; a running statistic"));
    fmt::print(
        "check-equivalence: {} steps on {} process{} vs 1: largest loss difference {:.2e} (relative), largest weight "
        "difference {:.2e} (relative to each tensor's largest value, at least 1); furthest for what it may differ: "
        "{}\n",
        steps, world.size(), world.size() == 1 ? "" : "es", loss_diff, weight_diff, tensor);
    say_rounding_level(graph, checks, config);
    const bool loss_same = loss_diff <= kEquivalenceTolerance, tensors_same = w.difference <= w.allowed;
    same = loss_same && tensors_same;
    if (!loss_same) why = fmt::format("the loss of step {} differs by {:.2e} (relative)", loss_step, loss_diff);
    if (!tensors_same) why += (why.empty() ? "" : "; ") + tensor;
  }
  same = world.all_reduce_sum(same ? 0.0 : 1.0) == 0.0;
  if (world.rank() == 0) {
    if (same) {
      fmt::print("equivalent: the layout computes the one-process training\n");
    } else {
      fmt::print("NOT equivalent beyond float rounding ({:.0e}): {}\n", kEquivalenceTolerance, why);
    }
  }
  return same ? 0 : 1;
}

}  // namespace pipeshard::train_cli
