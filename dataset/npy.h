// NumPy .npy files: reading the arrays that numpy.save writes, and writing arrays numpy.load
// reads back. Used by the tests (PyTorch reference inputs and outputs) and by the tools for
// data sets (features float32 [samples, ...], labels int64 [samples]).
//
// Format (numpy.lib.format): the magic "\x93NUMPY", a version byte pair (1.0, 2.0 or 3.0),
// a little-endian header length (2 bytes for 1.0, 4 bytes for 2.0/3.0), a Python dict
// literal {'descr': ..., 'fortran_order': ..., 'shape': (...), } padded with spaces and
// ended by '\n', then the raw elements.
//
// The reader is strict: it accepts only little-endian float32 ('<f4'), int64 ('<i8') and
// int32 ('<i4') in C order, and the data must be exactly as long as the shape says. Every
// refusal is a Status whose message starts with the file's path and names the problem
// (bad magic, unsupported version, malformed header, big-endian or other dtype, Fortran
// order, a shape that overflows or exceeds the file, truncated or trailing data).
//
// Hosts are assumed little-endian (checked at compile time in npy.cc).
#ifndef PIPESHARD_DATASET_NPY_H_
#define PIPESHARD_DATASET_NPY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pipeshard {

// Element types a .npy file may hold here.
enum class NpyType {
  kFloat32,  // descr '<f4'
  kInt64,    // descr '<i8'
  kInt32,    // descr '<i4'
};

// "float32", "int64", "int32".
const char* npy_type_name(NpyType type);
// Bytes per element: 4, 8, 4.
int64_t npy_type_size(NpyType type);

// Shapes with more dimensions than this are refused (reading and writing).
inline constexpr int kNpyMaxRank = 32;

// One array read from (or to be written to) a .npy file. Owns its bytes.
struct NpyArray {
  std::string path;  // the file it was read from, for messages; may be empty
  NpyType type = NpyType::kFloat32;
  std::vector<int64_t> shape;  // row-major (C order); empty for a 0-d scalar
  std::vector<uint8_t> bytes;  // [elements() * npy_type_size(type)], little-endian

  // Product of `shape` (1 for a scalar).
  int64_t elements() const;
  // OK when `type` is `want`; otherwise "<path>: holds int64 data, expected float32".
  Status expect_type(NpyType want) const;
  // The elements as floats. Requires type == kFloat32 (a broken invariant otherwise:
  // check with expect_type first when the file comes from a user).
  std::vector<float> as_float() const;
  // The elements as int64. Requires type kInt64 or kInt32 (int32 is widened).
  std::vector<int64_t> as_int64() const;
};

// Reads the .npy file at `path`. Errors name the path and the problem; see the top of
// this file for what is accepted.
Result<NpyArray> read_npy(const std::string& path);

// Reads a .npy file held in memory (`bytes`, borrowed for the call), with the same checks
// as read_npy; `label` stands for the path in messages and in NpyArray::path. The data is
// copied into the result, so an array is never larger than `bytes`.
Result<NpyArray> parse_npy(std::string_view bytes, const std::string& label);

// An array's elements where they already lie: in a file mapped read-only (map_npy), or in
// an NpyArray held in memory (view_npy). Copies share the bytes' owner.
struct NpyView {
  std::string path;  // for messages
  NpyType type = NpyType::kFloat32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;      // [elements() * npy_type_size(type)], little-endian
  std::shared_ptr<const void> owner;  // keeps `data` alive: the mapping, or the array

  int64_t elements() const;
  int64_t bytes() const { return elements() * npy_type_size(type); }
};

// Maps the .npy file at `path` read-only (mmap, MAP_SHARED): only the header is read and
// checked, as read_npy checks it, so this costs the same for 1 KB and for 100 GB. Pages are
// read as they are touched, into the page cache, which every process mapping the file
// shares; none of it counts as the process's anonymous memory. Errors as read_npy's.
Result<NpyView> map_npy(const std::string& path);

// A view of `array`, which the view then owns.
NpyView view_npy(NpyArray array);

// Writes a C-order little-endian .npy file, format version 1.0, that numpy.load reads.
// `data` points at product(shape) elements (one element for an empty `shape`); the caller
// keeps ownership. Errors: a negative dimension, more than kNpyMaxRank dims, or the file
// cannot be written ("<path>: cannot write ...").
Status write_npy(const std::string& path, const std::vector<int64_t>& shape, const float* data);
Status write_npy(const std::string& path, const std::vector<int64_t>& shape, const int64_t* data);
Status write_npy(const std::string& path, const std::vector<int64_t>& shape, const int32_t* data);

}  // namespace pipeshard

#endif  // PIPESHARD_DATASET_NPY_H_
