#include "planner/measure.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <functional>
#include <random>
#include <set>

#include <fmt/core.h>
#include <fmt/format.h>

#include "common/check.h"
#include "common/host_memory.h"
#include "dataset/dataset.h"
#include "dataset/npy.h"
#include "partitioner/layout_search.h"
#include "planner/cost_model.h"
#include "program/program.h"
#include "runtime/trainer.h"

namespace pipeshard {
namespace {

using Clock = std::chrono::steady_clock;

// The sums of a weighted least-squares line y = slope·x + intercept (fit_link,
// smooth_in_log_rows).
struct LineSums {
  double sw = 0, swx = 0, swy = 0, swxx = 0, swxy = 0;
  void add(double x, double y, double w) { sw += w, swx += w * x, swy += w * y, swxx += w * x * x, swxy += w * x * y; }
  // False, and slope 0 with the weighted mean for intercept, when the x do not differ.
  bool line(double& slope, double& intercept) const {
    const double denominator = sw * swxx - swx * swx;
    slope = denominator > 0 ? (sw * swxy - swx * swy) / denominator : 0;
    intercept = sw > 0 ? (swy - slope * swx) / sw : 0;
    return denominator > 0;
  }
};

double since_us(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// Times `work` on every rank at once: rank 0 finds how many repeats fill
// seconds_per_figure, every rank runs that many back to back after a barrier, and the
// figure is the block's time over the repeats, averaged over the ranks (µs). A block, not
// the median repeat: ranks that share cores lose whole scheduler slices now and then, and
// a short repeat mostly escapes them where a training step does not. Collective.
class Timer {
 public:
  Timer(Backend& backend, Communicator& world, double seconds) : backend_(backend), world_(world), seconds_(seconds) {}

  // `before` runs, untimed, ahead of every repeat (the block's time is then the sum of the
  // repeats' own).
  template <typename Work>
  double time_us(Work work, const std::function<void()>& before = {}) {
    return block_us(work, before, seconds_, 3, 1000);
  }

  // time_us for work long against a scheduler slice (a training step): a block ten times
  // as long, 5 to 50 repeats.
  template <typename Work>
  double long_block_us(Work work) {
    return block_us(work, {}, 10 * seconds_, 5, 50);
  }

  // For work long against a scheduler slice (a training step): the median of a run of
  // repeats lasting ten times seconds_per_figure (5 to 50 of them), averaged over the ranks,
  // so that one repeat another process disturbed does not count. Collective.
  template <typename Work>
  double median_us(Work work) {
    const int n = warm_and_count(work, 10 * seconds_, 5, 50);
    std::vector<double> times;
    for (int i = 0; i < n; ++i) {
      const Clock::time_point start = Clock::now();
      work();
      backend_.synchronize();
      times.push_back(since_us(start));
    }
    std::nth_element(times.begin(), times.begin() + n / 2, times.end());
    return world_.all_reduce_sum(times[n / 2]) / world_.size();
  }

 private:
  // Runs `work` twice (to warm first-touch pages and BLAS buffers, then to time it once on
  // every rank, as the work may communicate) and returns rank 0's count of repeats that
  // fill `seconds`, within [least, most], the same on every rank, after a barrier.
  template <typename Work>
  int warm_and_count(Work& work, double seconds, double least, double most) {
    work();
    backend_.synchronize();
    const Clock::time_point calibration = Clock::now();
    work();
    backend_.synchronize();
    const double once = std::max(since_us(calibration), 0.1);
    const double repeats = world_.rank() == 0 ? std::clamp(std::ceil(seconds * 1e6 / once), least, most) : 0;
    const int n = static_cast<int>(world_.all_reduce_sum(repeats));
    world_.barrier();
    return n;
  }

  template <typename Work>
  double block_us(Work& work, const std::function<void()>& before, double seconds, double least, double most) {
    const int n = warm_and_count(work, seconds, least, most);
    double total = 0;
    if (before) {
      for (int i = 0; i < n; ++i) {
        before();
        backend_.synchronize();
        const Clock::time_point start = Clock::now();
        work();
        backend_.synchronize();
        total += since_us(start);
      }
    } else {
      const Clock::time_point start = Clock::now();
      for (int i = 0; i < n; ++i) work();
      backend_.synchronize();
      total = since_us(start);
    }
    return world_.all_reduce_sum(total / n) / world_.size();
  }

  Backend& backend_;
  Communicator& world_;
  double seconds_;
};

// Weights and weight gradients for time_linear, cold as in a step, where every other
// layer's passes come between two of a Linear's own: each repeat takes the next of as many
// copies as fill 64 MiB (more than a last-level cache; at most 64 copies), carved from one
// arena each, filled once. A weight larger than that (cold anyway) gets arenas of its size.
class ColdWeights {
 public:
  explicit ColdWeights(Backend& backend) : backend_(backend) { reserve(int64_t{16} << 20); }  // 64 MiB of floats

  // The next copy of a weight of `elements`, in turn.
  float* w(int64_t elements) {
    reserve(elements);
    const int64_t copies = std::clamp<int64_t>(size_ / std::max<int64_t>(1, elements), 1, 64);
    last_ = next_++ % copies;
    return w_.data() + last_ * elements;
  }
  // The copy w() gave last, for its gradient.
  float* dw_of_last(int64_t elements) { return dw_.data() + last_ * elements; }

 private:
  void reserve(int64_t elements) {
    if (elements <= size_) return;
    w_ = DeviceBuffer(backend_, elements), dw_ = DeviceBuffer(backend_, elements);
    backend_.fill(w_.data(), 0.01f, elements);
    backend_.fill(dw_.data(), 0.0f, elements);
    size_ = elements;
  }

  Backend& backend_;
  DeviceBuffer w_, dw_;
  int64_t size_ = 0, next_ = 0, last_ = 0;
};

void time_linear(Backend& backend, Timer& timer, ColdWeights& cold, const LinearSize& s, LinearTiming& t) {
  const int64_t weight = s.out * s.in;
  const auto w = [&] { return cold.w(weight); };
  DeviceBuffer x(backend, s.rows * s.in), b(backend, s.out), y(backend, s.rows * s.out);
  DeviceBuffer dx(backend, s.rows * s.in), db(backend, s.out);
  backend.fill(x.data(), 0.5f, s.rows * s.in);
  backend.fill(y.data(), 0.25f, s.rows * s.out);  // stands in for dy
  const LinearShape shape{s.rows, s.in, s.out};
  t.rows = s.rows, t.in = s.in, t.out = s.out;
  t.forward_us = timer.time_us([&] { backend.linear_forward(y.data(), x.data(), w(), b.data(), shape); });
  t.input_grad_us = timer.time_us([&] {
    backend.linear_backward(dx.data(), nullptr, nullptr, y.data(), x.data(), w(), shape, GradWrite::kOverwrite,
                            GradWrite::kOverwrite);
  });
  t.weight_grad_us = timer.time_us([&] {
    float* weights = w();
    backend.linear_backward(nullptr, cold.dw_of_last(weight), db.data(), y.data(), x.data(), weights, shape,
                            GradWrite::kOverwrite, GradWrite::kOverwrite);
  });
}

// Point-to-point: ranks 2i and 2i+1 exchange a message each way, all pairs at once; a
// lone last rank waits. Half a round trip per message.
double time_p2p(Communicator& world, Timer& timer, int64_t bytes) {
  const int64_t n = std::max<int64_t>(1, bytes / 4);
  std::vector<float> out(n, 1.0f), in(n);
  const int r = world.rank(), peer = r ^ 1;
  const bool paired = peer < world.size();
  return timer.time_us([&] {
    if (!paired) return;
    if (r % 2 == 0) {
      world.send(out.data(), n, peer, 7);
      world.recv(in.data(), n, peer, 7);
    } else {
      world.recv(in.data(), n, peer, 7);
      world.send(out.data(), n, peer, 7);
    }
  }) / 2;
}

// A model of one Linear(1 → 2) with batch-sized data for it: what a training step costs
// beyond its ops.
struct TinyModel {
  Graph graph;
  Dataset data;
};

TinyModel tiny_model(int64_t samples) {
  Graph g;
  g.name = "overhead";
  g.values.push_back({"input", Shape{{kBatch, 1}}, -1, {0}});
  g.values.push_back({"output", Shape{{kBatch, 2}}, 0, {}});
  g.params.push_back({"weight", {2, 1}, {0.5f, -0.5f}, true});
  g.params.push_back({"bias", {2}, {0.0f, 0.0f}, true});
  Node n;
  n.name = "fc";
  n.kind = OpKind::kLinear;
  n.inputs = {0};
  n.outputs = {1};
  n.weight = 0, n.bias = 1;
  n.in_features = 1, n.out_features = 2;
  g.nodes.push_back(n);
  g.inputs = {0};
  g.outputs = {1};
  NpyArray x, y;
  x.path = "overhead features", x.type = NpyType::kFloat32, x.shape = {samples, 1};
  x.bytes.assign(static_cast<size_t>(samples) * 4, 0);
  y.path = "overhead labels", y.type = NpyType::kInt64, y.shape = {samples};
  y.bytes.assign(static_cast<size_t>(samples) * 8, 0);
  Result<Dataset> data = make_dataset(x, y, g, Targets::kClassIndices);
  PIPESHARD_CHECK(data.is_ok(), "the overhead model's data: " + data.status().message());
  return {std::move(g), std::move(*data)};
}

// The mean step of a one-process Trainer of the tiny model in `micro_batches`, in µs
// (every rank at once, each alone).
double tiny_step_us(Backend& backend, Timer& timer, int micro_batches) {
  const int64_t batch = 16;
  TinyModel m = tiny_model(batch);
  TrainConfig config;
  config.batch_size = batch;
  config.micro_batches = micro_batches;
  config.total_steps = 1 << 30;
  config.shuffle = false;
  config.optimizer.kind = OptimizerKind::kAdam;
  Result<std::unique_ptr<Trainer>> trainer = Trainer::create(m.graph, m.data, backend, config);
  PIPESHARD_CHECK(trainer.is_ok(), "the overhead model's trainer: " + trainer.status().message());
  return timer.time_us([&] { (*trainer)->step(); });
}

// One process's training of the whole model on batches of `rows` rows in `data`: the loss
// the model's output can train (cross-entropy over several classes, else MSE), Adam, the
// micro-batches given. False for a model of several inputs or outputs. The data are 8
// batches of standard-normal features and classes (or targets) that cycle, as in a
// training set; one constant row with class 0, learned within a few steps, priced train's
// step on real data +7 to +17 % (model A, one process, three profile-and-train pairs at 1
// and at 4 micro-batches; −4 to +14 % with these data).
bool whole_model_config(const Graph& g, int64_t rows, int micro_batches, TrainConfig& config, Dataset& data) {
  if (g.inputs.size() != 1 || g.outputs.size() != 1) return false;
  const int64_t width = g.values[g.inputs[0]].shape.per_sample_elements();
  const int64_t outputs = g.values[g.outputs[0]].shape.per_sample_elements();
  config.batch_size = rows;
  config.micro_batches = micro_batches;
  config.total_steps = 1 << 30;
  config.shuffle = false;
  config.optimizer.kind = OptimizerKind::kAdam;
  config.loss = outputs > 1 ? LossKind::kCrossEntropy : LossKind::kMse;
  const int64_t samples = 8 * rows;
  std::mt19937 random(1234);
  std::normal_distribution<float> normal;
  const auto normals = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = normal(random);
    return v;
  };
  data.samples = samples;
  data.features_per_sample = width;
  data.features = Rows::of_floats(normals(samples * width), width);
  if (config.loss == LossKind::kCrossEntropy) {
    std::vector<float> classes(static_cast<size_t>(samples));
    for (int64_t i = 0; i < samples; ++i) classes[static_cast<size_t>(i)] = static_cast<float>((i * 7) % outputs);
    data.targets_per_sample = 1;
    data.targets = Rows::of_floats(std::move(classes), 1, RowRule::kClassIndex, outputs);
  } else {
    data.targets_per_sample = outputs;
    data.targets = Rows::of_floats(normals(samples * outputs), outputs);
  }
  return true;
}

// compute_scale (planner/profile.h): every rank at once trains the whole model alone on
// its share of the batch (B/N rows, or B) in one micro-batch and in the most the plan may
// use, and with several ranks on the whole batch in one too (the rows a layout without
// replicas runs); each step less the profile's fixed costs over what predict_layout()
// makes of the same layout from the op figures measured before (each step the median of
// MeasureOptions::sweeps takes, the steps in turn) is compute_scale_by_rows at
// its micro-batch's rows (three or more: on their least-squares line in log rows), and all of
// them together (their sums) compute_scale. 1 and none
// when the model cannot be trained so, or would not fit in this host's memory N times over.
// With N > 1 ranks, the step in one micro-batch on ranks 0 … k − 1 alone, the others
// waiting, for k = 1 … N, gives `slowdown_by_busy_ranks` for this model (left empty when
// it cannot be trained): ranks that compute at once share cores, caches and memory
// bandwidth, as much more as the model's working set is larger than a GEMM's, and not at
// all while fewer compute than there are cores.
double calibrate_compute(Backend& backend, Communicator& world, Timer& timer, const MeasureOptions& o,
                         const MachineProfile& measured, std::vector<MachineProfile::RowsScale>& by_rows,
                         std::vector<double>& slowdown_by_busy_ranks, std::string& note) {
  const Graph& g = *o.model;
  const int64_t share = o.batch_size % world.size() == 0 ? o.batch_size / world.size() : o.batch_size;
  std::vector<std::pair<int64_t, int>> steps = {{share, 1}};  // (rows, micro-batches), the share's first
  if (const int most = divisors(share, o.max_micro_batches).back(); most > 1) steps.emplace_back(share, most);
  if (share != o.batch_size) steps.emplace_back(o.batch_size, 1);
  MachineProfile ops_only = measured;  // the ops alone: no fixed costs, unscaled
  ops_only.step_overhead_us = ops_only.micro_batch_overhead_us = 0;
  ops_only.compute_scale = 1;
  ops_only.compute_scale_by_rows.clear();
  // A trainer for each step, all made before any is timed, so that the sweeps take them in
  // turn: the scales by rows compare steps taken at different moments, which on a machine
  // whose speed wanders is the trend itself unless the moments are mixed.
  struct Calibration {
    int64_t rows;
    int micro_batches;
    std::unique_ptr<Dataset> data;  // the trainer reads it where it is
    std::unique_ptr<Trainer> trainer;
  };
  std::vector<Calibration> made;
  int64_t held = 0;  // bytes the trainers made so far hold, each rank
  for (auto [rows, m] : steps) {
    // Every rank decides alike: whether the config is one train runs, and fits, with the
    // ones made before it, in rank 0's figure of this host's memory shared N ways.
    TrainConfig config;
    Calibration c{rows, m, std::make_unique<Dataset>(), nullptr};
    std::vector<int64_t> need;
    if (whole_model_config(g, rows, m, config, *c.data)) need = Trainer::memory_per_stage(g, config, {}, backend);
    int64_t room = read_host_memory().available;
    world.broadcast_bytes(&room, sizeof room, 0);
    const bool fits = !need.empty() && (room < 0 || held + need.front() <= room / world.size());
    if (fits) {
      Result<std::unique_ptr<Trainer>> trainer = Trainer::create(g, *c.data, backend, config);
      if (trainer) c.trainer = std::move(*trainer);
    }
    if (world.all_reduce_sum(c.trainer != nullptr ? 0.0 : 1.0) > 0) {
      if (rows != share) break;  // the whole batch on every rank: its share's figures serve
      note = need.empty() ? "the model cannot be trained whole in one process, so compute_scale is 1"
                          : "the whole model does not fit in memory on every rank at once, so compute_scale is 1";
      return 1;
    }
    held += need.front();
    made.push_back(std::move(c));
  }
  const std::vector<double> step_us = median_of_sweeps(o.sweeps, [&] {
    std::vector<double> each;
    for (Calibration& c : made) each.push_back(timer.median_us([&] { c.trainer->step(); }));
    return each;
  });
  if (world.size() > 1) {
    Trainer& trainer = *made.front().trainer;  // the share in one micro-batch
    const int n = world.size();
    // Blocks of steps, not the median step: a step that shares its core loses scheduler
    // slices now and then, which the median would leave out. Which k ranks compute turns
    // each round (ranks r … r + k − 1, modulo N), and the figure is the mean of three
    // rounds: unbound ranks that outnumber the cores land two busy ones on one core in
    // some rounds and not in others (k = 2 of 4 on two cores: 1.0x to 1.9x).
    std::vector<double> sum(static_cast<size_t>(n), 0.0);
    for (int round = 0; round < 3; ++round) {
      const int turned = (world.rank() - round % n + n) % n;
      for (int k = 1; k <= n; ++k) {  // the mean over the ranks is the k busy ones' time times k / n
        sum[k - 1] += n / static_cast<double>(k) * timer.long_block_us([&] {
          if (turned < k) trainer.step();
        });
      }
    }
    std::vector<double>& curve = slowdown_by_busy_ranks;
    curve.assign(static_cast<size_t>(n), 1.0);
    for (int k = 2; k <= n; ++k) {  // more ranks computing cannot make one faster: a dip is noise
      curve[k - 1] = std::max(curve[k - 2], sum[k - 1] / sum[0]);
    }
  }
  double steps_us = 0, predicted_us = 0;
  std::vector<MachineProfile::RowsScale> scales;
  for (size_t i = 0; i < made.size(); ++i) {
    const int64_t rows = made[i].rows;
    const int m = made[i].micro_batches;
    Layout layout;
    layout.micro_batches = m;
    layout.schedule = "1f1b";
    LayoutSearchOptions search;
    search.batch_size = rows;
    search.kept_when_fused = kept_when_fused(backend);
    Result<Plan> plan = make_plan(g, "", layout_partition_options(layout, search));
    if (!plan) {
      note = "no plan of the whole model: " + plan.status().message();
      return 1;
    }
    const double ops_us = step_us[i] - measured.step_overhead_us - m * measured.micro_batch_overhead_us;
    const double predicted = predict_layout(g, *plan, layout, ops_only).step_us;
    steps_us += ops_us, predicted_us += predicted;
    if (predicted > 0) scales.push_back({rows / m, std::clamp(ops_us / predicted, 0.25, 4.0)});
  }
  std::sort(scales.begin(), scales.end(), [](const auto& a, const auto& b) { return a.rows < b.rows; });
  if (scales.size() > 2) smooth_in_log_rows(scales);
  by_rows = scales.size() > 1 ? scales : std::vector<MachineProfile::RowsScale>{};
  const double scale = predicted_us > 0 ? steps_us / predicted_us : 1;
  std::string rows_text;
  for (const MachineProfile::RowsScale& r : by_rows) {
    rows_text += fmt::format("{}{:.2f}x at {} rows", rows_text.empty() ? " (" : ", ", r.scale, r.rows);
  }
  if (!rows_text.empty()) rows_text += ")";
  note = fmt::format("a step of the whole model on {} rows takes {:.2f}x what its ops take alone{}{}", share, scale,
                     rows_text,
                     world.size() > 1 ? fmt::format(", and with 1 … {} ranks computing at once {:.2f}x of its time on "
                                                    "one alone",
                                                    world.size(), fmt::join(slowdown_by_busy_ranks, "x, "))
                                      : "");
  return std::clamp(scale, 0.25, 4.0);
}

// A 512³ GEMM on rank 0 alone, the others waiting as in a pipeline's bubble, against the
// same on every rank at once: the slowdown without a model's step to measure it on.
double gemm_all_busy_slowdown(Backend& backend, Communicator& world, Timer& timer) {
  const LinearShape shape{512, 512, 512};
  DeviceBuffer x(backend, 512 * 512), w(backend, 512 * 512), y(backend, 512 * 512);
  backend.fill(x.data(), 0.5f, 512 * 512);
  backend.fill(w.data(), 0.01f, 512 * 512);
  const double all_busy = timer.time_us([&] { backend.linear_forward(y.data(), x.data(), w.data(), nullptr, shape); });
  const double alone =  // the mean over the ranks is rank 0's time over their count
      world.size() * timer.time_us([&] {
        if (world.rank() == 0) backend.linear_forward(y.data(), x.data(), w.data(), nullptr, shape);
      });
  return std::max(1.0, all_busy / alone);
}

// The rows of a micro-batch in any layout on `ranks` processes: B/D/M for each D dividing N
// (and B) and each M dividing B/D up to `max_micro_batches`.
std::set<int64_t> micro_batch_rows(int ranks, int64_t batch_size, int max_micro_batches) {
  std::set<int64_t> rows;
  for (int d : divisors(ranks, ranks)) {
    if (batch_size % d != 0) continue;
    for (int m : divisors(batch_size / d, max_micro_batches)) rows.insert(batch_size / d / m);
  }
  return rows;
}

}  // namespace

MeasureOptions model_measure_options(const Graph& graph, int ranks, int64_t batch_size, int max_micro_batches) {
  MeasureOptions o;
  o.linear = model_linear_sizes(graph, ranks, batch_size, max_micro_batches);
  if (ranks > 1) {
    o.message_bytes =
        model_message_bytes(graph, ranks, batch_size, max_micro_batches, LayoutSearchOptions{}.bucket_bytes);
  }
  o.parameter_elements = model_parameter_elements(graph);
  o.model = &graph;
  o.batch_size = batch_size;
  o.max_micro_batches = max_micro_batches;
  return o;
}

std::vector<LinearSize> model_linear_sizes(const Graph& graph, int ranks, int64_t batch_size, int max_micro_batches) {
  const std::set<int64_t> rows = micro_batch_rows(ranks, batch_size, max_micro_batches);
  std::set<LinearSize> sizes;
  for (const Node& n : graph.nodes) {
    if (n.kind != OpKind::kLinear) continue;
    for (int t : divisors(ranks, ranks)) {
      for (int64_t r : rows) {
        if (t == 1) sizes.insert({r, n.in_features, n.out_features});
        if (t > 1 && n.out_features % t == 0) sizes.insert({r, n.in_features, n.out_features / t});
        if (t > 1 && n.in_features % t == 0) sizes.insert({r, n.in_features / t, n.out_features});
      }
    }
  }
  return {sizes.begin(), sizes.end()};
}

std::vector<int64_t> model_message_bytes(const Graph& graph, int ranks, int64_t batch_size, int max_micro_batches,
                                         int64_t bucket_bytes) {
  const std::vector<int64_t> fixed = MeasureOptions{}.message_bytes;
  if (ranks < 2) return fixed;
  const std::set<int64_t> rows = micro_batch_rows(ranks, batch_size, max_micro_batches);
  std::set<int64_t> widths;
  int64_t parameters = 0;
  for (const Node& n : graph.nodes) {
    if (n.kind == OpKind::kLinear) widths.insert(n.in_features), widths.insert(n.out_features);
  }
  for (int64_t e : model_parameter_elements(graph)) parameters += e;
  constexpr double kFloatBytes = 4;
  std::set<int64_t> sizes(fixed.begin(), fixed.end());
  // A buffer of `bytes` reduced over `group` ranks moves `share` · 2·(group − 1)/group of
  // it on the bus (share 1: all-reduce, 1/2: reduce-scatter or all-gather); over all ranks,
  // the buffer that moves as much.
  const auto reduced = [&](double bytes, int group, double share) {
    const double bus = share * 2.0 * (group - 1) / group * bytes;
    const double floats = bus * ranks / (2.0 * (ranks - 1)) / kFloatBytes;
    sizes.insert(static_cast<int64_t>(floats) * static_cast<int64_t>(kFloatBytes));  // whole floats, not over
  };
  for (int64_t r : rows) {
    for (int64_t w : widths) {
      const double bytes = kFloatBytes * static_cast<double>(r * w);
      sizes.insert(static_cast<int64_t>(bytes));  // a stage's activations, sent
      for (int t : divisors(ranks, ranks)) {
        if (t > 1) reduced(bytes, t, 1), reduced(bytes, t, 0.5);  // tensor-parallel collectives
      }
    }
  }
  for (int d : divisors(ranks, ranks)) {
    if (d < 2) continue;
    for (int k : divisors(ranks / d, ranks / d)) {  // P·T: the ranks one replica's model is split over
      const double bytes =
          std::min(kFloatBytes * static_cast<double>(parameters) / k, static_cast<double>(bucket_bytes));
      reduced(bytes, d, 1), reduced(bytes, d, 0.5);
    }
  }
  std::vector<int64_t> out;
  for (int64_t b : sizes) {
    if (b > 0 && (out.empty() || b > out.back() * 1.1)) out.push_back(b);
  }
  return out;
}

std::vector<int64_t> model_parameter_elements(const Graph& graph) {
  std::vector<int64_t> out;
  for (const Parameter& p : graph.params) {
    if (p.trainable) out.push_back(p.elements());
  }
  return out;
}

LinkCost fit_link(const std::vector<std::pair<double, double>>& points) {
  PIPESHARD_CHECK(!points.empty(), "fit_link: no points");
  // Weighted by 1/y²: the relative error of each point counts the same, so the small
  // messages, where the latency is all there is, are not drowned by the large ones.
  LineSums sums;
  for (auto [x, y] : points) sums.add(x, y, 1 / std::max(y * y, 1e-12));
  double slope = 0, intercept = 0;  // µs per byte, µs
  sums.line(slope, intercept);
  const auto largest = *std::max_element(points.begin(), points.end());
  if (!(slope > 0)) {
    slope = largest.second / std::max(largest.first, 1.0);
    intercept = 0;
  }
  if (intercept < 0) {  // through the origin instead
    intercept = 0;
    slope = sums.swxx > 0 ? sums.swxy / sums.swxx : slope;
  }
  return {intercept, 1e6 / slope, {}};
}

std::vector<double> median_of_sweeps(int sweeps, const std::function<std::vector<double>()>& take) {
  std::vector<std::vector<double>> takes;
  for (int s = 0; s < std::max(1, sweeps); ++s) takes.push_back(take());
  std::vector<double> medians(takes.front().size());
  for (size_t i = 0; i < medians.size(); ++i) {
    std::vector<double> of_i;
    for (const std::vector<double>& t : takes) of_i.push_back(t[i]);
    std::sort(of_i.begin(), of_i.end());
    const size_t n = of_i.size();
    medians[i] = n % 2 == 1 ? of_i[n / 2] : (of_i[n / 2 - 1] + of_i[n / 2]) / 2;
  }
  return medians;
}

void smooth_in_log_rows(std::vector<MachineProfile::RowsScale>& scales) {
  LineSums sums;
  for (const MachineProfile::RowsScale& r : scales) sums.add(std::log(static_cast<double>(r.rows)), r.scale, 1);
  double slope = 0, intercept = 0;
  if (!sums.line(slope, intercept)) return;
  for (MachineProfile::RowsScale& r : scales) {
    r.scale = std::clamp(intercept + slope * std::log(static_cast<double>(r.rows)), 0.25, 4.0);
  }
}

MachineProfile measure_profile(Backend& backend, Communicator& world, const MeasureOptions& o) {
  auto say = [&](const std::string& line) {
    if (world.rank() == 0 && o.progress) o.progress(line);
  };
  Timer timer(backend, world, o.seconds_per_figure);
  MachineProfile p;
  p.machine = o.machine;
  p.backend = backend.name();
  p.ranks = world.size();

  say(fmt::format("timing {} Linear shapes (forward, input and weight gradient), {} sweeps", o.linear.size(),
                  std::max(1, o.sweeps)));
  ColdWeights cold(backend);
  // The listed shapes, then the square whose rate serves shapes not listed (as large as the
  // listed ones, or 512³).
  std::vector<LinearSize> shapes = o.linear;
  shapes.push_back({512, 512, 512});
  int sweep = 0;
  const std::vector<double> linear_us = median_of_sweeps(o.sweeps, [&] {
    std::vector<double> us;  // forward, input gradient, weight gradient of each shape
    for (const LinearSize& size : shapes) {
      LinearTiming t;
      time_linear(backend, timer, cold, size, t);
      us.insert(us.end(), {t.forward_us, t.input_grad_us, t.weight_grad_us});
    }
    say(fmt::format("  sweep {} of {}", ++sweep, std::max(1, o.sweeps)));
    return us;
  });
  double best_rate = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const LinearSize& size = shapes[i];
    const LinearTiming t{size.rows, size.in, size.out, linear_us[3 * i], linear_us[3 * i + 1], linear_us[3 * i + 2]};
    if (t.forward_us > 0)
      best_rate = std::max(best_rate, 2.0 * static_cast<double>(t.rows * t.in * t.out) / t.forward_us * 1e6);
    if (i + 1 < shapes.size()) p.linear.push_back(t);
  }
  p.gemm_flops_per_s = best_rate;
  say("timing elementwise ops and the optimizer");
  const int64_t n = o.elementwise_elements;
  DeviceBuffer a(backend, n), b(backend, n), c(backend, n), d(backend, n);
  backend.fill(a.data(), -0.5f, n);
  const Activation relu{};
  const std::vector<int64_t> tensors = o.parameter_elements.empty() ? std::vector<int64_t>{n} : o.parameter_elements;
  std::vector<std::array<DeviceBuffer, 4>> state;  // [tensors] parameter, gradient, two moments
  double elements = 0;
  for (int64_t e : tensors) {
    state.push_back(
        {DeviceBuffer(backend, e), DeviceBuffer(backend, e), DeviceBuffer(backend, e), DeviceBuffer(backend, e)});
    elements += static_cast<double>(e);
  }
  AdamStep step;
  DeviceBuffer gx(backend, 64 * 512), gw(backend, 512 * 512), gy(backend, 64 * 512);
  const auto after_a_gemm = [&] { backend.linear_forward(gy.data(), gx.data(), gw.data(), nullptr, {64, 512, 512}); };
  const std::vector<double> rates = median_of_sweeps(o.sweeps, [&]() -> std::vector<double> {
    return {timer.time_us([&] { backend.activation_forward(b.data(), a.data(), n, relu); }),
            timer.time_us([&] { backend.add_forward(c.data(), a.data(), b.data(), n); }),
            timer.time_us(
                [&] {
                  for (size_t i = 0; i < tensors.size(); ++i) {
                    auto& [param, grad, m1, m2] = state[i];
                    backend.adam_step(param.data(), grad.data(), m1.data(), m2.data(), tensors[i], step);
                  }
                },
                after_a_gemm),
            timer.time_us([&] { backend.activation_forward(b.data(), a.data(), 1, relu); })};
  });
  const double relu_us = rates[0], add_us = rates[1], adam_us = rates[2];
  // relu: read 1, write 1; add: read 2, write 1 — bytes over time, the two together.
  p.elementwise_bytes_per_s = 4.0 * n * (2 + 3) / (relu_us + add_us) * 1e6;
  p.optimizer_params_per_s = elements / adam_us * 1e6;
  p.op_overhead_us = rates[3];

  say("timing a training step's fixed costs");
  const std::vector<double> tiny = median_of_sweeps(o.sweeps, [&]() -> std::vector<double> {
    return {tiny_step_us(backend, timer, 1), tiny_step_us(backend, timer, 4)};
  });
  const double one = tiny[0], four = tiny[1];
  p.micro_batch_overhead_us = std::max(0.0, (four - one) / 3);
  p.step_overhead_us = std::max(0.0, one - p.micro_batch_overhead_us);

  if (o.model != nullptr && o.batch_size > 0) {
    say("timing a step of the whole model on every rank at once");
    std::string note;
    std::vector<double> curve;
    p.compute_scale = calibrate_compute(backend, world, timer, o, p, p.compute_scale_by_rows, curve, note);
    if (!curve.empty()) p.slowdown_by_busy_ranks = curve, p.all_busy_slowdown = curve.back();
    say("  " + note);
  }
  if (world.size() > 1 && p.slowdown_by_busy_ranks.empty()) {
    p.all_busy_slowdown = gemm_all_busy_slowdown(backend, world, timer);
  }

  if (world.size() > 1) {
    say("timing messages between pairs of ranks and all-reduces over " + std::to_string(world.size()));
    const std::vector<double> us = median_of_sweeps(o.sweeps, [&] {
      std::vector<double> send_then_all_reduce;  // for each size
      for (int64_t bytes : o.message_bytes) {
        send_then_all_reduce.push_back(time_p2p(world, timer, bytes));
        std::vector<float> buffer(static_cast<size_t>(std::max<int64_t>(1, bytes / 4)), 1.0f);
        send_then_all_reduce.push_back(timer.time_us(
            [&] { world.all_reduce(buffer.data(), static_cast<int64_t>(buffer.size()), ReduceOp::kSum); }));
      }
      return send_then_all_reduce;
    });
    std::vector<std::pair<double, double>> p2p, all_reduce;
    const int g = world.size();
    for (size_t i = 0; i < o.message_bytes.size(); ++i) {
      const double bytes = static_cast<double>(o.message_bytes[i]);
      p2p.emplace_back(bytes, us[2 * i]);
      all_reduce.emplace_back(2.0 * (g - 1) / g * bytes, us[2 * i + 1]);  // bus bytes
    }
    for (size_t i = 0; i < p2p.size(); ++i) {
      say("  " + std::to_string(static_cast<int64_t>(p2p[i].first)) + " bytes: send " + std::to_string(p2p[i].second) +
          " us, all-reduce " + std::to_string(all_reduce[i].second) + " us");
    }
    p.p2p = fit_link(p2p);
    p.all_reduce = fit_link(all_reduce);
    // The points themselves too: the link is read between them (planner/profile.h).
    for (auto [link, timed] : {std::pair{&p.p2p, &p2p}, {&p.all_reduce, &all_reduce}}) {
      std::sort(timed->begin(), timed->end());
      for (auto [bytes, us] : *timed) {
        if (link->points.empty() || bytes > link->points.back().bytes) link->points.push_back({bytes, us});
      }
    }
  }
  return p;
}

}  // namespace pipeshard
