// Tests for the .npy reader and writer: round trips, every refusal (malformed files written
// byte by byte), and the numpy-written files checked into models/reference and data/.
#include "dataset/npy.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::ScratchDir;
using testing::source_path;

// The bytes of a .npy file with `header` as its dict text (padded with spaces and a newline
// to a multiple of 64 as numpy does), format version major.minor, then `data`.
std::string npy_bytes(const std::string& header, const std::string& data, int major = 1, int minor = 0) {
  const size_t length_bytes = major == 1 ? 2 : 4;
  const size_t preamble = 8 + length_bytes;
  std::string text = header;
  const size_t total = (preamble + text.size() + 1 + 63) / 64 * 64;
  text.append(total - preamble - text.size() - 1, ' ');
  text.push_back('\n');
  std::string out = "\x93NUMPY";
  out.push_back(static_cast<char>(major));
  out.push_back(static_cast<char>(minor));
  for (size_t i = 0; i < length_bytes; ++i) out.push_back(static_cast<char>((text.size() >> (8 * i)) & 0xff));
  return out + text + data;
}

std::string float_bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

const char kF4x2[] = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";

// Reads `bytes` from a scratch file and expects a refusal whose message names the file and
// contains `expected`.
void expect_refused(const std::string& bytes, const std::string& expected) {
  ScratchDir dir("npy");
  const std::string path = dir / "bad.npy";
  write_file(path, bytes);
  Result<NpyArray> r = read_npy(path);
  ASSERT_FALSE(r.is_ok()) << "accepted a file that should fail with '" << expected << "'";
  const std::string& msg = r.status().message();
  EXPECT_EQ(msg.rfind(path + ": ", 0), 0u) << msg;
  EXPECT_NE(msg.find(expected), std::string::npos) << "message: " << msg << "\nexpected to contain: " << expected;
}

// ---- Round trips --------------------------------------------------------------------------

TEST(NpyTest, RoundTripFloat32) {
  ScratchDir dir("npy");
  const std::vector<float> data = {1.5f, -2.25f, 0.0f, 3e-8f, -1e30f, 7.0f};
  ASSERT_TRUE(write_npy(dir / "a.npy", {2, 3}, data.data()));
  Result<NpyArray> r = read_npy(dir / "a.npy");
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->type, NpyType::kFloat32);
  EXPECT_EQ(r->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(r->elements(), 6);
  EXPECT_EQ(r->path, dir / "a.npy");
  EXPECT_EQ(r->as_float(), data);
  EXPECT_TRUE(r->expect_type(NpyType::kFloat32));
}

TEST(NpyTest, WrittenHeaderIsWhatNumpyWrites) {
  ScratchDir dir("npy");
  const std::vector<float> data = {1.0f, 2.0f};
  ASSERT_TRUE(write_npy(dir / "a.npy", {2}, data.data()));
  const std::string bytes = testing::read_text(dir / "a.npy");
  // numpy.save(np.array([1, 2], np.float32)) writes exactly these bytes: a header padded
  // to 128 bytes in all (the data 64-byte aligned), then the two floats.
  EXPECT_EQ(bytes, npy_bytes(kF4x2, float_bytes(data)));
  ASSERT_EQ(bytes.size(), 128u + 8u);
  EXPECT_EQ(bytes.substr(8, 2), std::string("\x76\x00", 2)) << "header length 118, little-endian";
  EXPECT_EQ(bytes[127], '\n');
}

TEST(NpyTest, RoundTripInt64AndInt32) {
  ScratchDir dir("npy");
  const std::vector<int64_t> labels = {0, 9, -3, int64_t{1} << 40};
  ASSERT_TRUE(write_npy(dir / "l.npy", {4}, labels.data()));
  Result<NpyArray> r = read_npy(dir / "l.npy");
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->type, NpyType::kInt64);
  EXPECT_EQ(r->as_int64(), labels);

  const std::vector<int32_t> small = {7, -1, 2147483647, -2147483647 - 1, 0, 5};
  ASSERT_TRUE(write_npy(dir / "s.npy", {3, 2}, small.data()));
  Result<NpyArray> s = read_npy(dir / "s.npy");
  ASSERT_TRUE(s.is_ok()) << s.status().message();
  EXPECT_EQ(s->type, NpyType::kInt32);
  EXPECT_EQ(s->shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(s->as_int64(), (std::vector<int64_t>{7, -1, 2147483647, -2147483648LL, 0, 5}));
}

TEST(NpyTest, RoundTripScalarAndEmpty) {
  ScratchDir dir("npy");
  const float one = 4.5f;
  ASSERT_TRUE(write_npy(dir / "scalar.npy", {}, &one));
  Result<NpyArray> s = read_npy(dir / "scalar.npy");
  ASSERT_TRUE(s.is_ok()) << s.status().message();
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(s->elements(), 1);
  EXPECT_EQ(s->as_float(), std::vector<float>{4.5f});

  ASSERT_TRUE(write_npy(dir / "empty.npy", {0, 5}, static_cast<const float*>(nullptr)));
  Result<NpyArray> e = read_npy(dir / "empty.npy");
  ASSERT_TRUE(e.is_ok()) << e.status().message();
  EXPECT_EQ(e->shape, (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(e->elements(), 0);
  EXPECT_TRUE(e->as_float().empty());
}

TEST(NpyTest, ExpectTypeNamesFileAndTypes) {
  ScratchDir dir("npy");
  const std::vector<int64_t> labels = {1, 2};
  ASSERT_TRUE(write_npy(dir / "l.npy", {2}, labels.data()));
  Result<NpyArray> r = read_npy(dir / "l.npy");
  ASSERT_TRUE(r.is_ok());
  Status st = r->expect_type(NpyType::kFloat32);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.message(), dir / "l.npy" + ": holds int64 data, expected float32");
}

TEST(NpyTest, WriteRefusesBadShapesAndPaths) {
  ScratchDir dir("npy");
  const float x = 0.0f;
  Status neg = write_npy(dir / "n.npy", {2, -1}, &x);
  ASSERT_FALSE(neg.is_ok());
  EXPECT_NE(neg.message().find("negative dimension"), std::string::npos) << neg.message();
  Status missing = write_npy(dir / "no/such/folder/x.npy", {1}, &x);
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.message().find("cannot open for writing"), std::string::npos) << missing.message();
}

// ---- Versions 2.0 and 3.0 -----------------------------------------------------------------

TEST(NpyTest, ReadsVersions2And3) {
  for (int major : {2, 3}) {
    ScratchDir dir("npy");
    write_file(dir / "v.npy", npy_bytes(kF4x2, float_bytes({3.0f, -4.0f}), major));
    Result<NpyArray> r = read_npy(dir / "v.npy");
    ASSERT_TRUE(r.is_ok()) << "version " << major << ".0: " << r.status().message();
    EXPECT_EQ(r->as_float(), (std::vector<float>{3.0f, -4.0f}));
  }
}

TEST(NpyTest, AcceptsHeaderSpellingsNumpyAccepts) {
  // Double quotes, no trailing commas, keys in another order, extra spaces.
  ScratchDir dir("npy");
  write_file(dir / "h.npy",
             npy_bytes("{ \"shape\" : ( 1 , 2 ) , \"fortran_order\":False,\"descr\":\"<f4\"}", float_bytes({1, 2})));
  Result<NpyArray> r = read_npy(dir / "h.npy");
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->shape, (std::vector<int64_t>{1, 2}));
}

// ---- Refusals -----------------------------------------------------------------------------

TEST(NpyTest, RefusesMissingFileAndDirectory) {
  ScratchDir dir("npy");
  Result<NpyArray> missing = read_npy(dir / "absent.npy");
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().message(), dir / "absent.npy" + ": no such file");
  Result<NpyArray> folder = read_npy(dir.path());
  ASSERT_FALSE(folder.is_ok());
  EXPECT_EQ(folder.status().message(), dir.path() + ": not a regular file");
}

TEST(NpyTest, RefusesShortFileAndBadMagic) {
  expect_refused("", "too short to be a .npy file (0 bytes)");
  expect_refused("\x93NUM", "too short to be a .npy file (4 bytes)");
  std::string bad = npy_bytes(kF4x2, float_bytes({1, 2}));
  bad[1] = 'X';
  expect_refused(bad, "not a .npy file (bad magic)");
  expect_refused("PK\x03\x04 this is a zip, e.g. an .npz", "bad magic");
}

TEST(NpyTest, RefusesUnknownVersions) {
  expect_refused(npy_bytes(kF4x2, float_bytes({1, 2}), 4, 0), "unsupported .npy format version 4.0");
  expect_refused(npy_bytes(kF4x2, float_bytes({1, 2}), 1, 1), "unsupported .npy format version 1.1");
  expect_refused(npy_bytes(kF4x2, float_bytes({1, 2}), 0, 0), "unsupported .npy format version 0.0");
}

TEST(NpyTest, RefusesHeaderPastTheEnd) {
  std::string bytes = npy_bytes(kF4x2, "");
  expect_refused(bytes.substr(0, 40), "header of 118 bytes runs past the end of the file (40 bytes; truncated?)");
  // A version 2.0 length field claiming 4 GiB.
  std::string huge = "\x93NUMPY\x02";
  huge += std::string("\0\xff\xff\xff\xff", 5);
  expect_refused(huge + "{}\n", "header length 4294967295 is implausible");
  expect_refused(std::string("\x93NUMPY\x02\0\x10\0\0", 11), "too short for a version 2.0 header");
}

TEST(NpyTest, RefusesMalformedHeaders) {
  const std::string data = float_bytes({1, 2});
  std::string no_newline = npy_bytes(kF4x2, data);
  no_newline[127] = ' ';
  expect_refused(no_newline, "malformed header: it does not end with a newline");
  expect_refused(npy_bytes("not a dict", data), "malformed header at byte 0: expected '{'");
  expect_refused(npy_bytes("{'descr': '<f4', 'shape': (2,), }", data), "key 'fortran_order' is missing");
  expect_refused(npy_bytes("{'fortran_order': False, 'shape': (2,), }", data), "key 'descr' is missing");
  expect_refused(npy_bytes("{'descr': '<f4', 'fortran_order': False}", data), "key 'shape' is missing");
  expect_refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", data),
                 "unexpected key 'x'");
  expect_refused(npy_bytes("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", data),
                 "key 'descr' appears twice");
  expect_refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': [2]}", data), "'shape' must be a tuple");
  expect_refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2)}", data),
                 "without a comma is not a tuple");
  expect_refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2.0,)}", data),
                 "expected ',' or ')' in 'shape'");
  expect_refused(npy_bytes("{'descr': '<f4', 'fortran_order': 0, 'shape': (2,)}", data),
                 "'fortran_order' must be True or False");
  expect_refused(npy_bytes("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,)}", data),
                 "structured dtypes are not supported");
  expect_refused(npy_bytes("{'descr': '<f4, 'fortran_order': False, 'shape': (2,)}", data), "malformed header");
  expect_refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk", data),
                 "unexpected text after the closing '}'");
  expect_refused(npy_bytes(std::string("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}") + '\0', data),
                 "NUL byte");
}

TEST(NpyTest, RefusesUnsupportedDtypes) {
  expect_refused(npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", float_bytes({1, 2})),
                 "dtype '>f4' is big-endian");
  expect_refused(npy_bytes("{'descr': '>i8', 'fortran_order': False, 'shape': (1,), }", std::string(8, '\0')),
                 "dtype '>i8' is big-endian");
  for (const char* descr : {"<f8", "<f2", "|b1", "|u1", "<u4", "<c8", "|O", "f4"}) {
    expect_refused(npy_bytes(std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (2,), }",
                             std::string(16, '\0')),
                   std::string("dtype '") + descr + "' is not supported (float32 '<f4', int64 '<i8' or int32 '<i4')");
  }
}

TEST(NpyTest, RefusesFortranOrder) {
  expect_refused(npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", float_bytes({1, 2, 3, 4})),
                 "Fortran-order (column-major) arrays are not supported");
}

TEST(NpyTest, RefusesTruncatedAndTrailingData) {
  const std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  expect_refused(npy_bytes(header, float_bytes({1, 2, 3, 4, 5})),
                 "shape (2, 3) of float32 needs 24 data bytes, the file holds 20 (truncated?)");
  expect_refused(npy_bytes(header, float_bytes({1, 2, 3, 4, 5, 6}) + "x"),
                 "1 bytes follow the 24 data bytes of shape (2, 3)");
  expect_refused(npy_bytes("{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }", std::string(23, '\0')),
                 "shape (3,) of int64 needs 24 data bytes, the file holds 23");
}

TEST(NpyTest, RefusesAbsurdShapes) {
  // Each dimension fits in int64 but the product does not.
  expect_refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", ""),
                 "shape (4294967296, 4294967296) overflows a 64-bit byte count");
  // Fits in 64 bits, but is far larger than the file.
  expect_refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1000000, 1000000), }", ""),
                 "needs 4000000000000 data bytes, the file holds 0");
  // A dimension with more digits than int64 holds.
  expect_refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", ""),
                 "a 'shape' dimension does not fit in 64 bits");
  expect_refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", ""),
                 "'shape' has a negative dimension");
  std::string deep = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  for (int i = 0; i < kNpyMaxRank + 1; ++i) deep += "1, ";
  expect_refused(npy_bytes(deep + "), }", float_bytes({1})), "'shape' has more than 32 dimensions");
}

// ---- Files written by numpy ---------------------------------------------------------------

TEST(NpyTest, ReadsEveryReferenceFile) {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(source_path("models/reference"))) {
    if (entry.path().extension() != ".npy") continue;
    ++files;
    Result<NpyArray> r = read_npy(entry.path().string());
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    EXPECT_EQ(r->type, NpyType::kFloat32) << entry.path();
    ASSERT_GE(r->shape.size(), 2u) << entry.path();
    EXPECT_EQ(r->shape[0], 3) << entry.path() << ": the references hold a batch of 3";
  }
  EXPECT_GE(files, 2);
}

TEST(NpyTest, ReadsTorchSeededInput) {
  // simple.input.npy is torch.manual_seed(0); torch.randn(3, 100), whose first values
  // (torch's vectorised normal sampler, used for 16 or more elements) are well known.
  Result<NpyArray> r = read_npy(source_path("models/reference/simple.input.npy"));
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->shape, (std::vector<int64_t>{3, 100}));
  const std::vector<float> x = r->as_float();
  const float expected[] = {-1.1258f, -1.1524f, -0.2506f, -0.4339f, 0.8487f};
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(x[i], expected[i], 1e-4) << "element " << i;
}

TEST(NpyTest, RewritesNumpyFilesByteForByte) {
  // What write_npy writes is what numpy.save wrote, header padding included.
  ScratchDir dir("npy");
  for (const char* rel :
       {"models/reference/simple.input.npy", "models/reference/flatten.input.npy", "data/digits_labels.npy"}) {
    Result<NpyArray> r = read_npy(source_path(rel));
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    Status st = r->type == NpyType::kFloat32 ? write_npy(dir / "copy.npy", r->shape, r->as_float().data())
                                             : write_npy(dir / "copy.npy", r->shape, r->as_int64().data());
    ASSERT_TRUE(st) << st.message();
    EXPECT_TRUE(testing::read_text(dir / "copy.npy") == testing::read_text(source_path(rel))) << rel;
  }
}

TEST(NpyTest, ReadsDigitsDataSet) {
  Result<NpyArray> features = read_npy(source_path("data/digits_features.npy"));
  Result<NpyArray> images = read_npy(source_path("data/digits_images.npy"));
  Result<NpyArray> labels = read_npy(source_path("data/digits_labels.npy"));
  ASSERT_TRUE(features.is_ok()) << features.status().message();
  ASSERT_TRUE(images.is_ok()) << images.status().message();
  ASSERT_TRUE(labels.is_ok()) << labels.status().message();
  EXPECT_EQ(features->shape, (std::vector<int64_t>{1797, 64}));
  EXPECT_EQ(images->shape, (std::vector<int64_t>{1797, 1, 8, 8}));
  EXPECT_EQ(labels->shape, (std::vector<int64_t>{1797}));
  ASSERT_TRUE(features->expect_type(NpyType::kFloat32));
  ASSERT_TRUE(labels->expect_type(NpyType::kInt64));

  const std::vector<float> f = features->as_float();
  EXPECT_EQ(f, images->as_float()) << "images are the features reshaped";
  for (float v : f) ASSERT_TRUE(v >= 0.0f && v <= 1.0f) << v;
  // sklearn's first digit (a 0) starts 0 0 5 13 9 1 0 0 (pixel counts out of 16).
  const float first_row[] = {0, 0, 5, 13, 9, 1, 0, 0};
  for (int i = 0; i < 8; ++i) EXPECT_FLOAT_EQ(f[i], first_row[i] / 16.0f) << "pixel " << i;

  const std::vector<int64_t> y = labels->as_int64();
  int count[10] = {};
  for (int64_t v : y) {
    ASSERT_TRUE(v >= 0 && v <= 9) << v;
    ++count[v];
  }
  for (int c = 0; c < 10; ++c) EXPECT_GT(count[c], 150) << "class " << c;
  EXPECT_EQ((std::vector<int64_t>(y.begin(), y.begin() + 10)), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

}  // namespace
}  // namespace pipeshard
