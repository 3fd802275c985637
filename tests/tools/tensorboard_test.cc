// train --tensorboard: TensorBoard event files read back by a reader of our own that
// checks both CRCs of every record and decodes the Events, against CRC-32C's published
// check values and against what the same run writes to --metrics and stderr.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "common/status.h"
#include "observe/tensorboard.h"
#include "observe/tensorboard_event.pb.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::quote;
using testing::read_text;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

uint64_t load_le(const std::string& bytes, size_t at, int width) {
  uint64_t v = 0;
  for (int i = width - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
  return v;
}

// A TFRecord file's records, each checked against the masked CRC-32C of its length and
// of its data; an error names the record and its byte offset.
Result<std::vector<std::string>> read_tfrecords(const std::string& bytes) {
  std::vector<std::string> records;
  size_t at = 0;
  while (at < bytes.size()) {
    const std::string where = "record " + std::to_string(records.size()) + " at byte " + std::to_string(at);
    if (bytes.size() - at < 12) return Status::error(where + ": truncated header");
    const uint64_t length = load_le(bytes, at, 8);
    if (load_le(bytes, at + 8, 4) != mask_crc32c(crc32c(std::string_view(bytes).substr(at, 8)))) {
      return Status::error(where + ": length CRC mismatch");
    }
    if (bytes.size() - at - 12 < length + 4) return Status::error(where + ": truncated data");
    std::string data = bytes.substr(at + 12, length);
    if (load_le(bytes, at + 12 + length, 4) != mask_crc32c(crc32c(data))) {
      return Status::error(where + ": data CRC mismatch");
    }
    records.push_back(std::move(data));
    at += 12 + length + 4;
  }
  return records;
}

Result<std::vector<tensorboard::Event>> read_events(const std::string& path) {
  Result<std::vector<std::string>> records = read_tfrecords(read_text(path));
  if (!records) return records.status();
  std::vector<tensorboard::Event> events;
  for (const std::string& r : *records) {
    if (!events.emplace_back().ParseFromString(r)) return Status::error("an Event that does not parse");
  }
  return events;
}

// The event files in `dir`.
std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename().string().find("tfevents") != std::string::npos) files.push_back(e.path().string());
  }
  return files;
}

// tag -> step -> value, from the scalar Events of a file whose first Event is the
// file_version record; every scalar Event has exactly one value, and a (tag, step)
// appears once.
using Scalars = std::map<std::string, std::map<int64_t, float>>;
Scalars read_scalars(const std::string& path) {
  Scalars scalars;
  Result<std::vector<tensorboard::Event>> events = read_events(path);
  EXPECT_TRUE(events.is_ok()) << events.status().message();
  if (!events) return scalars;
  EXPECT_FALSE(events->empty());
  if (events->empty()) return scalars;
  EXPECT_EQ((*events)[0].file_version(), "brain.Event:2");
  for (size_t i = 1; i < events->size(); ++i) {
    const tensorboard::Event& e = (*events)[i];
    EXPECT_TRUE(e.has_summary());
    EXPECT_GT(e.wall_time(), 1.5e9) << "seconds since 1970";
    EXPECT_EQ(e.summary().value_size(), 1);
    for (const auto& v : e.summary().value()) {
      EXPECT_EQ(v.value_case(), tensorboard::Summary::Value::kSimpleValue) << v.tag();
      EXPECT_EQ(scalars[v.tag()].count(e.step()), 0u) << v.tag() << " twice at step " << e.step();
      scalars[v.tag()][e.step()] = v.simple_value();
    }
  }
  return scalars;
}

TEST(Crc32c, MatchesThePublishedCheckValues) {
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);            // the catalogue's check value
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);  // RFC 3720, B.4
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending += static_cast<char>(i);
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(mask_crc32c(0), 0xA282EAD8u);
  EXPECT_EQ(mask_crc32c(0x12345678), ((0x12345678u >> 15) | (0x12345678u << 17)) + 0xA282EAD8u);
}

TEST(TensorBoardWriter, WritesTheFileTensorBoardLooksFor) {
  ScratchDir dir("tb");
  const std::string logdir = dir / "runs/a";  // created with its parent
  std::string path;
  {
    Result<std::unique_ptr<TensorBoardWriter>> w = TensorBoardWriter::create(logdir);
    ASSERT_TRUE(w.is_ok()) << w.status().message();
    path = (*w)->path();
    (*w)->add_scalar("train/loss", 1, 2.5, 1.7e9);
    (*w)->add_scalar("train/lr", 1, 0.0, 1.7e9);  // zero is written, not left out
    ASSERT_TRUE((*w)->flush().is_ok());
    (*w)->add_scalar("train/loss", 2, -1.25, 1.7e9 + 1);  // flushed by the destructor
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string name = std::filesystem::path(path).filename().string();
  EXPECT_TRUE(std::regex_match(name, std::regex("events\\.out\\.tfevents\\.[0-9]{10}\\.(.*)\\.([0-9]+)")));
  EXPECT_NE(name.find(std::string(".") + host + "." + std::to_string(::getpid())), std::string::npos) << name;
  EXPECT_EQ(event_files(logdir), std::vector<std::string>{path});
  Result<std::vector<tensorboard::Event>> events = read_events(path);
  ASSERT_TRUE(events.is_ok()) << events.status().message();
  ASSERT_EQ(events->size(), 4u);
  EXPECT_EQ((*events)[0].file_version(), "brain.Event:2");
  const tensorboard::Event& lr = (*events)[2];
  EXPECT_EQ(lr.step(), 1);
  EXPECT_EQ(lr.wall_time(), 1.7e9);
  EXPECT_EQ(lr.summary().value(0).tag(), "train/lr");
  EXPECT_EQ(lr.summary().value(0).value_case(), tensorboard::Summary::Value::kSimpleValue);
  EXPECT_EQ(lr.summary().value(0).simple_value(), 0.0f);
  EXPECT_EQ((*events)[3].step(), 2);
  EXPECT_EQ((*events)[3].summary().value(0).simple_value(), -1.25f);
}

TEST(TensorBoardWriter, TheFramingIsTFRecords) {
  std::string framed;
  append_tfrecord(framed, "abc");
  ASSERT_EQ(framed.size(), 8u + 4 + 3 + 4);
  EXPECT_EQ(load_le(framed, 0, 8), 3u);
  EXPECT_EQ(load_le(framed, 8, 4), mask_crc32c(crc32c(std::string("\x03\0\0\0\0\0\0\0", 8))));
  EXPECT_EQ(framed.substr(12, 3), "abc");
  EXPECT_EQ(load_le(framed, 15, 4), mask_crc32c(crc32c("abc")));
}

TEST(TensorBoardReader, DetectsACorruptedByte) {
  std::string file;
  append_tfrecord(file, "first record");
  append_tfrecord(file, "second record");
  ASSERT_TRUE(read_tfrecords(file).is_ok());
  const size_t second = 12 + 12 + 4;  // where the second record starts
  struct Case {
    size_t at;
    std::string error;
  };
  for (const Case& c : {Case{second + 12 + 3, "record 1 at byte 28: data CRC mismatch"},
                        Case{second + 1, "record 1 at byte 28: length CRC mismatch"},
                        Case{second + 9, "record 1 at byte 28: length CRC mismatch"},
                        Case{second + 12 + 13, "record 1 at byte 28: data CRC mismatch"},
                        Case{4, "record 0 at byte 0: length CRC mismatch"}}) {
    std::string bad = file;
    bad[c.at] = static_cast<char>(bad[c.at] ^ 0x01);
    Result<std::vector<std::string>> r = read_tfrecords(bad);
    ASSERT_FALSE(r.is_ok()) << "flipped byte " << c.at;
    EXPECT_EQ(r.status().message(), c.error);
  }
  EXPECT_EQ(read_tfrecords(file.substr(0, file.size() - 1)).status().message(), "record 1 at byte 28: truncated data");
}

TEST(TensorBoardWriter, RefusesAFolderItCannotCreate) {
  ScratchDir dir("tb-bad");
  std::ofstream(dir / "file") << "x";
  Result<std::unique_ptr<TensorBoardWriter>> w = TensorBoardWriter::create(dir / "file");
  ASSERT_FALSE(w.is_ok());
  EXPECT_NE(w.status().message().find("cannot create TensorBoard folder '" + (dir / "file") + "'"), std::string::npos)
      << w.status().message();
}

// Every value of the --metrics file appears under the same step in the event file, as
// the float TensorBoard stores.
void expect_metrics_match(const std::string& metrics_path, const Scalars& scalars, int64_t steps) {
  std::ifstream in(metrics_path);
  std::string line;
  int64_t lines = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    const int64_t step = j["step"].get<int64_t>();
    ++lines;
    for (const char* key : {"loss", "lr", "samples_per_s"}) {
      const std::string tag = std::string("train/") + key;
      ASSERT_TRUE(scalars.count(tag) && scalars.at(tag).count(step)) << tag << " at step " << step;
      EXPECT_EQ(scalars.at(tag).at(step), static_cast<float>(j[key].get<double>())) << tag << " at step " << step;
    }
  }
  EXPECT_EQ(lines, steps);
  for (const char* tag : {"train/loss", "train/lr", "train/samples_per_s"}) {
    EXPECT_EQ(scalars.count(tag) ? scalars.at(tag).size() : 0u, static_cast<size_t>(steps)) << tag;
  }
}

// time/stage<p>_*: one non-negative value per step for each of `stages` stages.
void expect_stage_times(const Scalars& scalars, int stages, int64_t steps) {
  for (int p = 0; p < stages; ++p) {
    for (const std::string what : {"_forward_backward_ms", "_idle_ms"}) {
      const std::string tag = "time/stage" + std::to_string(p) + what;
      ASSERT_TRUE(scalars.count(tag)) << tag;
      EXPECT_EQ(scalars.at(tag).size(), static_cast<size_t>(steps)) << tag;
      for (const auto& [step, ms] : scalars.at(tag)) EXPECT_GE(ms, 0.0f) << tag << " at step " << step;
    }
  }
  EXPECT_EQ(scalars.count("time/stage" + std::to_string(stages) + "_forward_backward_ms"), 0u);
}

TEST(TrainTensorBoard, RecordsWhatMetricsAndTheLogSay) {
  ScratchDir dir("tb-train");
  const auto r = run_command(quote(tool_path("train")) + " " + quote(source_path("models/simple_digits.onnx")) +
                             " --data " + quote(source_path("data/digits_train_features.npy")) + " --labels " +
                             quote(source_path("data/digits_train_labels.npy")) + " --eval-data " +
                             quote(source_path("data/digits_test_features.npy")) + " --eval-labels " +
                             quote(source_path("data/digits_test_labels.npy")) +
                             " --epochs 2 --batch-size 64 --lr 0.05 --momentum 0.9" + " --metrics " +
                             quote(dir / "m.jsonl") + " --tensorboard " + quote(dir / "tb"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> files = event_files(dir / "tb");
  ASSERT_EQ(files.size(), 1u);
  const Scalars scalars = read_scalars(files[0]);
  int64_t steps = 0;
  {
    std::ifstream in(dir / "m.jsonl");
    for (std::string line; std::getline(in, line);) ++steps;
  }
  ASSERT_GT(steps, 2);
  ASSERT_EQ(steps % 2, 0);
  expect_metrics_match(dir / "m.jsonl", scalars, steps);
  expect_stage_times(scalars, 1, steps);
  // eval/* at the last step of each epoch, as the log prints them (4 and 1 decimals).
  const std::regex epoch_line("epoch (\\d+): train loss [0-9.]+  eval loss ([0-9.]+)  eval accuracy ([0-9.]+)%");
  int epochs = 0;
  for (auto it = std::sregex_iterator(r.err.begin(), r.err.end(), epoch_line); it != std::sregex_iterator(); ++it) {
    const int64_t step = std::stoll((*it)[1]) * steps / 2;
    ++epochs;
    ASSERT_TRUE(scalars.count("eval/loss") && scalars.at("eval/loss").count(step)) << "eval/loss at " << step;
    ASSERT_TRUE(scalars.count("eval/accuracy") && scalars.at("eval/accuracy").count(step));
    EXPECT_NEAR(scalars.at("eval/loss").at(step), std::stod((*it)[2]), 0.5e-4 + 1e-6);
    EXPECT_NEAR(100 * scalars.at("eval/accuracy").at(step), std::stod((*it)[3]), 0.05 + 1e-4);
  }
  EXPECT_EQ(epochs, 2) << r.err;
  EXPECT_EQ(scalars.at("eval/loss").size(), 2u);
  EXPECT_EQ(scalars.count("pipeline/bubble_measured"), 0u) << "no bubble without a pipeline";
}

TEST(TrainTensorBoard, APipelineRecordsEachStageAndTheBubble) {
  ScratchDir dir("tb-pipe");
  // Open MPI refuses root without these; its session folder goes under this test's own
  // TMPDIR (concurrent mpiexec runs can collide in a shared one).
  const std::string env = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TMPDIR=" + quote(dir.path()) + " ";
  const auto r = run_command(env + quote(PIPESHARD_MPIEXEC) + " -n 2 --oversubscribe " + quote(tool_path("train")) +
                             " " + quote(source_path("models/simple_digits.onnx")) + " --data " +
                             quote(source_path("data/digits_features.npy")) + " --labels " +
                             quote(source_path("data/digits_labels.npy")) +
                             " --batch-size 32 --steps 6 --stages 2 --micro-batches 4 --metrics " +
                             quote(dir / "m.jsonl") + " --tensorboard " + quote(dir / "tb"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<std::string> files = event_files(dir / "tb");
  ASSERT_EQ(files.size(), 1u) << "rank 0 alone writes";
  const Scalars scalars = read_scalars(files[0]);
  expect_metrics_match(dir / "m.jsonl", scalars, 6);
  expect_stage_times(scalars, 2, 6);
  ASSERT_TRUE(scalars.count("pipeline/bubble_theoretical") && scalars.count("pipeline/bubble_measured"));
  EXPECT_EQ(scalars.at("pipeline/bubble_theoretical").at(6), 0.2f) << "(P-1)/(M+P-1) for P=2, M=4";
  const float measured = scalars.at("pipeline/bubble_measured").at(6);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m, std::regex("stages idle ([0-9.]+)%"))) << r.err;
  EXPECT_NEAR(100 * measured, std::stod(m[1]), 0.05 + 1e-4);
  ASSERT_TRUE(scalars.count("pipeline/bubble_predicted"));
  ASSERT_TRUE(std::regex_search(r.err, m, std::regex("([0-9.]+)% predicted from the passes"))) << r.err;
  EXPECT_NEAR(100 * scalars.at("pipeline/bubble_predicted").at(6), std::stod(m[1]), 0.05 + 1e-4);
}

TEST(TrainTensorBoard, RefusesAFolderItCannotCreate) {
  ScratchDir dir("tb-refuse");
  std::ofstream(dir / "file") << "x";
  const auto r = run_command(quote(tool_path("train")) + " " + quote(source_path("models/simple_digits.onnx")) +
                             " --data " + quote(source_path("data/digits_features.npy")) + " --labels " +
                             quote(source_path("data/digits_labels.npy")) + " --steps 2 --tensorboard " +
                             quote(dir / "file/tb") + " --save " + quote(dir / "out.onnx"));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err, "train: error: cannot create TensorBoard folder '" + (dir / "file/tb") + "': Not a directory\n");
  EXPECT_FALSE(std::filesystem::exists(dir / "out.onnx"));
}

}  // namespace
}  // namespace pipeshard
