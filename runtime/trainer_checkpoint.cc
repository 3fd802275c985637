// The Trainer's checkpoints (runtime/trainer.h: save_checkpoint, load_checkpoint): whole-
// model tensors by name in the checkpoint file (runtime/checkpoint_file.h), gathered from
// every stage and shard on rank 0 when saving, and cut back into this rank's slices when
// loading, so that any layout resumes any other.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "common/atomic_file.h"
#include "runtime/checkpoint_file.h"
#include "runtime/trainer.h"

namespace pipeshard {
namespace {

constexpr char kCheckpointFile[] = "checkpoint.pipeshard";

const char* optimizer_name(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kAdamW: return "adamw";
  }
  return "?";
}

}  // namespace

// Every tensor is the whole model's, under its initializer name (runtime/checkpoint_file.h):
// no layout is recorded, so any layout can resume it.
Status Trainer::save_checkpoint(const std::string& dir, const CrashPoint& crash) {
  const Graph& full = rank_.full();
  std::vector<std::vector<float>> values;
  if (world_ == nullptr) {
    values = local_values();  // one process: local is whole
  } else {
    rank_.gather(local_values(), values, *world_, tensor_, false);
  }
  std::vector<std::vector<std::vector<float>>> slots(static_cast<size_t>(optimizer_->slots()));
  for (int s = 0; s < optimizer_->slots(); ++s) {
    if (world_ == nullptr) {
      slots[s] = local_slot(s);
    } else {
      rank_.gather(local_slot(s), slots[s], *world_, tensor_, true);
    }
  }
  if (world_ && world_->rank() != 0) return Status::ok();
  Checkpoint c{.step = steps_done(),
               .updates = optimizer_->updates(),
               .optimizer = optimizer_name(config_.optimizer.kind),
               .tensors = {}};
  if (scaler_.enabled()) {
    c.loss_scale = scaler_.scale();
    c.loss_scale_good_steps = scaler_.good_steps();
  }
  // Parameters no node uses keep their file values.
  for (size_t p = 0; p < full.params.size(); ++p) {
    c.tensors.push_back({full.params[p].name, "value", values[p].empty() ? full.params[p].data : std::move(values[p])});
  }
  for (size_t s = 0; s < slots.size(); ++s) {
    for (size_t p = 0; p < full.params.size(); ++p) {
      if (full.params[p].trainable && !slots[s][p].empty()) {
        c.tensors.push_back({full.params[p].name, "slot" + std::to_string(s), std::move(slots[s][p])});
      }
    }
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::error("cannot create checkpoint folder '" + dir + "'");
  // Temporary files of writers that were killed (write_file_atomically names them
  // <file>.tmp<pid>): each would otherwise stay for good.
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    if (e.path().filename().string().rfind(std::string(kCheckpointFile) + ".tmp", 0) == 0) fs::remove(e.path(), ec);
  }
  return write_file_atomically((fs::path(dir) / kCheckpointFile).string(), encode_checkpoint(c), crash);
}

Status Trainer::load_checkpoint(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / kCheckpointFile).string();
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(path + ": no checkpoint here");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return Status::error(path + ": cannot read the checkpoint");
  return load_checkpoint_bytes(bytes, path);
}

Status Trainer::load_checkpoint_bytes(std::string_view bytes, const std::string& label) {
  // Every checksum is checked before anything is used: a damaged file changes nothing.
  Result<Checkpoint> c = decode_checkpoint(bytes);
  if (!c) return c.status().with_context(label);
  return restore(*c).with_context(label);
}

Status Trainer::restore(const Checkpoint& c) {
  if (c.optimizer != optimizer_name(config_.optimizer.kind)) {
    return Status::error("written with optimizer '" + c.optimizer + "', this run uses '" +
                         optimizer_name(config_.optimizer.kind) + "'");
  }
  // Whole-model tensors by name and role.
  const Graph& full = rank_.full();
  std::unordered_map<std::string, int> by_name;
  for (size_t i = 0; i < full.params.size(); ++i) by_name[full.params[i].name] = static_cast<int>(i);
  const int slot_count = optimizer_->slots();
  std::vector<std::vector<const std::vector<float>*>> tensors(  // [1 + slots][params]: value, then each slot
      static_cast<size_t>(slot_count + 1), std::vector<const std::vector<float>*>(full.params.size(), nullptr));
  for (const CheckpointTensor& t : c.tensors) {
    auto it = by_name.find(t.name);
    if (it == by_name.end()) return Status::error("tensor '" + t.name + "' is not in this model");
    if (static_cast<int64_t>(t.data.size()) != full.params[it->second].elements()) {
      return Status::error("tensor '" + t.name + "' has the wrong size");
    }
    int index = -1;  // 0: value, 1 + s: optimizer slot s
    if (t.role == "value") {
      index = 0;
    } else if (t.role.rfind("slot", 0) == 0 && full.params[it->second].trainable) {
      // from_chars, unlike atoi, has defined results for any digits ("slot99999999999").
      int s = -1;
      const char* last = t.role.data() + t.role.size();
      const std::from_chars_result read = std::from_chars(t.role.data() + 4, last, s);
      if (read.ec != std::errc() || read.ptr != last || t.role != "slot" + std::to_string(s) || s < 0 ||
          s >= slot_count) {
        return Status::error("optimizer state does not match this optimizer");
      }
      index = 1 + s;
    } else {
      return Status::error("unknown tensor role '" + t.role + "'");
    }
    // Two copies of one tensor would leave which one is restored to the file's order.
    if (tensors[index][it->second]) return Status::error("tensor '" + t.name + "' (" + t.role + ") appears twice");
    // Checksums prove the bytes are the ones written, not that the run was sound when it
    // wrote them: resuming from weights of inf or NaN would only fail later, as a
    // divergence. (Optimizer state may hold inf and go on: Adam's second moment of a
    // gradient above 1.8e19 overflows, and divides the step to 0.)
    const auto bad = std::find_if(t.data.begin(), t.data.end(), [](float v) { return !std::isfinite(v); });
    if (index == 0 && bad != t.data.end()) {
      return Status::error("tensor '" + t.name + "' (" + t.role + ") holds " + (std::isnan(*bad) ? "NaN" : "inf") +
                           " at flat index " + std::to_string(bad - t.data.begin()) +
                           "; a checkpoint's tensors must be finite numbers");
    }
    tensors[index][it->second] = &t.data;
  }
  // This rank's slices.
  const Graph& g = rank_.graph();
  Graph local = g;
  std::vector<std::vector<float>> slots(static_cast<size_t>(slot_count),
                                        std::vector<float>(static_cast<size_t>(program_->trainable_elements())));
  for (size_t q = 0; q < g.params.size(); ++q) {
    const int p = rank_.full_param(static_cast<int>(q));
    if (!tensors[0][p]) return Status::error("has no values for '" + full.params[p].name + "'");
    local.params[q].data = rank_.slice(static_cast<int>(q), *tensors[0][p]);
    const int64_t offset = program_->parameter_offset(static_cast<int>(q));
    if (offset < 0) continue;
    for (int s = 0; s < slot_count; ++s) {
      if (!tensors[1 + s][p]) {
        if (c.step == 0) continue;
        return Status::error("has no optimizer state for '" + full.params[p].name + "'");
      }
      const std::vector<float> mine = rank_.slice(static_cast<int>(q), *tensors[1 + s][p]);
      std::copy(mine.begin(), mine.end(), slots[s].begin() + offset);
    }
  }
  program_->upload_parameters(local);
  if (zero()) {  // the whole state is read; this replica keeps its slices
    for (std::vector<float>& slot : slots) slot = zero()->to_owned(slot);
  }
  optimizer_->restore(c.step, c.updates, slots);
  // A dynamic scale goes on from where the run was; a static one is the flag's; a file
  // without a scale (a run without scaling) starts this run's scaling afresh.
  scaler_.restore(c.loss_scale, c.loss_scale_good_steps);
  return Status::ok();
}

}  // namespace pipeshard
