#include "dataset/npy.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string_view>

namespace pipeshard {
namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little,
              "npy.cc copies little-endian file bytes straight into host integers and floats");

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicBytes = 6;
// numpy itself refuses headers above 10000 bytes unless told otherwise; a bigger one here
// is a corrupt length field, not a real array.
constexpr int64_t kMaxHeaderBytes = 65536;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

// What the header dict says.
struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

// A parser for the one Python literal numpy writes: a dict of the keys 'descr' (a string),
// 'fortran_order' (True/False) and 'shape' (a tuple of non-negative ints), each exactly
// once, no other keys. Whitespace may appear between tokens; a trailing comma is allowed
// in the dict and the tuple, as in Python.
class HeaderParser {
 public:
  explicit HeaderParser(std::string_view text) : text_(text) {}

  Result<Header> parse() {
    Header h;
    bool have_descr = false, have_fortran = false, have_shape = false;
    if (!consume('{')) return error("expected '{'");
    while (!consume('}')) {
      Result<std::string> key = parse_string();
      if (!key) return key.status();
      if (!consume(':')) return error("expected ':' after key '" + *key + "'");
      if (*key == "descr") {
        if (have_descr) return error("key 'descr' appears twice");
        Result<std::string> v = parse_string();
        if (!v) return error("'descr' must be a string (structured dtypes are not supported)");
        h.descr = *v;
        have_descr = true;
      } else if (*key == "fortran_order") {
        if (have_fortran) return error("key 'fortran_order' appears twice");
        Result<bool> v = parse_bool();
        if (!v) return v.status();
        h.fortran_order = *v;
        have_fortran = true;
      } else if (*key == "shape") {
        if (have_shape) return error("key 'shape' appears twice");
        Result<std::vector<int64_t>> v = parse_shape();
        if (!v) return v.status();
        h.shape = std::move(*v);
        have_shape = true;
      } else {
        return error("unexpected key '" + *key + "' (a .npy header has 'descr', 'fortran_order', 'shape')");
      }
      if (!consume(',')) {
        if (!consume('}')) return error("expected ',' or '}' after the value of '" + *key + "'");
        break;
      }
    }
    skip_space();
    if (pos_ != text_.size()) return error("unexpected text after the closing '}'");
    if (!have_descr) return error("key 'descr' is missing");
    if (!have_fortran) return error("key 'fortran_order' is missing");
    if (!have_shape) return error("key 'shape' is missing");
    return h;
  }

 private:
  Status error(const std::string& what) const {
    return Status::error("malformed header at byte " + std::to_string(pos_) + ": " + what);
  }
  void skip_space() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r'))
      ++pos_;
  }
  bool consume(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  Result<std::string> parse_string() {
    skip_space();
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) return error("expected a quoted string");
    const char quote = text_[pos_++];
    const size_t end = text_.find(quote, pos_);
    if (end == std::string_view::npos) return error("unterminated string");
    std::string s(text_.substr(pos_, end - pos_));
    if (s.find('\\') != std::string::npos) return error("escapes in strings are not supported");
    pos_ = end + 1;
    return s;
  }
  Result<bool> parse_bool() {
    skip_space();
    for (auto [word, value] : {std::pair<std::string_view, bool>{"True", true}, {"False", false}}) {
      if (text_.substr(pos_, word.size()) == word) {
        pos_ += word.size();
        return value;
      }
    }
    return error("'fortran_order' must be True or False");
  }
  Result<std::vector<int64_t>> parse_shape() {
    std::vector<int64_t> shape;
    if (!consume('(')) return error("'shape' must be a tuple");
    while (!consume(')')) {
      skip_space();
      if (pos_ < text_.size() && text_[pos_] == '-') return error("'shape' has a negative dimension");
      if (pos_ >= text_.size() || text_[pos_] < '0' || text_[pos_] > '9') return error("'shape' must hold integers");
      int64_t d = 0;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
        const int digit = text_[pos_++] - '0';
        if (d > (kInt64Max - digit) / 10) return error("a 'shape' dimension does not fit in 64 bits");
        d = d * 10 + digit;
      }
      shape.push_back(d);
      if (shape.size() > static_cast<size_t>(kNpyMaxRank)) {
        return error("'shape' has more than " + std::to_string(kNpyMaxRank) + " dimensions");
      }
      if (!consume(',')) {
        if (!consume(')')) return error("expected ',' or ')' in 'shape'");
        // Python needs the comma in a 1-tuple: "(3)" is the integer 3, not a shape.
        if (shape.size() == 1) return error("'shape' (n) without a comma is not a tuple");
        break;
      }
    }
    return shape;
  }

  std::string_view text_;
  size_t pos_ = 0;
};

Result<NpyType> type_of_descr(const std::string& descr) {
  if (descr == "<f4") return NpyType::kFloat32;
  if (descr == "<i8") return NpyType::kInt64;
  if (descr == "<i4") return NpyType::kInt32;
  if (!descr.empty() && descr[0] == '>') {
    return Status::error("dtype '" + descr +
                         "' is big-endian; only little-endian '<f4', '<i8', '<i4' are read "
                         "(convert with arr.astype(arr.dtype.newbyteorder('<')))");
  }
  return Status::error("dtype '" + descr + "' is not supported (float32 '<f4', int64 '<i8' or int32 '<i4')");
}

// Product of `shape`, or an error when it does not fit in int64 element and byte counts.
Result<int64_t> checked_elements(const std::vector<int64_t>& shape, int64_t element_size) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return Status::error("shape " + shape_text(shape) + " has a negative dimension");
    if (d != 0 && n > kInt64Max / element_size / d) {
      return Status::error("shape " + shape_text(shape) + " overflows a 64-bit byte count");
    }
    n *= d;
  }
  return n;
}

uint64_t little_endian(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Where an array's elements lie in a .npy file, and what they are.
struct Layout {
  NpyType type = NpyType::kFloat32;
  std::vector<int64_t> shape;
  int64_t data_offset = 0;  // bytes before the first element
  int64_t data_bytes = 0;   // product(shape) * element size
};

// The preamble and header bytes needed to parse any acceptable header.
constexpr int64_t kMaxPrefixBytes = 12 + kMaxHeaderBytes;

// Parses the preamble and header from `prefix`, the first min(file_size, kMaxPrefixBytes)
// bytes of a file of `file_size` bytes, and checks that the data fills the rest exactly.
Result<Layout> parse_layout(const unsigned char* prefix, int64_t prefix_size, int64_t file_size) {
  PIPESHARD_CHECK(prefix_size == std::min(file_size, kMaxPrefixBytes), "the whole prefix is read");
  // Magic (6), version (2), header length (2 for 1.0, 4 for 2.0/3.0).
  if (file_size < 10) {
    return Status::error("too short to be a .npy file (" + std::to_string(file_size) + " bytes)");
  }
  if (std::memcmp(prefix, kMagic, kMagicBytes) != 0) return Status::error("not a .npy file (bad magic)");
  const int major = prefix[6], minor = prefix[7];
  if (!((major == 1 || major == 2 || major == 3) && minor == 0)) {
    return Status::error("unsupported .npy format version " + std::to_string(major) + "." + std::to_string(minor) +
                         " (1.0, 2.0 and 3.0 are read)");
  }
  const int length_bytes = major == 1 ? 2 : 4;
  const int64_t preamble_bytes = 8 + length_bytes;
  if (file_size < preamble_bytes)
    return Status::error("too short for a version " + std::to_string(major) + ".0 header");
  const auto header_bytes = static_cast<int64_t>(little_endian(prefix + 8, length_bytes));
  if (header_bytes > kMaxHeaderBytes) {
    return Status::error("header length " + std::to_string(header_bytes) + " is implausible (corrupt file?)");
  }
  if (header_bytes > file_size - preamble_bytes) {
    return Status::error("header of " + std::to_string(header_bytes) + " bytes runs past the end of the file (" +
                         std::to_string(file_size) + " bytes; truncated?)");
  }
  const std::string_view text(reinterpret_cast<const char*>(prefix) + preamble_bytes,
                              static_cast<size_t>(header_bytes));
  if (text.empty() || text.back() != '\n') return Status::error("malformed header: it does not end with a newline");
  if (text.find('\0') != std::string_view::npos) return Status::error("malformed header: it contains a NUL byte");

  Result<Header> header = HeaderParser(text).parse();
  if (!header) return header.status();
  Result<NpyType> type = type_of_descr(header->descr);
  if (!type) return type.status();
  if (header->fortran_order) {
    return Status::error("Fortran-order (column-major) arrays are not supported; save np.ascontiguousarray(arr)");
  }
  const int64_t esize = npy_type_size(*type);
  Result<int64_t> elements = checked_elements(header->shape, esize);
  if (!elements) return elements.status();
  const int64_t need = *elements * esize;
  const int64_t have = file_size - preamble_bytes - header_bytes;
  if (need > have) {
    return Status::error("shape " + shape_text(header->shape) + " of " + npy_type_name(*type) + " needs " +
                         std::to_string(need) + " data bytes, the file holds " + std::to_string(have) +
                         " (truncated?)");
  }
  if (need < have) {
    return Status::error(std::to_string(have - need) + " bytes follow the " + std::to_string(need) +
                         " data bytes of shape " + shape_text(header->shape) + " (corrupt file?)");
  }
  return Layout{*type, std::move(header->shape), preamble_bytes + header_bytes, need};
}

Result<NpyArray> read_npy_unlabelled(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return Status::error("no such file");
  if (!fs::is_regular_file(path, ec)) return Status::error("not a regular file");
  const auto file_size = static_cast<int64_t>(fs::file_size(path, ec));
  if (ec) return Status::error("cannot determine the file size");
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error("cannot open for reading");

  // Only the prefix is read before the checks: the data is read once, straight into the
  // array, and only after the header has proven the file is as long as it says.
  std::vector<unsigned char> prefix(static_cast<size_t>(std::min(file_size, kMaxPrefixBytes)));
  if (!in.read(reinterpret_cast<char*>(prefix.data()), static_cast<std::streamsize>(prefix.size()))) {
    return Status::error("cannot read the file");
  }
  Result<Layout> layout = parse_layout(prefix.data(), static_cast<int64_t>(prefix.size()), file_size);
  if (!layout) return layout.status();

  NpyArray array;
  array.path = path;
  array.type = layout->type;
  array.shape = std::move(layout->shape);
  array.bytes.resize(static_cast<size_t>(layout->data_bytes));
  in.seekg(layout->data_offset);
  if (layout->data_bytes > 0 && !in.read(reinterpret_cast<char*>(array.bytes.data()), layout->data_bytes)) {
    return Status::error("cannot read the data");
  }
  return array;
}

// Closes a file descriptor when it goes out of scope.
struct FileCloser {
  int fd;
  ~FileCloser() { ::close(fd); }
};

Result<NpyView> map_npy_unlabelled(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return Status::error("no such file");
  if (!fs::is_regular_file(path, ec)) return Status::error("not a regular file");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::error(std::string("cannot open for reading: ") + std::strerror(errno));
  const FileCloser closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    return Status::error(std::string("cannot determine the file size: ") + std::strerror(errno));
  const auto file_size = static_cast<int64_t>(st.st_size);
  std::vector<unsigned char> prefix(static_cast<size_t>(std::min(file_size, kMaxPrefixBytes)));
  size_t got = 0;
  while (got < prefix.size()) {
    const ssize_t n = ::pread(fd, prefix.data() + got, prefix.size() - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::error("cannot read the file");
    got += static_cast<size_t>(n);
  }
  Result<Layout> layout = parse_layout(prefix.data(), static_cast<int64_t>(prefix.size()), file_size);
  if (!layout) return layout.status();
  NpyView view;
  view.path = path;
  view.type = layout->type;
  view.shape = std::move(layout->shape);
  if (layout->data_bytes == 0) return view;  // nothing to map (mmap refuses a length of 0)
  void* base = ::mmap(nullptr, static_cast<size_t>(file_size), PROT_READ, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return Status::error(std::string("cannot map the file: ") + std::strerror(errno));
  const auto size = static_cast<size_t>(file_size);
  view.owner = std::shared_ptr<const void>(base, [size](const void* p) { ::munmap(const_cast<void*>(p), size); });
  view.data = static_cast<const uint8_t*>(base) + layout->data_offset;
  return view;
}

Result<NpyArray> parse_npy_unlabelled(std::string_view bytes, const std::string& label) {
  const auto size = static_cast<int64_t>(bytes.size());
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  Result<Layout> layout = parse_layout(data, std::min(size, kMaxPrefixBytes), size);
  if (!layout) return layout.status();
  NpyArray array;
  array.path = label;
  array.type = layout->type;
  array.shape = std::move(layout->shape);
  array.bytes.assign(data + layout->data_offset, data + layout->data_offset + layout->data_bytes);
  return array;
}

Status write_npy_bytes(const std::string& path, const std::vector<int64_t>& shape, NpyType type, const void* data) {
  if (shape.size() > static_cast<size_t>(kNpyMaxRank)) {
    return Status::error(path + ": cannot write a " + std::to_string(shape.size()) + "-d array (at most " +
                         std::to_string(kNpyMaxRank) + " dims)");
  }
  Result<int64_t> elements = checked_elements(shape, npy_type_size(type));
  if (!elements) return elements.status().with_context(path);
  const char* descr = type == NpyType::kFloat32 ? "<f4" : type == NpyType::kInt64 ? "<i8" : "<i4";
  std::string header =
      std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape_text(shape) + ", }";
  // Pad with spaces so that the data starts at a multiple of 64 bytes, as numpy does.
  const size_t preamble = 10;
  const size_t total = (preamble + header.size() + 1 + 63) / 64 * 64;
  header.append(total - preamble - header.size() - 1, ' ');
  header.push_back('\n');
  PIPESHARD_CHECK(header.size() <= 65535, "a 1.0 header holds at most 65535 bytes");

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Status::error(path + ": cannot open for writing");
  const unsigned char version_and_length[4] = {1, 0, static_cast<unsigned char>(header.size() & 0xff),
                                               static_cast<unsigned char>(header.size() >> 8)};
  out.write(kMagic, kMagicBytes);
  out.write(reinterpret_cast<const char*>(version_and_length), 4);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  if (*elements > 0) {
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(*elements * npy_type_size(type)));
  }
  out.close();
  if (!out) return Status::error(path + ": cannot write (disk full?)");
  return Status::ok();
}

}  // namespace

const char* npy_type_name(NpyType type) {
  switch (type) {
    case NpyType::kFloat32: return "float32";
    case NpyType::kInt64: return "int64";
    case NpyType::kInt32: return "int32";
  }
  return "?";
}

int64_t npy_type_size(NpyType type) { return type == NpyType::kInt64 ? 8 : 4; }

int64_t NpyArray::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Status NpyArray::expect_type(NpyType want) const {
  if (type == want) return Status::ok();
  return Status::error((path.empty() ? std::string("array") : path) + ": holds " + npy_type_name(type) +
                       " data, expected " + npy_type_name(want));
}

std::vector<float> NpyArray::as_float() const {
  PIPESHARD_CHECK(type == NpyType::kFloat32, std::string("as_float() on ") + npy_type_name(type) + " data");
  PIPESHARD_CHECK(static_cast<int64_t>(bytes.size()) == elements() * 4, "byte count matches the shape");
  std::vector<float> out(bytes.size() / 4);
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

std::vector<int64_t> NpyArray::as_int64() const {
  PIPESHARD_CHECK(type == NpyType::kInt64 || type == NpyType::kInt32,
                  std::string("as_int64() on ") + npy_type_name(type) + " data");
  PIPESHARD_CHECK(static_cast<int64_t>(bytes.size()) == elements() * npy_type_size(type),
                  "byte count matches the shape");
  std::vector<int64_t> out(static_cast<size_t>(elements()));
  if (type == NpyType::kInt64) {
    if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  } else {
    for (size_t i = 0; i < out.size(); ++i) {
      int32_t v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      out[i] = v;
    }
  }
  return out;
}

Result<NpyArray> read_npy(const std::string& path) {
  Result<NpyArray> array = read_npy_unlabelled(path);
  if (!array) return array.status().with_context(path);
  return array;
}

Result<NpyView> map_npy(const std::string& path) {
  Result<NpyView> view = map_npy_unlabelled(path);
  if (!view) return view.status().with_context(path);
  return view;
}

int64_t NpyView::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

NpyView view_npy(NpyArray array) {
  auto owned = std::make_shared<const NpyArray>(std::move(array));
  NpyView view;
  view.path = owned->path;
  view.type = owned->type;
  view.shape = owned->shape;
  view.data = owned->bytes.data();
  view.owner = owned;
  return view;
}

Result<NpyArray> parse_npy(std::string_view bytes, const std::string& label) {
  Result<NpyArray> array = parse_npy_unlabelled(bytes, label);
  if (!array) return array.status().with_context(label);
  return array;
}

Status write_npy(const std::string& path, const std::vector<int64_t>& shape, const float* data) {
  return write_npy_bytes(path, shape, NpyType::kFloat32, data);
}
Status write_npy(const std::string& path, const std::vector<int64_t>& shape, const int64_t* data) {
  return write_npy_bytes(path, shape, NpyType::kInt64, data);
}
Status write_npy(const std::string& path, const std::vector<int64_t>& shape, const int32_t* data) {
  return write_npy_bytes(path, shape, NpyType::kInt32, data);
}

}  // namespace pipeshard
