// Writes the seed corpus of fuzz_checkpoint into a folder (fuzz/corpus/checkpoint/):
//
//   make_checkpoint_seeds fuzz/corpus/checkpoint
//
// Every seed is a mode byte ('0': decode the bytes as they are; '1': recompute the
// checksums first, fuzz_inputs.h) and then a checkpoint that save_checkpoint wrote for
// the trainers of fuzz::checkpoint_trainers(): for plain SGD, SGD with momentum and Adam,
// before any step and after two, in format 2 and rewritten as format 1. Those are named
// *.pipeshard, and each must be taken by some trainer. Damaged copies of Adam's
// (*.damaged: cut in the header and in a tensor, a data byte flipped, in both modes; one
// tensor left out, with valid checksums) show the fuzzer the refusals. The output is
// deterministic (GCC's and clang's builds wrote the same bytes); only these files are
// replaced: the corpus files named by SHA-1 are inputs fuzzing added, and stay.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "fuzz/fuzz_inputs.h"
#include "runtime/trainer.h"

namespace pipeshard::fuzz {
namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_seed(const fs::path& dir, const std::string& name, char mode, const std::string& checkpoint) {
  std::ofstream(dir / name, std::ios::binary | std::ios::trunc) << mode << checkpoint;
}

// `file` (format 2) as format 1 would hold it: no checksums, "format": 1.
std::string as_format_one(const std::string& file) {
  uint64_t length = 0;
  std::memcpy(&length, file.data() + 8, sizeof length);
  nlohmann::json header = nlohmann::json::parse(file.substr(16, length));
  header["format"] = 1;
  for (nlohmann::json& t : header["tensors"]) t.erase("crc32c");
  const std::string head = header.dump();
  const uint64_t new_length = head.size();
  std::string out = "PSCKPT01";
  out.append(reinterpret_cast<const char*>(&new_length), sizeof new_length);
  return out + head + file.substr(16 + length + 4);
}

// `file` (format 2) without its tensor `name` of `role`, header and checksum rewritten: a
// checkpoint that decodes and lacks what a trainer needs.
std::string without_tensor(const std::string& file, const std::string& name, const std::string& role) {
  uint64_t length = 0;
  std::memcpy(&length, file.data() + 8, sizeof length);
  nlohmann::json header = nlohmann::json::parse(file.substr(16, length));
  std::string data;
  size_t at = 16 + length + 4;
  nlohmann::json kept = nlohmann::json::array();
  for (const nlohmann::json& t : header["tensors"]) {
    const size_t size = t["elements"].get<size_t>() * sizeof(float);
    if (t["name"] != name || t["role"] != role) {
      kept.push_back(t);
      data += file.substr(at, size);
    }
    at += size;
  }
  header["tensors"] = kept;
  const std::string head = header.dump();
  const uint64_t new_length = head.size();
  std::string out = "PSCKPT02";
  out.append(reinterpret_cast<const char*>(&new_length), sizeof new_length);
  out += head;
  const uint32_t crc = crc32c(out);
  out.append(reinterpret_cast<const char*>(&crc), sizeof crc);
  return out + data;
}

int run(const fs::path& out) {
  fs::create_directories(out);
  const fs::path scratch = fs::temp_directory_path() / ("make_checkpoint_seeds." + std::to_string(::getpid()));
  std::string adam_step2;
  for (const CheckpointTrainer& t : checkpoint_trainers()) {
    if (!t.whole) continue;
    for (int step = 0; step <= 2; step += 2) {
      while (t.trainer->steps_done() < step) t.trainer->step();
      const Status saved = t.trainer->save_checkpoint(scratch.string());
      if (!saved.is_ok()) {
        std::fprintf(stderr, "make_checkpoint_seeds: %s\n", saved.message().c_str());
        return 2;
      }
      const std::string file = read_file(scratch / "checkpoint.pipeshard");
      const std::string stem = t.name + "_step" + std::to_string(step);
      write_seed(out, stem + ".pipeshard", '0', file);
      write_seed(out, stem + "_format1.pipeshard", '0', as_format_one(file));
      if (t.name == "adam" && step == 2) adam_step2 = file;
    }
  }
  fs::remove_all(scratch);
  std::string flipped = adam_step2;
  flipped[flipped.size() - 5] ^= 0x40;  // in the last tensor's data
  for (char mode : {'0', '1'}) {
    const std::string suffix = mode == '0' ? ".damaged" : "_repaired.damaged";
    write_seed(out, "adam_step2_cut_header" + suffix, mode, adam_step2.substr(0, 100));
    write_seed(out, "adam_step2_cut_tensor" + suffix, mode, adam_step2.substr(0, adam_step2.size() - 6));
    write_seed(out, "adam_step2_flipped_data" + suffix, mode, flipped);
  }
  write_seed(out, "adam_step2_no_value.damaged", '0', without_tensor(adam_step2, "3.bias", "value"));
  write_seed(out, "adam_step2_no_slot.damaged", '0', without_tensor(adam_step2, "3.bias", "slot1"));
  return 0;
}

}  // namespace
}  // namespace pipeshard::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_checkpoint_seeds OUT_DIR (fuzz/corpus/checkpoint)\n");
    return 2;
  }
  return pipeshard::fuzz::run(argv[1]);
}
