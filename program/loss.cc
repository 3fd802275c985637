#include "program/loss.h"

namespace pipeshard {

bool ends_in_log_softmax(const Graph& g) {
  if (g.outputs.empty()) return false;
  const int producer = g.values[g.outputs[0]].producer;
  return producer >= 0 && g.nodes[producer].kind == OpKind::kLogSoftmax;
}

double apply_loss(Program& program, LossKind kind, bool log_probs, const float* targets, int64_t batch,
                  int64_t global_samples) {
  const Shape& shape = program.output_shape(0);
  const int64_t per_sample = shape.per_sample_elements();
  if (kind == LossKind::kCrossEntropy) {
    return program.backend().cross_entropy(program.output_gradient(0), program.output(0), targets, batch, per_sample,
                                           static_cast<double>(global_samples), log_probs);
  }
  return program.backend().mean_squared_error(program.output_gradient(0), program.output(0), targets,
                                              batch * per_sample, static_cast<double>(global_samples) * per_sample);
}

}  // namespace pipeshard
