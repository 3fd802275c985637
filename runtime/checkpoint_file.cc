#include "runtime/checkpoint_file.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include <nlohmann/json.hpp>

#include "common/crc32c.h"

namespace pipeshard {
namespace {

constexpr char kMagic1[] = "PSCKPT01";
constexpr char kMagic2[] = "PSCKPT02";
constexpr size_t kMagicSize = 8, kPrefixSize = 16, kHeaderCrcSize = 4;

std::string_view bytes_of(const std::vector<float>& data) {
  return {reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float)};
}

template <typename T>
void append_raw(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof value);
}

template <typename T>
T read_raw(std::string_view bytes, size_t at) {
  T value;
  std::memcpy(&value, bytes.data() + at, sizeof value);
  return value;
}

Status corrupt_header(const std::string& why) { return Status::error("corrupt checkpoint header (" + why + ")"); }

// What the header says of each tensor, beyond its name and role.
struct Listed {
  uint64_t elements = 0;
  uint32_t crc = 0;  // format 2
};

// The header's fields, checked for presence and type (the header's checksum has passed:
// a failure here is a file that something else wrote).
Status parse_header(const nlohmann::json& header, int format, Checkpoint& out, std::vector<Listed>& listed) {
  if (!header.is_object()) return corrupt_header("not a JSON object");
  if (header.value("format", nlohmann::json()) != format) {
    return corrupt_header("its format field does not match its magic, format " + std::to_string(format));
  }
  if (!header.contains("step") || !header["step"].is_number_integer() || header["step"].get<int64_t>() < 0) {
    return corrupt_header("no step count");
  }
  if (!header.contains("optimizer") || !header["optimizer"].is_string()) return corrupt_header("no optimizer name");
  if (!header.contains("tensors") || !header["tensors"].is_array()) return corrupt_header("no tensor list");
  out.step = header["step"].get<int64_t>();
  out.updates = out.step;
  if (header.contains("updates")) {
    const nlohmann::json& u = header["updates"];
    if (!u.is_number_integer() || u.get<int64_t>() < 0 || u.get<int64_t>() > out.step) {
      return corrupt_header("an update count that is not between 0 and the step count");
    }
    out.updates = u.get<int64_t>();
  }
  if (header.contains("loss_scale")) {
    const nlohmann::json& l = header["loss_scale"];
    const bool typed = l.is_object() && l.contains("scale") && l["scale"].is_number() && l.contains("good_steps") &&
                       l["good_steps"].is_number_integer();
    if (!typed || !(l["scale"].get<double>() > 0 && std::isfinite(l["scale"].get<double>())) ||
        l["good_steps"].get<int64_t>() < 0) {
      return corrupt_header("a loss scale that is not a positive number with a count of good steps");
    }
    out.loss_scale = l["scale"].get<double>();
    out.loss_scale_good_steps = l["good_steps"].get<int64_t>();
  }
  out.optimizer = header["optimizer"].get<std::string>();
  for (const nlohmann::json& t : header["tensors"]) {
    const bool typed = t.is_object() && t.contains("name") && t["name"].is_string() && t.contains("role") &&
                       t["role"].is_string() && t.contains("elements") && t["elements"].is_number_unsigned() &&
                       (format == 1 || (t.contains("crc32c") && t["crc32c"].is_number_unsigned() &&
                                        t["crc32c"].get<uint64_t>() <= UINT32_MAX));
    if (!typed) {
      return corrupt_header("tensor " + std::to_string(out.tensors.size()) +
                            " lacks a field or has one of the wrong type");
    }
    out.tensors.push_back({t["name"].get<std::string>(), t["role"].get<std::string>(), {}});
    listed.push_back({t["elements"].get<uint64_t>(), format == 1 ? 0 : t["crc32c"].get<uint32_t>()});
  }
  return Status::ok();
}

}  // namespace

std::string encode_checkpoint(const Checkpoint& checkpoint) {
  nlohmann::json header;
  header["format"] = 2;
  header["step"] = checkpoint.step;
  header["updates"] = checkpoint.updates;
  header["optimizer"] = checkpoint.optimizer;
  if (checkpoint.loss_scale > 0) {
    header["loss_scale"] = {{"scale", checkpoint.loss_scale}, {"good_steps", checkpoint.loss_scale_good_steps}};
  }
  header["tensors"] = nlohmann::json::array();
  size_t data_bytes = 0;
  for (const CheckpointTensor& t : checkpoint.tensors) {
    header["tensors"].push_back(
        {{"name", t.name}, {"role", t.role}, {"elements", t.data.size()}, {"crc32c", crc32c(bytes_of(t.data))}});
    data_bytes += t.data.size() * sizeof(float);
  }
  const std::string head = header.dump();
  std::string file(kMagic2, kMagicSize);
  file.reserve(kPrefixSize + head.size() + kHeaderCrcSize + data_bytes);
  append_raw<uint64_t>(file, head.size());
  file += head;
  append_raw<uint32_t>(file, crc32c(file));
  for (const CheckpointTensor& t : checkpoint.tensors) file += bytes_of(t.data);
  return file;
}

Result<Checkpoint> decode_checkpoint(std::string_view bytes) {
  if (bytes.size() < kMagicSize)
    return Status::error("truncated checkpoint header: the file has " + std::to_string(bytes.size()) + " bytes");
  const std::string_view magic = bytes.substr(0, kMagicSize);
  const int format = magic == kMagic2 ? 2 : magic == kMagic1 ? 1 : 0;
  if (format == 0)
    return Status::error("not a pipeshard checkpoint (its header does not begin with " + std::string(kMagic2) + ")");
  if (bytes.size() < kPrefixSize)
    return Status::error("truncated checkpoint header: the file has " + std::to_string(bytes.size()) + " bytes");
  const uint64_t length = read_raw<uint64_t>(bytes, kMagicSize);
  const size_t crc_size = format == 2 ? kHeaderCrcSize : 0;
  const size_t after_prefix = bytes.size() - kPrefixSize;
  if (length > after_prefix || crc_size > after_prefix - length) {
    return Status::error("truncated checkpoint header, or a corrupt one: its length field says " +
                         std::to_string(length) + " bytes, and " + std::to_string(after_prefix) + " follow");
  }
  const size_t header_end = kPrefixSize + static_cast<size_t>(length);
  if (format == 2 && crc32c(bytes.substr(0, header_end)) != read_raw<uint32_t>(bytes, header_end)) {
    return corrupt_header("its CRC-32C does not match");
  }
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(kPrefixSize, length), nullptr, false);
  if (header.is_discarded()) return corrupt_header("not JSON");
  Checkpoint c;
  std::vector<Listed> listed;  // [tensors]
  PIPESHARD_RETURN_IF_ERROR(parse_header(header, format, c, listed));
  size_t at = header_end + crc_size;
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    CheckpointTensor& t = c.tensors[i];
    const uint64_t elements = listed[i].elements;
    const std::string what = "tensor '" + t.name + "' (" + t.role + ")";
    if (elements > (bytes.size() - at) / sizeof(float)) {
      // Past 2^62 elements the byte count itself would wrap around.
      const std::string needs = elements <= UINT64_MAX / sizeof(float)
                                    ? std::to_string(elements * sizeof(float)) + " bytes"
                                    : std::to_string(elements) + " float32 values";
      return Status::error("truncated checkpoint: " + what + " needs " + needs + ", " +
                           std::to_string(bytes.size() - at) + " remain");
    }
    const std::string_view data = bytes.substr(at, static_cast<size_t>(elements) * sizeof(float));
    if (format == 2 && crc32c(data) != listed[i].crc)
      return Status::error("corrupt checkpoint: " + what + " fails its CRC-32C check");
    // An empty vector's data() may be null, and memcpy from or to null is undefined even
    // for 0 bytes: a header may list a tensor of 0 elements.
    t.data.resize(static_cast<size_t>(elements));
    if (!data.empty()) std::memcpy(t.data.data(), data.data(), data.size());
    at += data.size();
  }
  if (at != bytes.size()) {
    return Status::error("corrupt checkpoint: " + std::to_string(bytes.size() - at) + " bytes follow the last tensor");
  }
  return c;
}

}  // namespace pipeshard
