// Reading the model file and decoding its tensors: initializers (inline or in external
// data files) and Constant nodes. Everything read from the file is checked before it
// sizes an allocation or indexes memory.
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <google/protobuf/io/coded_stream.h>

#include "importer/import_context.h"
#include "importer/onnx_importer.h"

namespace pipeshard {
namespace fs = std::filesystem;
using onnx::TensorProto;

namespace {

Result<int64_t> checked_elements(const std::string& what, const TensorProto& t) {
  int64_t n = 1;
  for (int64_t d : t.dims()) {
    if (d < 0) return Status::error(what + " has a negative dimension " + std::to_string(d));
    if (d != 0 && n > kMaxTensorElements / d) {
      return Status::error(what + " has dims that would need more than 2^32 elements");
    }
    n *= d;
  }
  return n;
}

int element_size(int32_t data_type) {
  switch (data_type) {
    case TensorProto::FLOAT:
    case TensorProto::INT32: return 4;
    case TensorProto::DOUBLE:
    case TensorProto::INT64: return 8;
    case TensorProto::BOOL:
    case TensorProto::UINT8:
    case TensorProto::INT8: return 1;
    default: return 0;
  }
}

// Reads the bytes an external-data tensor points at into its raw_data, after making
// sure the location stays inside the model's folder.
Status load_external_data(TensorProto& t, const std::string& base_dir, int64_t expected_bytes) {
  std::string location;
  int64_t offset = 0, length = -1;
  for (const auto& kv : t.external_data()) {
    try {
      if (kv.key() == "location") location = kv.value();
      if (kv.key() == "offset") offset = std::stoll(kv.value());
      if (kv.key() == "length") length = std::stoll(kv.value());
    } catch (const std::exception&) {
      return Status::error("external data field '" + kv.key() + "' is not a number");
    }
  }
  if (location.empty()) return Status::error("external data has no location");
  fs::path rel(location);
  if (rel.is_absolute())
    return Status::error("external data location '" + location + "' is absolute; only files beside the model are read");
  for (const auto& part : rel) {
    if (part == "..") return Status::error("external data location '" + location + "' leaves the model's folder");
  }
  std::error_code ec;
  fs::path base = fs::canonical(base_dir.empty() ? "." : base_dir, ec);
  if (ec) return Status::error("cannot resolve the model's folder '" + base_dir + "'");
  fs::path file = fs::canonical(base / rel, ec);
  if (ec) return Status::error("external data file '" + location + "' not found beside the model");
  auto [b, f] = std::mismatch(base.begin(), base.end(), file.begin(), file.end());
  if (b != base.end())
    return Status::error("external data location '" + location + "' resolves outside the model's folder (symlink?)");
  if (!fs::is_regular_file(file)) return Status::error("external data '" + location + "' is not a regular file");
  const auto size = static_cast<int64_t>(fs::file_size(file, ec));
  if (length < 0) length = size - offset;
  if (offset < 0 || length < 0 || offset > size || length > size - offset) {
    return Status::error("external data '" + location + "' is shorter than offset " + std::to_string(offset) +
                         " + length " + std::to_string(length));
  }
  if (length != expected_bytes) {
    return Status::error("external data holds " + std::to_string(length) + " bytes, dims need " +
                         std::to_string(expected_bytes));
  }
  std::ifstream in(file, std::ios::binary);
  std::string bytes(static_cast<size_t>(length), '\0');
  in.seekg(offset);
  if (!in.read(bytes.data(), length)) return Status::error("cannot read external data '" + location + "'");
  t.set_raw_data(std::move(bytes));
  t.clear_external_data();
  t.set_data_location(TensorProto::DEFAULT);
  return Status::ok();
}

// Number of elements actually stored in the typed repeated field for `t`'s dtype.
int64_t typed_field_size(const TensorProto& t) {
  switch (t.data_type()) {
    case TensorProto::FLOAT: return t.float_data_size();
    case TensorProto::DOUBLE: return t.double_data_size();
    case TensorProto::INT64: return t.int64_data_size();
    case TensorProto::INT32:
    case TensorProto::BOOL:
    case TensorProto::UINT8:
    case TensorProto::INT8: return t.int32_data_size();
    default: return 0;
  }
}

double typed_element(const TensorProto& t, int64_t i) {
  if (t.has_raw_data()) {
    const char* p = t.raw_data().data() + i * element_size(t.data_type());
    switch (t.data_type()) {
      case TensorProto::FLOAT: {
        float v;
        std::memcpy(&v, p, 4);
        return v;
      }
      case TensorProto::DOUBLE: {
        double v;
        std::memcpy(&v, p, 8);
        return v;
      }
      case TensorProto::INT64: {
        int64_t v;
        std::memcpy(&v, p, 8);
        return static_cast<double>(v);
      }
      case TensorProto::INT32: {
        int32_t v;
        std::memcpy(&v, p, 4);
        return v;
      }
      case TensorProto::INT8: return static_cast<int8_t>(*p);
      default: return static_cast<uint8_t>(*p);  // BOOL, UINT8
    }
  }
  switch (t.data_type()) {
    case TensorProto::FLOAT: return t.float_data(static_cast<int>(i));
    case TensorProto::DOUBLE: return t.double_data(static_cast<int>(i));
    case TensorProto::INT64: return static_cast<double>(t.int64_data(static_cast<int>(i)));
    default: return t.int32_data(static_cast<int>(i));
  }
}

// Checks a tensor's dtype and byte count, then decodes it into ctx.
Status decode_tensor(TensorProto& t, const std::string& name, bool is_initializer, const std::string& base_dir,
                     detail::ImportContext& ctx) {
  const std::string what = (is_initializer ? "initializer '" : "constant '") + name + "'";
  const int esize = element_size(t.data_type());
  if (esize == 0) {
    return Status::error(what + " has data type " + detail::dtype_label(t.data_type()) +
                         "; pipeshard imports float32 models (int64/int32 for shapes)");
  }
  Result<int64_t> n = checked_elements(what, t);
  if (!n) return n.status();
  if (t.data_location() == TensorProto::EXTERNAL) {
    PIPESHARD_RETURN_IF_ERROR(load_external_data(t, base_dir, *n * esize).with_context(what));
  }
  const int64_t stored = t.has_raw_data() ? static_cast<int64_t>(t.raw_data().size()) / esize : typed_field_size(t);
  if ((t.has_raw_data() && static_cast<int64_t>(t.raw_data().size()) != *n * esize) || stored != *n) {
    return Status::error(what + " holds " + std::to_string(stored) + " elements but its dims need " +
                         std::to_string(*n) + " (truncated file?)");
  }
  std::vector<int64_t> dims(t.dims().begin(), t.dims().end());
  if (t.data_type() == TensorProto::FLOAT) {
    std::vector<float> data(static_cast<size_t>(*n));
    if (t.has_raw_data()) {
      std::memcpy(data.data(), t.raw_data().data(), data.size() * 4);
    } else {
      std::copy(t.float_data().begin(), t.float_data().end(), data.begin());
    }
    ctx.float_data[name] = std::move(data);
    ctx.float_dims[name] = dims;
  } else if (t.data_type() == TensorProto::DOUBLE && *n > detail::kMaxDecodedConstant) {
    return Status::error(what + " is float64; pipeshard trains float32 models (call model.float() before exporting)");
  }
  if (*n <= detail::kMaxDecodedConstant) {
    detail::ConstantTensor c;
    c.dims = dims;
    c.data_type = t.data_type();
    c.is_initializer = is_initializer;
    c.values.resize(static_cast<size_t>(*n));
    for (int64_t i = 0; i < *n; ++i) c.values[static_cast<size_t>(i)] = typed_element(t, i);
    ctx.constants[name] = std::move(c);
  } else if (t.data_type() != TensorProto::FLOAT) {
    ctx.constants[name] = detail::ConstantTensor{dims, {}, t.data_type(), is_initializer};
  }
  return Status::ok();
}

}  // namespace

namespace detail {

std::string dtype_label(int32_t data_type) {
  switch (data_type) {
    case TensorProto::FLOAT: return "float32";
    case TensorProto::DOUBLE: return "float64";
    case TensorProto::FLOAT16: return "float16";
    case TensorProto::BFLOAT16: return "bfloat16";
    default: break;
  }
  if (!TensorProto::DataType_IsValid(data_type)) return "unknown (" + std::to_string(data_type) + ")";
  std::string name = TensorProto::DataType_Name(static_cast<TensorProto::DataType>(data_type));
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

Status load_constants(const onnx::ModelProto& model, const std::string& base_dir, ImportContext& ctx) {
  // The source proto is ours (a shared copy the caller handed over): external data is
  // loaded into it so stage files can be written from it later.
  auto& graph = const_cast<onnx::GraphProto&>(model.graph());
  for (auto& t : *graph.mutable_initializer()) {
    if (t.name().empty()) return Status::error("an initializer has no name");
    if (ctx.float_data.count(t.name()) || ctx.constants.count(t.name())) {
      return Status::error("initializer '" + t.name() + "' is defined twice");
    }
    PIPESHARD_RETURN_IF_ERROR(decode_tensor(t, t.name(), true, base_dir, ctx));
  }
  for (int i = 0; i < graph.node_size(); ++i) {
    auto& node = *graph.mutable_node(i);
    if (node.op_type() != "Constant" || !(node.domain().empty() || node.domain() == "ai.onnx")) continue;
    if (node.output_size() != 1) return ctx.node_error(i, "Constant must have one output");
    bool found = false;
    for (auto& attr : *node.mutable_attribute()) {
      if (attr.name() == "value" && attr.has_t()) {
        PIPESHARD_RETURN_IF_ERROR(
            decode_tensor(*attr.mutable_t(), node.output(0), false, base_dir, ctx).with_context(ctx.describe(i)));
        found = true;
      } else if (attr.name() == "value_float" || attr.name() == "value_int") {
        ConstantTensor c;
        c.data_type = attr.name() == "value_float" ? TensorProto::FLOAT : TensorProto::INT64;
        c.values = {attr.name() == "value_float" ? attr.f() : static_cast<double>(attr.i())};
        ctx.constants[node.output(0)] = c;
        if (attr.name() == "value_float") {
          ctx.float_data[node.output(0)] = {attr.f()};
          ctx.float_dims[node.output(0)] = {};
        }
        found = true;
      } else if (attr.name() == "value_ints") {
        ConstantTensor c;
        c.data_type = TensorProto::INT64;
        c.dims = {attr.ints_size()};
        for (int64_t v : attr.ints()) c.values.push_back(static_cast<double>(v));
        ctx.constants[node.output(0)] = c;
        found = true;
      }
    }
    if (!found) return ctx.node_error(i, "Constant without a supported value attribute");
  }
  return Status::ok();
}

}  // namespace detail

Result<ImportedModel> import_onnx_bytes(std::string_view bytes, const std::string& base_dir, const std::string& label) {
  if (bytes.empty()) return Status::error(label + ": file is empty, not an ONNX model");
  if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return Status::error(label + ": file is larger than 2 GiB; store the weights as external data");
  }
  auto model = std::make_shared<onnx::ModelProto>();
  google::protobuf::io::CodedInputStream stream(reinterpret_cast<const uint8_t*>(bytes.data()),
                                                static_cast<int>(bytes.size()));
  stream.SetTotalBytesLimit(std::numeric_limits<int>::max());
  if (!model->ParseFromCodedStream(&stream) || !stream.ConsumedEntireMessage()) {
    return Status::error(label + ": not a valid ONNX file (protobuf parsing failed: truncated or not ONNX)");
  }
  return import_onnx_model(std::move(model), base_dir, label);
}

Result<ImportedModel> import_onnx_file(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return Status::error(path + ": no such file");
  if (fs::is_directory(path, ec)) return Status::error(path + ": is a directory, not an ONNX file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(path + ": cannot open for reading");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return import_onnx_bytes(bytes, fs::path(path).parent_path().string(), path);
}

}  // namespace pipeshard
