// Checkpoint integrity: a checkpoint damaged anywhere (a flipped byte in the header or in
// any tensor, a file cut short, bytes appended) is refused with a message naming the part
// at fault, and loading it changes nothing; the untouched file loads, and so does a
// format-1 file from before checksums. The layout read here is checkpoint_file.h's.
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "importer/onnx_importer.h"
#include "runtime/checkpoint_file.h"
#include "runtime/trainer.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::ScratchDir;
using testing::source_path;

// Where each part of a format-2 file lies.
struct Layout {
  nlohmann::json header;
  size_t data_begin = 0;  // after magic, length, header and the header's CRC
  struct Part {
    std::string what;  // "tensor 'NAME' (ROLE)", as the messages name it
    size_t begin = 0, end = 0;
  };
  std::vector<Part> tensors;

  explicit Layout(const std::string& bytes) {
    uint64_t length = 0;
    std::memcpy(&length, bytes.data() + 8, 8);
    header = nlohmann::json::parse(bytes.substr(16, length));
    data_begin = 16 + length + 4;
    size_t at = data_begin;
    for (const auto& t : header["tensors"]) {
      const size_t size = t["elements"].get<size_t>() * sizeof(float);
      tensors.push_back(
          {"tensor '" + t["name"].get<std::string>() + "' (" + t["role"].get<std::string>() + ")", at, at + size});
      at += size;
    }
  }
  // How a message must name the part holding byte `offset`.
  std::string part_at(size_t offset) const {
    for (const Part& p : tensors) {
      if (offset >= p.begin && offset < p.end) return p.what;
    }
    return "header";
  }
};

// A file with `header` in place of the original's, with a valid CRC: what another writer
// could produce. `format` 1 drops the header CRC, as format 1 had none.
std::string rebuild(const std::string& bytes, const nlohmann::json& header, int format = 2) {
  const Layout layout(bytes);
  const std::string head = header.dump();
  const uint64_t length = head.size();
  std::string out = format == 1 ? "PSCKPT01" : "PSCKPT02";
  out.append(reinterpret_cast<const char*>(&length), 8);
  out += head;
  if (format == 2) {
    const uint32_t crc = crc32c(out);
    out.append(reinterpret_cast<const char*>(&crc), 4);
  }
  return out + bytes.substr(layout.data_begin);
}

// A checkpoint of the course model after two Adam steps (two optimizer slots per tensor).
class CheckpointIntegrity : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<ImportedModel> m = import_onnx_file(source_path("models/simple_digits.onnx"));
    ASSERT_TRUE(m.is_ok()) << m.status().message();
    model_ = std::move(*m);
    Result<Dataset> d = load_dataset(source_path("data/digits_features.npy"), source_path("data/digits_labels.npy"),
                                     model_.graph, Targets::kClassIndices);
    ASSERT_TRUE(d.is_ok()) << d.status().message();
    data_ = std::move(*d);
    config_.optimizer.kind = OptimizerKind::kAdam;
    config_.optimizer.lr = 0.001f;
    config_.batch_size = 64;
    config_.total_steps = 4;
    trainer_ = make_trainer();
    for (int s = 0; s < 2; ++s) trainer_->step();
    ASSERT_TRUE(trainer_->save_checkpoint(dir_.path()).is_ok());
    bytes_ = testing::read_text(file());
  }

  std::unique_ptr<Trainer> make_trainer() {
    auto t = Trainer::create(model_.graph, *data_, *backend_, config_);
    EXPECT_TRUE(t.is_ok()) << t.status().message();
    return std::move(*t);
  }
  std::string file() const { return dir_ / "checkpoint.pipeshard"; }
  // Loads `bytes` through a fresh trainer; the error message, or "" when it loaded.
  std::string load(const std::string& bytes) {
    std::ofstream(file(), std::ios::binary | std::ios::trunc) << bytes;
    std::unique_ptr<Trainer> t = make_trainer();
    const Status s = t->load_checkpoint(dir_.path());
    EXPECT_EQ(t->steps_done(), s.is_ok() ? 2 : 0) << "a refused checkpoint changes nothing";
    return s.message();
  }

  ImportedModel model_;
  std::optional<Dataset> data_;
  std::unique_ptr<Backend> backend_ = make_cpu_backend();
  TrainConfig config_;
  std::unique_ptr<Trainer> trainer_;
  ScratchDir dir_{"integrity"};
  std::string bytes_;
};

TEST_F(CheckpointIntegrity, TheUnchangedFileLoads) {
  EXPECT_EQ(load(bytes_), "");
  const Layout layout(bytes_);
  EXPECT_EQ(layout.header["format"], 2);
  EXPECT_EQ(layout.tensors.back().end, bytes_.size());
  EXPECT_EQ(layout.tensors.size(), 3 * model_.graph.params.size()) << "values and Adam's two slots";
}

// Every byte of the header part (magic, length, JSON, CRC), one byte in each tensor
// (its first, middle and last), and every 997th byte of the file.
TEST_F(CheckpointIntegrity, AFlippedByteAnywhereIsRefusedNamingThePart) {
  const Layout layout(bytes_);
  std::vector<size_t> offsets;
  for (size_t i = 0; i < layout.data_begin; ++i) offsets.push_back(i);
  for (const Layout::Part& p : layout.tensors)
    offsets.insert(offsets.end(), {p.begin, (p.begin + p.end) / 2, p.end - 1});
  for (size_t i = 0; i < bytes_.size(); i += 997) offsets.push_back(i);
  for (size_t offset : offsets) {
    std::string damaged = bytes_;
    damaged[offset] = static_cast<char>(damaged[offset] ^ 0xFF);
    const Result<Checkpoint> c = decode_checkpoint(damaged);
    ASSERT_FALSE(c.is_ok()) << "byte " << offset << " flipped, and the checkpoint still decodes";
    const std::string& message = c.status().message();
    const std::string part = layout.part_at(offset);
    EXPECT_NE(message.find(part), std::string::npos) << "byte " << offset << " is in " << part << ": " << message;
    EXPECT_TRUE(message.find("corrupt") != std::string::npos ||
                message.find("not a pipeshard checkpoint") != std::string::npos ||
                message.find("length field") != std::string::npos)
        << message;
  }
  // Through load_checkpoint, as train --resume sees it: the path, then the part.
  std::string damaged = bytes_;
  damaged[layout.tensors[1].begin + 5] ^= 0x01;
  EXPECT_EQ(load(damaged), file() + ": corrupt checkpoint: " + layout.tensors[1].what + " fails its CRC-32C check");
  damaged = bytes_;
  damaged[20] ^= 0x01;
  EXPECT_EQ(load(damaged), file() + ": corrupt checkpoint header (its CRC-32C does not match)");
}

TEST_F(CheckpointIntegrity, AFileCutShortIsRefusedNamingThePart) {
  const Layout layout(bytes_);
  std::vector<size_t> cuts = {0,
                              4,
                              8,
                              12,
                              16,
                              100,
                              layout.data_begin - 4,
                              layout.data_begin - 1,
                              layout.data_begin,
                              layout.data_begin + 1,
                              bytes_.size() - 1};
  for (const Layout::Part& p : layout.tensors) cuts.push_back((p.begin + p.end) / 2);
  for (size_t cut : cuts) {
    const std::string message = load(bytes_.substr(0, cut));
    const std::string part = layout.part_at(cut);  // the first byte missing
    EXPECT_NE(message.find("truncated"), std::string::npos) << "cut at " << cut << ": " << message;
    EXPECT_NE(message.find(part), std::string::npos) << "cut at " << cut << " is in " << part << ": " << message;
  }
}

TEST_F(CheckpointIntegrity, BytesAfterTheLastTensorAreRefused) {
  EXPECT_EQ(load(bytes_ + "xyz"), file() + ": corrupt checkpoint: 3 bytes follow the last tensor");
}

// Written by the writer of another program, with valid checksums but fields of the wrong
// JSON types: refused as a corrupt header, never an exception.
TEST_F(CheckpointIntegrity, AHeaderOfTheWrongTypesIsRefused) {
  const Layout layout(bytes_);
  for (const std::string change : {"elements", "optimizer", "name", "crc32c", "step"}) {
    SCOPED_TRACE(change);
    nlohmann::json bad = layout.header;
    if (change == "optimizer" || change == "step") {
      bad[change] = change == "step" ? nlohmann::json("3") : nlohmann::json(3);
    } else {
      bad["tensors"][0][change] = change == "elements" ? nlohmann::json("abc") : nlohmann::json(-7);
    }
    const std::string message = load(rebuild(bytes_, bad));
    EXPECT_NE(message.find("corrupt checkpoint header"), std::string::npos) << message;
  }
}

// Loss scaling's state (an optional "loss_scale" object) is checked like the rest.
TEST_F(CheckpointIntegrity, ALossScaleMustBeAPositiveNumberWithAStepCount) {
  const Layout layout(bytes_);
  nlohmann::json good = layout.header;
  good["loss_scale"] = {{"scale", 1024.0}, {"good_steps", 3}};
  EXPECT_EQ(load(rebuild(bytes_, good)), "");
  for (const nlohmann::json& bad :
       {nlohmann::json{{"scale", -1.0}, {"good_steps", 3}}, nlohmann::json{{"scale", 0.0}, {"good_steps", 3}},
        nlohmann::json{{"scale", 1024.0}, {"good_steps", -1}}, nlohmann::json{{"scale", "1024"}, {"good_steps", 3}},
        nlohmann::json{{"scale", 1024.0}}, nlohmann::json(1024.0)}) {
    SCOPED_TRACE(bad.dump());
    nlohmann::json header = layout.header;
    header["loss_scale"] = bad;
    const std::string message = load(rebuild(bytes_, header));
    EXPECT_NE(message.find("corrupt checkpoint header (a loss scale that is not a positive number"), std::string::npos)
        << message;
  }
}

TEST_F(CheckpointIntegrity, FormatOneFilesStillLoad) {
  nlohmann::json v1 = Layout(bytes_).header;
  v1["format"] = 1;
  for (auto& t : v1["tensors"]) t.erase("crc32c");
  EXPECT_EQ(load(rebuild(bytes_, v1, 1)), "");
  // Format 2 relabelled as format 1 (one flipped bit in the magic's last byte) disagrees
  // with its own header.
  std::string relabelled = bytes_;
  relabelled[7] = '1';
  EXPECT_NE(load(relabelled).find("corrupt checkpoint header (its format field does not match"), std::string::npos);
}

// Valid checksums, but tensors that do not fit: the same tensor twice, a slot number
// past int's range, and a length past 2^62 elements (whose byte count would wrap).
TEST_F(CheckpointIntegrity, TensorsThatDoNotFitAreRefusedNamingThem) {
  const Layout layout(bytes_);
  const size_t slot0 = model_.graph.params.size();  // Adam's first slot of parameter 0
  const std::string name = layout.header["tensors"][0]["name"];
  nlohmann::json twice = layout.header;
  twice["tensors"][slot0]["role"] = "value";
  EXPECT_EQ(load(rebuild(bytes_, twice)), file() + ": tensor '" + name + "' (value) appears twice");
  nlohmann::json far_slot = layout.header;
  far_slot["tensors"][slot0]["role"] = "slot99999999999";
  EXPECT_EQ(load(rebuild(bytes_, far_slot)), file() + ": optimizer state does not match this optimizer");
  nlohmann::json huge = layout.header;
  huge["tensors"][0]["elements"] = (uint64_t{1} << 62) + 1;
  EXPECT_NE(load(rebuild(bytes_, huge)).find("needs 4611686018427387905 float32 values"), std::string::npos);
}

// Checksums prove a file is as written, not that its numbers are sound: a NaN weight
// written by a run that had gone bad is refused on resume, naming the tensor and the index.
// (Optimizer state may hold inf: Overflow.ResumedRunGoesOnWithItsScale resumes one.)
TEST_F(CheckpointIntegrity, ANonFiniteTensorIsRefusedThoughItsChecksumsHold) {
  const Layout layout(bytes_);
  std::string bytes = bytes_;
  const Layout::Part& part = layout.tensors[1];
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(&bytes[part.begin + 3 * sizeof(float)], &nan, sizeof nan);
  nlohmann::json header = layout.header;
  header["tensors"][1]["crc32c"] = crc32c(std::string_view(bytes).substr(part.begin, part.end - part.begin));
  EXPECT_EQ(load(rebuild(bytes, header)),
            file() + ": " + part.what + " holds NaN at flat index 3; a checkpoint's tensors must be finite numbers");
}

}  // namespace
}  // namespace pipeshard
