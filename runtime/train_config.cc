#include "runtime/train_config.h"

#include "schedule/registry.h"

namespace pipeshard {
namespace {

std::string samples_text(int64_t n) { return std::to_string(n) + (n == 1 ? " sample" : " samples"); }

// BatchNorm trains on batch statistics: each micro-batch alone would differ from one
// process, and one value per channel has no variance.
Status check_batchnorm(const TrainConfig& config, const ProcessLayout& layout, const Graph& graph) {
  const int64_t d = layout.replicas, m = config.micro_batches;
  const int64_t micro = config.batch_size / d / m;
  for (const Node& n : graph.nodes) {
    if (n.kind != OpKind::kBatchNorm) continue;
    const Shape& s = graph.values[n.inputs[0]].shape;
    const int64_t stat_batch = config.sync_batchnorm ? config.batch_size : micro;
    if (m > 1) {
      return Status::invalid("micro_batches", "node '" + n.name + "' (BatchNorm) would normalise each of the " +
                                                  std::to_string(m) +
                                                  " micro-batches alone, unlike one process; use one micro-batch");
    }
    if (stat_batch * (s.per_sample_elements() / s.dims[1]) < 2) {
      return Status::invalid(
          "batch_size",
          "node '" + n.name + "' (BatchNorm) needs more than one value per channel to train, and " +
              (d > 1 && !config.sync_batchnorm
                   ? "each of the " + std::to_string(d) + " replicas normalises only its " + samples_text(micro) +
                         "; use a larger batch, or BatchNorm statistics synchronised over the replicas"
                   : "the batch gives it " + std::to_string(stat_batch) + "; use a larger batch"));
    }
  }
  return Status::ok();
}

}  // namespace

Status check_train_config(const TrainConfig& config, const ProcessLayout& layout, const Graph& graph, int64_t samples) {
  const int64_t d = layout.replicas, m = config.micro_batches;
  if (config.loss == LossKind::kCrossEntropy && graph.outputs.size() == 1) {
    const Shape& out = graph.values[graph.outputs[0]].shape;
    if (out.rank() == 2 && out.features() == 1) {  // a softmax over one class is 1: nothing would train
      return Status::invalid("loss",
                             "cross-entropy over the model's one output is 0 whatever the weights: a model with one "
                             "output is a regression model; train it on float32 targets with the mean-squared-error "
                             "loss");
    }
  }
  if (config.batch_size < 1 || config.batch_size > kMaxBatchSize) {
    return Status::invalid("batch_size", "the batch size must be between 1 and " + std::to_string(kMaxBatchSize) +
                                             ", not " + std::to_string(config.batch_size));
  }
  if (config.batch_size % d != 0) {
    return Status::invalid("batch_size", "a batch of " + samples_text(config.batch_size) + " does not divide among " +
                                             std::to_string(d) + " data-parallel replicas");
  }
  if (config.zero < 0 || config.zero > 2) {
    return Status::invalid("zero", "the ZeRO stage must be 0, 1 or 2, not " + std::to_string(config.zero));
  }
  if (Status s = check_loss_scaling(config.loss_scaling); !s) return Status::invalid("loss_scaling", s.message());
  if (m < 1) return Status::invalid("micro_batches", "there must be at least one micro-batch");
  if (Status s = check_schedule_counts(config.pipeline_schedule, layout.stages, m, config.virtual_stages); !s) {
    return s.setting().empty() ? Status::invalid("pipeline_schedule", s.message()) : s;
  }
  const ScheduleInfo& schedule = *find_schedule(config.pipeline_schedule);
  if (const int v = chunks_per_stage_of(schedule, config.virtual_stages); v > 1 && layout.stages < 2) {
    return Status::invalid("pipeline_schedule", "schedule '" + schedule.name + "' places " + std::to_string(v) +
                                                    " model chunks on each pipeline stage: it needs 2 or more stages");
  }
  if (config.cuda_graph) {
    if (layout.world_size() > 1) {
      return Status::invalid("cuda_graph", "a recorded step (a CUDA graph) runs in one process so far");
    }
    for (const Node& n : graph.nodes) {
      if (n.kind == OpKind::kDropout) {
        return Status::invalid("cuda_graph", "node '" + n.name +
                                                 "' (Dropout) draws new masks every step, which a recorded step "
                                                 "cannot; train this model without recording");
      }
    }
  }
  const int64_t local_batch = config.batch_size / d;
  if (local_batch % m != 0) {
    return Status::invalid("micro_batches", std::to_string(m) + " micro-batches do not divide the " +
                                                samples_text(local_batch) + " each replica gets per step (a batch of " +
                                                std::to_string(config.batch_size) +
                                                (d > 1 ? " over " + std::to_string(d) + " replicas)" : ")"));
  }
  if (config.grad_accum < 1) {
    return Status::invalid("grad_accum",
                           "a step must accumulate at least one batch, not " + std::to_string(config.grad_accum));
  }
  if (samples < config.batch_size) {
    return Status::invalid("batch_size", "the data has " + samples_text(samples) + ", fewer than one batch of " +
                                             std::to_string(config.batch_size));
  }
  return check_batchnorm(config, layout, graph);
}

int64_t micro_batch_rows(const TrainConfig& config, const ProcessLayout& layout) {
  return config.batch_size / layout.replicas / config.micro_batches;
}

}  // namespace pipeshard
