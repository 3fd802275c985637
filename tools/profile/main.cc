// profile: measure the machine it runs on for the layout planner (partition --plan
// --profile) and write profile.json (planner/profile.h). Under mpirun every rank times the
// same work at once, so run it with the -np and the environment (threads per process)
// that train will run with. Bad arguments: one line on stderr, exit status 2, nothing
// written.
#include <unistd.h>

#include <filesystem>
#include <optional>
#include <string>
#include <thread>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "backend/backend.h"
#include "comm/comm.h"
#include "common/atomic_file.h"
#include "common/cli.h"
#include "importer/onnx_importer.h"
#include "planner/measure.h"
#include "planner/profile.h"

namespace {

using namespace pipeshard;

struct Args {
  std::string model, out = "profile.json";
  int64_t batch_size = 32;
  int max_micro_batches = 16;
  double seconds = 0.02;
  int sweeps = 3;
};

// "host, 2 cores, cpu backend, 4 processes".
std::string machine_text(int ranks) {
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  const unsigned cores = std::thread::hardware_concurrency();
  return fmt::format("{}, {} cores, cpu backend, {} process{}", host, cores, ranks, ranks == 1 ? "" : "es");
}

// Parses and checks everything before any work; the message of the first fault, or OK.
Status check_args(int argc, char** argv, Args& a, std::optional<int>& answered, bool root) {
  CLI::App app{
      "Measure this machine for the layout planner and write profile.json: the GEMM time of every Linear\n"
      "shape MODEL's layouts need (or a square GEMM without a model), elementwise and optimizer\n"
      "throughput, a few steps of MODEL whole on every process (how much slower ops run in a step than\n"
      "alone), and under mpirun point-to-point and all-reduce time by message size. Run it as train\n"
      "will run (the same mpirun -np and threads per process); it takes well under a minute.\n"
      "Example: mpirun -np 4 profile models/simple_digits.onnx --batch-size 64 --out profile.json\n"
      "         partition models/simple_digits.onnx --plan --ranks 4 --batch-size 64 --profile profile.json",
      "profile"};
  app.add_option("model", a.model, "ONNX model whose Linear shapes to time (optional)");
  app.add_option("--out,-o", a.out, "where to write the profile (default profile.json)");
  app.add_option("--batch-size", a.batch_size, "global batch per step the plan will use (default 32)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  app.add_option("--max-micro-batches", a.max_micro_batches,
                 "largest micro-batch count the plan will try, as partition --plan (default 16)")
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--seconds", a.seconds, "time spent repeating each figure (default 0.02)")
      ->check(CLI::Range(0.001, 10.0));
  app.add_option("--sweeps", a.sweeps,
                 "times each figure is taken, all figures in turn, the median kept: the machine's speed wanders "
                 "from second to second (default 3)")
      ->check(CLI::Range(1, 99));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {  // --help
      answered = root ? app.exit(e) : 0;
      return Status::ok();
    }
    return Status::error(std::string(e.what()) + " (see profile --help)");
  }
  const std::string folder = std::filesystem::path(a.out).parent_path().string();
  if (Status s = check_writable_folder(folder.empty() ? "." : folder); !s) {
    return Status::error("--out: '" + a.out + "' cannot be written: " + s.message());
  }
  return Status::ok();
}

int run(Communicator& world, int argc, char** argv) {
  const bool root = world.rank() == 0;
  Args a;
  std::optional<int> answered;
  Status s = check_args(argc, argv, a, answered, root);
  if (answered) return *answered;
  MeasureOptions o;
  std::optional<ImportedModel> model;  // o.model points into it
  if (s && !a.model.empty()) {
    Result<ImportedModel> m = import_onnx_file(a.model);
    if (m) {
      model = std::move(*m);
      o = model_measure_options(model->graph, world.size(), a.batch_size, a.max_micro_batches);
    } else {
      s = m.status();
    }
  }
  if (!s) return root ? report_bad_input("profile", s.message()) : kExitBadInput;
  o.seconds_per_figure = a.seconds;
  o.sweeps = a.sweeps;
  o.machine = machine_text(world.size());
  o.progress = [](const std::string& line) { fmt::print(stderr, "profile: {}\n", line); };
  std::unique_ptr<Backend> backend = make_cpu_backend();
  const MachineProfile profile = measure_profile(*backend, world, o);
  if (root) {
    if (Status w = write_file_atomically(a.out, profile_json_text(profile)); !w) {
      return report_bad_input("profile", w.message());
    }
    fmt::print(stderr,
               "profile: wrote {}: {} Linear shapes, GEMM up to {:.1f} GFLOP/s, elementwise {:.1f} GB/s, Adam {:.0f} "
               "M params/s{}\n",
               a.out, profile.linear.size(), profile.gemm_flops_per_s / 1e9, profile.elementwise_bytes_per_s / 1e9,
               profile.optimizer_params_per_s / 1e6,
               world.size() > 1 ? fmt::format(", p2p {:.1f} us + {:.2f} GB/s, all-reduce {:.1f} us + {:.2f} GB/s bus",
                                              profile.p2p.latency_us, profile.p2p.bytes_per_s / 1e9,
                                              profile.all_reduce.latency_us, profile.all_reduce.bytes_per_s / 1e9)
                                : "");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::unique_ptr<Communicator> world = make_world_communicator();
  return run(*world, argc, argv);
}
