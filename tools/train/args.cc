// The flags of `train` (tools/train/args.h).
#include "tools/train/args.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "backend/registry.h"
#include "comm/device_groups.h"
#include "common/cli.h"
#include "schedule/registry.h"

namespace pipeshard::train_cli {
namespace {

// What --device may say: the backend registry's rows.
std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const BackendKind& kind : backend_kinds()) names.push_back(kind.name);
  return names;
}

// What --gpu-comm may say: the device-group kinds that carry a device's memory.
std::vector<std::string> device_group_names() {
  std::vector<std::string> names;
  for (const DeviceGroupKind& kind : device_group_kinds()) {
    if (kind.carries_memory(BackendMemory::kDevice)) names.push_back(kind.name);
  }
  return names;
}

// The model, the data and the optimization: what is trained, on what, how.
void define_training(CLI::App& app, Args& a) {
  app.add_option("model", a.model, "ONNX model to train (as written by torch.onnx.export)")->required();
  app.add_option("--data", a.data,
                 "features, float32 .npy of shape [N, ...]: a file, or a folder or glob of shards (in name "
                 "order), mapped, not read")
      ->required();
  app.add_option("--labels", a.labels,
                 "int64/int32 class ids [N] (cross-entropy) or float32 targets (mse): a file, folder or glob")
      ->required();
  app.add_option("--eval-data", a.eval_data, "features to evaluate on after each epoch");
  app.add_option("--eval-labels", a.eval_labels, "labels of --eval-data");
  app.add_option("--loss", a.loss, "cross-entropy (default) or mse")->check(CLI::IsMember({"cross-entropy", "mse"}));
  app.add_option("--optimizer", a.optimizer, "sgd (default), adam or adamw")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}));
  app.add_option("--lr", a.lr, "learning rate (default 0.01 for sgd, 0.001 for adam/adamw)");
  app.add_option("--momentum", a.momentum, "SGD momentum (default 0)");
  app.add_flag("--nesterov", a.nesterov, "SGD with Nesterov momentum");
  app.add_option("--betas", a.betas, "Adam/AdamW betas B1,B2 (default 0.9,0.999)");
  app.add_option("--eps", a.eps, "Adam/AdamW epsilon (default 1e-8)");
  app.add_option("--weight-decay", a.weight_decay, "weight decay (default 0; 0.01 for adamw)");
  app.add_option("--lr-schedule", a.schedule, "constant (default), warmup or cosine")
      ->check(CLI::IsMember({"constant", "warmup", "cosine"}));
  app.add_option("--warmup-steps", a.warmup, "steps of linear warm-up (default 0)");
  app.add_option("--clip-grad-norm", a.clip, "clip the gradient's global L2 norm to this (default off)");
  app.add_option("--batch-size", a.batch_size, "samples per step (default 32)");
  app.add_option("--grad-accum", a.grad_accum,
                 "accumulate K batches per step: exactly a K-times larger batch (default 1)");
  auto* steps = app.add_option("--steps", a.steps, "optimizer steps to run");
  app.add_option("--epochs", a.epochs, "epochs to run (default 1)")->excludes(steps);
  app.add_flag("--no-shuffle", a.no_shuffle, "take batches in file order");
  app.add_option("--seed", a.seed, "seed of the shuffling and dropout (default 0)");
}

// What the run writes, and where it computes.
void define_outputs_and_device(CLI::App& app, Args& a) {
  app.add_option("--metrics", a.metrics, "write one JSON object per step to this .jsonl file");
  app.add_option("--save", a.save, "write the trained model to this ONNX file");
  app.add_option("--checkpoint", a.checkpoint,
                 "folder for checkpoints (optimizer state included); SIGINT or SIGTERM writes one after the current "
                 "step and stops (exit status 130 or 143)");
  app.add_option("--checkpoint-every", a.checkpoint_every,
                 "steps between checkpoints (default: once per epoch and at the end)");
  app.add_option("--resume", a.resume, "continue the run saved in this checkpoint folder");
  app.add_option("--device", a.device,
                 "cpu (default) or cuda: each process computes on GPU (its rank on the machine) mod (GPUs there), "
                 "so several processes may share one")
      ->check(CLI::IsMember(backend_names()));
  app.add_option("--precision", a.precision,
                 "fp32 (default) or, with --device cuda: tf32 (tensor-core GEMMs, fp32 accumulation), bf16 or fp16 "
                 "(GEMMs on 16-bit copies of their operands, fp32 accumulation; weights, optimizer state and every "
                 "other operation stay fp32)")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16", "fp16"}));
  app.add_option("--gpu-comm", a.gpu_comm,
                 "with --device cuda under mpirun, how GPU processes exchange tensors: staged (default: through host "
                 "memory over MPI, any number of processes per GPU) or nccl (data- and tensor-parallel groups over "
                 "NCCL, one GPU per process; pipeline stages stay staged; not yet verified on a multi-GPU machine)")
      ->check(CLI::IsMember(device_group_names()));
  app.add_option(
      "--check-equivalence", a.check_equivalence,
      "train K steps in this layout and in one process (on the same device and precision) on the same data, "
      "print the largest loss and weight difference and the tensor furthest from the reference, and stop: exit "
      "status 0 when they agree to float rounding (1e-5 of each loss, and of each tensor's largest value or 1; "
      "under adam/adamw a tensor whose gradient is rounding noise may differ by Adam's step bound), 1 when they "
      "do not");
}

// The layout across processes, what is observed, and the rest.
void define_layout_and_the_rest(CLI::App& app, Args& a) {
  app.add_option("--stages", a.stages, "pipeline stages P (mpirun -np P·T·D; default 1)");
  app.add_option("--tensor-parallel", a.tensor_parallel, "tensor-parallel shards T (mpirun -np P·T·D; default 1)");
  app.add_option("--micro-batches", a.micro_batches, "pipeline micro-batches M per replica batch (default 1)");
  app.add_option("--schedule", a.pipeline_schedule,
                 "pipeline schedule: " + schedule_names_text() + " (default 1f1b; partition --show-schedule shows it)")
      ->check(CLI::IsMember(schedule_names()));
  app.add_option("--virtual-stages", a.virtual_stages,
                 "model chunks per stage for a schedule that lets them be chosen (interleaved; default 2): the "
                 "model is cut into P·v chunks, chunk c on stage c mod P");
  app.add_option("--balance", a.balance, "cut stages balancing params (default), flops or memory")
      ->check(CLI::IsMember({"params", "flops", "memory"}));
  app.add_option("--trace", a.trace,
                 "write a Chrome/Perfetto timeline of every rank (forward, backward, send, recv, all-reduce, "
                 "optimizer per micro-batch) to this .json file");
  app.add_option("--tensorboard", a.tensorboard,
                 "write TensorBoard event files to this folder (created if needed): loss, learning rate, "
                 "samples/s and each stage's time per step, eval loss and accuracy per epoch, the pipeline "
                 "bubble; view with tensorboard --logdir DIR");
  app.add_option("--plot", a.plot,
                 "at the end, draw the loss per step (and eval loss and accuracy per epoch) to this .svg or .png "
                 "(needs matplotlib)")
      ->excludes("--check-equivalence");
  app.add_option("--bucket-mb", a.bucket_mb,
                 "data parallel: all-reduce gradients in buckets of this many MB while backward runs (default 25, "
                 "as PyTorch DDP; a size above the model's gradients gives one all-reduce after backward)");
  app.add_option("--comm-timeout", a.comm_timeout,
                 "under mpirun: a rank that waits this many seconds on others during a step ends the job, naming "
                 "what it waited for and on which ranks (evaluation and checkpoints get 10 times as long; default "
                 "60, 0: wait forever)");
  app.add_option("--loss-scale", a.loss_scale,
                 "multiply the loss's gradient by a power of two before backward and divide the gradients by it "
                 "after: dynamic (the default with --precision fp16: start at 65536, halve and skip the step when "
                 "a gradient overflows, double after 2000 good steps), none (the default otherwise), or a fixed "
                 "power of two such as 1024");
  app.add_option("--on-nonfinite", a.on_nonfinite,
                 "when the loss or a gradient is inf or NaN: stop (default), naming the step and the first layer in "
                 "backward order whose gradient went bad, or skip the step and go on; either way the step changes "
                 "no weight")
      ->check(CLI::IsMember({"stop", "skip"}));
  app.add_flag("--cuda-graph", a.cuda_graph,
               "with --device cuda in one process: from the second step on, run each forward and backward as a "
               "CUDA graph of the first step's kernels, one launch instead of one per kernel (for small models, "
               "where launches cost more than the work); the results are the same, bit for bit");
  app.add_flag("--keep-activations", a.keep_activations,
               "keep each activation function's output from forward to backward instead of recomputing it there "
               "from its input (default: recompute, which holds one tensor less per activation for one more "
               "elementwise pass); the results are the same, bit for bit");
  app.add_flag("--sync-batchnorm", a.sync_batchnorm,
               "BatchNorm statistics over the global batch of all replicas, which makes data parallelism equal to "
               "one process (default: each replica's slice, as PyTorch DDP)");
  app.add_option("--zero", a.zero,
                 "ZeRO stage: 0 (default: every data-parallel replica holds the whole optimizer state), 1 (each "
                 "replica holds the state of 1/D of the parameters: gradients are reduce-scattered, each replica "
                 "updates its slice and the weights are all-gathered) or 2 (also 1/D of the gradients, reduced "
                 "after every backward pass, each micro-batch's too); the same training, to float rounding");
  app.add_option("--layout", a.layout,
                 "auto: the layout planner chooses --stages, --tensor-parallel, --micro-batches, --schedule, "
                 "--virtual-stages, --keep-activations and --zero for the mpirun -np it runs under, the fastest "
                 "predicted that fits in memory (partition --plan lists them all), and the end of the run shows its "
                 "measured step time beside the prediction")
      ->check(CLI::IsMember({"auto"}));
  app.add_option("--profile", a.profile,
                 "with --layout auto: the machine profile to plan with (the profile tool's profile.json); default: "
                 "measure this machine first (3 to 40 s for the benchmark's models on 1 to 4 processes here)");
}

}  // namespace

void define(CLI::App& app, Args& a) {  // in the order --help lists them
  define_training(app, a);
  define_outputs_and_device(app, a);
  define_layout_and_the_rest(app, a);
}

Status parse_command_line(int argc, char** argv, bool prints, Args& a, std::optional<int>& answered) {
  CLI::App app{
      "Train an ONNX multilayer perceptron on NumPy data, step for step as PyTorch would, and write the trained\n"
      "model back as ONNX; under mpirun, across processes (data, pipeline and tensor parallel). Examples:\n"
      "  train models/simple_digits.onnx --data data/digits_features.npy --labels data/digits_labels.npy \\\n"
      "        --optimizer adamw --epochs 5 --save trained.onnx\n"
      "  mpirun -np 4 train models/simple_digits.onnx --data ... --labels ... --stages 2 --micro-batches 4",
      "train"};
  define(app, a);
  Status parsed = Status::ok();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {
      answered = prints ? app.exit(e) : 0;
      return Status::ok();
    }
    parsed = Status::error(std::string(e.what()) + " (see train --help)");
  }
  a.lr_given = app.count("--lr") > 0;
  a.momentum_given = app.count("--momentum") > 0;
  a.eps_given = app.count("--eps") > 0;
  a.weight_decay_given = app.count("--weight-decay") > 0;
  a.pipeline_schedule_given = app.count("--schedule") > 0;
  a.balance_given = app.count("--balance") > 0;
  if (!parsed) return parsed;
  if (a.layout == "auto") {
    for (const char* flag : {"--stages", "--tensor-parallel", "--micro-batches", "--schedule", "--virtual-stages",
                             "--keep-activations", "--zero"}) {
      if (app.count(flag) > 0) {
        return Status::error(std::string("--layout auto chooses ") + flag + " itself: leave it out (see train --help)");
      }
    }
  } else if (app.count("--profile") > 0) {
    return Status::error("--profile is for --layout auto (see train --help)");
  }
  return parsed;
}

namespace {

// "--save", "--save and --metrics", "--save, --metrics and --trace".
std::string flag_list(const std::vector<std::string>& flags) {
  std::string out;
  for (size_t i = 0; i < flags.size(); ++i) out += (i == 0 ? "" : i + 1 == flags.size() ? " and " : ", ") + flags[i];
  return out;
}

// Flags that this run would ignore, refused instead (a run that ends with status 0 must
// have done what its flags said). --check-equivalence trains K steps to compare and stops:
// it writes no file, evaluates nothing, and its one-process run starts from the model
// file's weights. With one pipeline stage every schedule is forward then backward and
// there is no cut to balance.
Status check_flags_take_effect(const Args& a) {
  if (a.check_equivalence < 0) return Status::error("--check-equivalence takes a positive number of steps");
  if (a.check_equivalence > 0) {
    std::vector<std::string> unused;
    for (const auto& [flag, value] : {std::pair<const char*, const std::string&>{"--save", a.save},
                                      {"--metrics", a.metrics},
                                      {"--trace", a.trace},
                                      {"--checkpoint", a.checkpoint},
                                      {"--tensorboard", a.tensorboard},
                                      {"--eval-data", a.eval_data}}) {
      if (!value.empty()) unused.push_back(flag);
    }
    if (!unused.empty()) {
      return Status::error(flag_list(unused) + (unused.size() == 1 ? " has" : " have") +
                           " no effect with --check-equivalence, which trains K steps to compare the layout with one "
                           "process, writes nothing and stops; drop " +
                           (unused.size() == 1 ? "it" : "them") + " or --check-equivalence");
    }
    if (!a.resume.empty()) {
      return Status::error(
          "--resume and --check-equivalence go apart: the check's one-process run starts from the model file's "
          "weights, and the layout must start there too");
    }
  }
  if (a.stages == 1 && (a.pipeline_schedule_given || a.balance_given)) {
    const std::string flag = a.pipeline_schedule_given ? "--schedule " + a.pipeline_schedule : "--balance " + a.balance;
    const char* why = a.pipeline_schedule_given ? "every schedule runs forward then backward there"
                                                : "there is no cut between stages to balance";
    return Status::error(flag + " has no effect with one pipeline stage (" + why +
                         "): give --stages P under mpirun, or drop it");
  }
  return Status::ok();
}

}  // namespace

Result<TrainConfig> make_config(const Args& a) {
  PIPESHARD_RETURN_IF_ERROR(check_flags_take_effect(a));
  TrainConfig c;
  c.loss = a.loss == "mse" ? LossKind::kMse : LossKind::kCrossEntropy;
  OptimizerConfig& o = c.optimizer;
  o.kind = a.optimizer == "adam"    ? OptimizerKind::kAdam
           : a.optimizer == "adamw" ? OptimizerKind::kAdamW
                                    : OptimizerKind::kSgd;
  const bool sgd = o.kind == OptimizerKind::kSgd;
  if (!sgd && (a.momentum_given || a.nesterov))
    return Status::error("--momentum and --nesterov are SGD settings; " + a.optimizer + " has none");
  if (sgd && (!a.betas.empty() || a.eps_given))
    return Status::error("--betas and --eps are Adam/AdamW settings; sgd has none");
  o.lr = static_cast<float>(a.lr_given ? a.lr : (sgd ? 0.01 : 0.001));
  o.momentum = static_cast<float>(a.momentum);
  o.nesterov = a.nesterov;
  if (o.nesterov && o.momentum <= 0) return Status::error("--nesterov needs a positive --momentum");
  o.weight_decay =
      static_cast<float>(a.weight_decay_given ? a.weight_decay : (o.kind == OptimizerKind::kAdamW ? 0.01 : 0.0));
  if (a.eps_given) o.eps = static_cast<float>(a.eps);
  if (a.eps_given && !(a.eps > 0)) return Status::error("--eps must be positive");
  if (!a.betas.empty()) {
    float b1 = 0, b2 = 0;
    char extra = 0;
    if (std::sscanf(a.betas.c_str(), "%f,%f%c", &b1, &b2, &extra) != 2 || !(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1)) {
      return Status::error("--betas must be two numbers in [0, 1) like 0.9,0.999, got '" + a.betas + "'");
    }
    o.beta1 = b1;
    o.beta2 = b2;
  }
  if (!(o.lr > 0) || !std::isfinite(o.lr)) return Status::error("--lr must be positive");
  if (o.momentum < 0 || o.weight_decay < 0 || a.clip < 0)
    return Status::error("--momentum, --weight-decay and --clip-grad-norm cannot be negative");
  c.schedule = a.schedule == "cosine"   ? LrSchedule::kCosine
               : a.schedule == "warmup" ? LrSchedule::kWarmup
                                        : LrSchedule::kConstant;
  c.warmup_steps = a.warmup;
  if (a.warmup < 0) return Status::error("--warmup-steps cannot be negative");
  c.batch_size = a.batch_size;
  c.grad_accum = a.grad_accum;
  if (a.steps < 0 || a.epochs < 0) return Status::error("--steps and --epochs must be positive");
  c.shuffle = !a.no_shuffle;
  c.seed = a.seed;
  c.clip_grad_norm = a.clip;
  c.micro_batches = a.micro_batches;
  c.pipeline_schedule = a.pipeline_schedule;
  c.virtual_stages = a.virtual_stages;
  c.balance = a.balance == "flops"    ? BalanceBy::kFlops
              : a.balance == "memory" ? BalanceBy::kMemory
                                      : BalanceBy::kParams;
  c.sync_batchnorm = a.sync_batchnorm;
  c.zero = a.zero;  // check_train_config() checks it
  c.cuda_graph = a.cuda_graph;
  c.keep_activations = a.keep_activations;
  c.on_nonfinite = a.on_nonfinite == "skip" ? NonFinite::kSkip : NonFinite::kStop;
  const std::string scaling = a.loss_scale.empty() ? (a.precision == "fp16" ? "dynamic" : "none") : a.loss_scale;
  if (scaling == "dynamic") {
    c.loss_scaling.mode = LossScaling::Mode::kDynamic;
  } else if (scaling != "none") {
    double value = 0;
    const auto [end, ec] = std::from_chars(scaling.data(), scaling.data() + scaling.size(), value);
    c.loss_scaling.mode = LossScaling::Mode::kStatic;
    c.loss_scaling.initial = value;
    if (ec != std::errc() || end != scaling.data() + scaling.size() || !check_loss_scaling(c.loss_scaling)) {
      return Status::error(
          "--loss-scale must be dynamic, none or a power of two from 2^-64 to 2^64 (such as 1024), "
          "not '" +
          a.loss_scale + "'");
    }
  }
  if (!(a.bucket_mb > 0) || a.bucket_mb > 1e6) return Status::error("--bucket-mb must be a positive size in MB");
  c.bucket_bytes = static_cast<int64_t>(a.bucket_mb * (1 << 20));
  return c;
}

std::string flag_message(const Status& s) {
  static const FlagNames kFlags = {{"batch_size", "--batch-size"},
                                   {"micro_batches", "--micro-batches"},
                                   {"grad_accum", "--grad-accum"},
                                   {"pipeline_schedule", "--schedule"},
                                   {"loss_scaling", "--loss-scale"},
                                   {"cuda_graph", "--cuda-graph"},
                                   {"sync_batchnorm", "--sync-batchnorm"},
                                   {"stages", "--stages"},
                                   {"tensor_parallel", "--tensor-parallel"},
                                   {"schedule", "--schedule"},
                                   {"virtual_stages", "--virtual-stages"},
                                   {"loss", "--loss"},
                                   {"zero", "--zero"}};
  return pipeshard::flag_message(s, kFlags);
}

Precision precision_of(const Args& a) {
  return a.precision == "tf32"   ? Precision::kTf32
         : a.precision == "bf16" ? Precision::kBf16
         : a.precision == "fp16" ? Precision::kFp16
                                 : Precision::kFp32;
}

}  // namespace pipeshard::train_cli
