// The NCCL communicator (comm/nccl/comm_nccl.h) on a group of one: every method, against the
// values it must give. NCCL refuses two ranks of one communicator on one GPU and the test
// machine has one, so this is the group that runs; what it proves is the plumbing (the
// bootstrap over MPI, non-blocking set-up, device buffers, streams, events, requests,
// transfers with itself, splits, shutdown), not the arithmetic across ranks, which NCCL
// does. Registered in tests/CMakeLists.txt under mpiexec -n 1 (label "gpu"), so that the
// unique id travels over MPI as in a real run; without a launcher it runs on the group of
// one. Without a usable GPU every test skips and says why.
//
// NcclConformance runs the Communicator conformance suite (testing/comm_conformance.h),
// which every communicator runs, on the same group, with its buffers in GPU memory.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "comm/nccl/comm_nccl.h"
#include "testing/comm_conformance.h"
#include "tests/cuda/gpu_test_util.h"

namespace pipeshard {
namespace {

Communicator* g_world = nullptr;    // make_world_communicator()
Communicator* g_nccl = nullptr;     // over g_world, ordered after g_producer
Communicator* g_synced = nullptr;   // over g_world, no producer: synchronises the device
cudaStream_t g_producer = nullptr;  // stands for the CUDA backend's stream
std::string g_no_gpu;               // why there is no usable GPU; empty when there is one

void check_cuda(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    std::fprintf(stderr, "nccl_comm_test: %s: %s\n", what, cudaGetErrorString(rc));
    std::abort();
  }
}

// A device copy of a host vector.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : n_(host.size()) {
    check_cuda(cudaMalloc(&data_, sizeof(T) * std::max<size_t>(n_, 1)), "cudaMalloc");
    if (n_ > 0) check_cuda(cudaMemcpy(data_, host.data(), sizeof(T) * n_, cudaMemcpyHostToDevice), "upload");
  }
  explicit DeviceArray(size_t n, T fill = T{}) : DeviceArray(std::vector<T>(n, fill)) {}
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* data() const { return data_; }
  std::vector<T> host() const {
    std::vector<T> out(n_);
    if (n_ > 0) check_cuda(cudaMemcpy(out.data(), data_, sizeof(T) * n_, cudaMemcpyDeviceToHost), "download");
    return out;
  }

 private:
  size_t n_;
  T* data_ = nullptr;
};

// Values whose bits must survive: signs, a negative zero, large and tiny magnitudes.
std::vector<float> pattern(size_t n, float seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    const float magnitude = std::ldexp(seed + 0.37f * static_cast<float>(i % 101), static_cast<int>(i % 17) - 8);
    v[i] = i % 3 == 0 ? -magnitude : magnitude;
  }
  if (n > 1) v[1] = -0.0f;
  return v;
}

void expect_bitwise_equal(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int failures = 0;
  for (size_t i = 0; i < want.size() && failures < 5; ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      ++failures;
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
}

class NcclCommTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!g_no_gpu.empty()) GTEST_SKIP() << g_no_gpu;
  }
  Communicator& nccl() { return *g_nccl; }
};

TEST_F(NcclCommTest, IsAGroupOfOne) {
  EXPECT_EQ(nccl().rank(), 0);
  EXPECT_EQ(nccl().size(), 1);
  EXPECT_EQ(g_synced->size(), 1);
}

TEST_F(NcclCommTest, AllReduceLeavesTheValuesOfAGroupOfOneBitForBit) {
  const size_t n = (size_t{1} << 20) + 3;  // more than one grid of the division kernel
  const std::vector<float> values = pattern(n, 1.25f);
  DeviceArray<float> data(values);
  nccl().all_reduce(data.data(), static_cast<int64_t>(n), ReduceOp::kSum);
  expect_bitwise_equal(data.host(), values, "sum");
  nccl().all_reduce(data.data(), static_cast<int64_t>(n), ReduceOp::kAverage);  // NCCL sum, then / 1.0f
  expect_bitwise_equal(data.host(), values, "average");
  nccl().all_reduce(nullptr, 0, ReduceOp::kSum);
}

TEST_F(NcclCommTest, AsyncAllReducesCompleteInAnyOrder) {
  const std::vector<float> a_values = pattern(1000, 0.5f), b_values = pattern(333, -2.0f);
  DeviceArray<float> a(a_values), b(b_values);
  std::unique_ptr<Request> first = nccl().all_reduce_async(a.data(), 1000, ReduceOp::kAverage);
  std::unique_ptr<Request> second = nccl().all_reduce_async(b.data(), 333, ReduceOp::kSum);
  nccl().progress();
  second->wait();
  first->wait();
  first->wait();  // a second wait returns at once
  expect_bitwise_equal(a.host(), a_values, "first");
  expect_bitwise_equal(b.host(), b_values, "second");
  {
    std::unique_ptr<Request> unwaited = nccl().all_reduce_async(a.data(), 1000, ReduceOp::kSum);
  }  // destroying it waited for it
  expect_bitwise_equal(a.host(), a_values, "destroyed unwaited");
  nccl().all_reduce_async(nullptr, 0, ReduceOp::kSum)->wait();
}

TEST_F(NcclCommTest, DoubleSumsOnTheDeviceAndOnTheHost) {
  const std::vector<double> values{1.0 / 3.0, -2.5e300, 7.0, -0.0, 1e-310};
  DeviceArray<double> data(values);
  nccl().all_reduce_sum(data.data(), static_cast<int64_t>(values.size()));
  const std::vector<double> got = data.host();
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(std::memcmp(&got[i], &values[i], sizeof(double)), 0) << i;
  EXPECT_EQ(nccl().all_reduce_sum(0.1), 0.1);  // host memory, through MPI
  nccl().all_reduce_sum(static_cast<double*>(nullptr), 0);
}

TEST_F(NcclCommTest, GatherTextAndBroadcastBytesUseHostMemory) {
  EXPECT_EQ(nccl().gather_text("rank zero", 0), std::vector<std::string>{"rank zero"});
  unsigned char id[130];
  for (int i = 0; i < 130; ++i) id[i] = static_cast<unsigned char>(255 - i);
  nccl().broadcast_bytes(id, sizeof id, 0);
  for (int i = 0; i < 130; ++i) EXPECT_EQ(id[i], 255 - i) << i;
  nccl().barrier();
}

TEST_F(NcclCommTest, AllGatherInAndOutOfPlace) {
  const std::vector<float> values = pattern(4097, 3.0f);
  DeviceArray<float> send(values), recv(values.size(), -1.0f);
  nccl().all_gather(send.data(), recv.data(), static_cast<int64_t>(values.size()));
  expect_bitwise_equal(recv.host(), values, "out of place");
  nccl().all_gather(recv.data(), recv.data(), static_cast<int64_t>(values.size()));  // send == recv + rank·n
  expect_bitwise_equal(recv.host(), values, "in place");
  nccl().all_gather(nullptr, nullptr, 0);
}

TEST_F(NcclCommTest, ReduceScatterGivesTheOnlyBlock) {
  const std::vector<float> values = pattern(37, -0.75f);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage}) {
    DeviceArray<float> send(values), recv(values.size(), 9.0f);
    nccl().reduce_scatter(send.data(), recv.data(), static_cast<int64_t>(values.size()), op);
    expect_bitwise_equal(recv.host(), values, op == ReduceOp::kSum ? "sum" : "average");
  }
}

// The async forms queue on the NCCL stream like the blocking ones: several in flight,
// waited for out of order, the kAverage division included.
TEST_F(NcclCommTest, AsyncReduceScatterAndAllGather) {
  const std::vector<float> values = pattern(4097, 0.5f);
  const int64_t n = static_cast<int64_t>(values.size());
  DeviceArray<float> send(values), summed(values.size(), 9.0f), averaged(values.size(), 9.0f);
  DeviceArray<float> gathered(values.size(), -1.0f), in_place(values);
  std::unique_ptr<Request> sum = nccl().reduce_scatter_async(send.data(), summed.data(), n, ReduceOp::kSum);
  std::unique_ptr<Request> gather = nccl().all_gather_async(send.data(), gathered.data(), n);
  std::unique_ptr<Request> average = nccl().reduce_scatter_async(send.data(), averaged.data(), n, ReduceOp::kAverage);
  std::unique_ptr<Request> own = nccl().all_gather_async(in_place.data(), in_place.data(), n);  // send == recv + rank·n
  DeviceArray<float> reduced_in_place(values);
  std::unique_ptr<Request> reduce_own =  // recv == send + rank·n
      nccl().reduce_scatter_async(reduced_in_place.data(), reduced_in_place.data(), n, ReduceOp::kSum);
  nccl().progress();
  reduce_own->wait();
  own->wait();
  average->wait();
  gather->wait();
  sum->wait();
  expect_bitwise_equal(summed.host(), values, "reduce_scatter_async (sum)");
  expect_bitwise_equal(averaged.host(), values, "reduce_scatter_async (average)");
  expect_bitwise_equal(gathered.host(), values, "all_gather_async");
  expect_bitwise_equal(in_place.host(), values, "all_gather_async in place");
  expect_bitwise_equal(reduced_in_place.host(), values, "reduce_scatter_async in place");
  nccl().reduce_scatter_async(nullptr, nullptr, 0, ReduceOp::kSum)->wait();
  nccl().all_gather_async(nullptr, nullptr, 0)->wait();
}

TEST_F(NcclCommTest, BroadcastFromTheRoot) {
  const std::vector<float> values = pattern(100, 0.0f);
  DeviceArray<float> data(values);
  nccl().broadcast(data.data(), 100, 0);
  expect_bitwise_equal(data.host(), values, "broadcast");
  nccl().broadcast(nullptr, 0, 0);
}

// Sends and receives with itself pair up in posting order, whichever side comes first.
TEST_F(NcclCommTest, TransfersWithItself) {
  const std::vector<float> a_values = pattern(2048, 1.0f), b_values = pattern(2048, -4.0f);
  DeviceArray<float> a(a_values), b(b_values), into(2048, 0.0f), into2(2048, 0.0f);

  std::unique_ptr<Request> sent = nccl().send_async(a.data(), 2048, 0, 5);
  nccl().recv(into.data(), 2048, 0, 5);
  sent->wait();
  expect_bitwise_equal(into.host(), a_values, "send_async, then recv");

  std::unique_ptr<Request> received = nccl().recv_async(into.data(), 2048, 0, 6);
  nccl().send(b.data(), 2048, 0, 6);
  received->wait();
  expect_bitwise_equal(into.host(), b_values, "recv_async, then send");

  // Two of each in flight: the first send goes to the first receive.
  std::unique_ptr<Request> s1 = nccl().send_async(a.data(), 2048, 0, 1);
  std::unique_ptr<Request> s2 = nccl().send_async(b.data(), 2048, 0, 2);
  std::unique_ptr<Request> r1 = nccl().recv_async(into.data(), 2048, 0, 1);
  std::unique_ptr<Request> r2 = nccl().recv_async(into2.data(), 2048, 0, 2);
  r2->wait();
  s1->wait();
  r1->wait();
  s2->wait();
  expect_bitwise_equal(into.host(), a_values, "first of two");
  expect_bitwise_equal(into2.host(), b_values, "second of two");

  nccl().send_async(nullptr, 0, 0, 0)->wait();  // empty transfers need no partner
  nccl().recv(nullptr, 0, 0, 0);
}

// A host function on the producer stream holds back the copy that fills `send`: the
// all-gather must still see the copied values, not the zeros it started with.
void expect_ordered_after_producer(Communicator& comm, const std::string& what) {
  const size_t n = 100000;
  const std::vector<float> values = pattern(n, 2.5f);
  DeviceArray<float> source(values), send(n, 0.0f), recv(n, -1.0f);
  check_cuda(cudaLaunchHostFunc(
                 g_producer, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }, nullptr),
             "cudaLaunchHostFunc");
  check_cuda(cudaMemcpyAsync(send.data(), source.data(), sizeof(float) * n, cudaMemcpyDeviceToDevice, g_producer),
             "cudaMemcpyAsync");
  comm.all_gather(send.data(), recv.data(), static_cast<int64_t>(n));
  expect_bitwise_equal(recv.host(), values, what);
}

TEST_F(NcclCommTest, OperationsStartAfterTheProducersWork) {
  expect_ordered_after_producer(nccl(), "after the producer stream's event");
  expect_ordered_after_producer(*g_synced, "after a device synchronisation");
}

TEST_F(NcclCommTest, SplitGroupsWork) {
  std::unique_ptr<Communicator> child = nccl().split(3, 7);
  ASSERT_EQ(child->size(), 1);
  EXPECT_EQ(child->rank(), 0);
  std::unique_ptr<Communicator> grandchild = child->split(0, 0);
  EXPECT_EQ(grandchild->size(), 1);
  const std::vector<float> values = pattern(513, 0.125f);
  DeviceArray<float> data(values), gathered(values.size(), 0.0f);
  child->all_reduce(data.data(), 513, ReduceOp::kAverage);
  grandchild->all_gather(data.data(), gathered.data(), 513);
  expect_bitwise_equal(gathered.host(), values, "split groups");
  EXPECT_EQ(grandchild->all_reduce_sum(2.0), 2.0);
  grandchild.reset();  // groups go in reverse order, as on every rank
  child.reset();
}

// GPU memory for the conformance suite: plain cudaMalloc and blocking copies, so an upload
// is complete before the communicator's operation starts.
class CudaCommMemory final : public CommMemory {
 public:
  float* allocate(int64_t n) override {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, sizeof(float) * static_cast<size_t>(n)), "cudaMalloc");
    return static_cast<float*>(p);
  }
  void deallocate(float* p) override { check_cuda(cudaFree(p), "cudaFree"); }
  void upload(float* dst, const float* host, int64_t n) override {
    check_cuda(cudaMemcpy(dst, host, sizeof(float) * static_cast<size_t>(n), cudaMemcpyHostToDevice), "upload");
  }
  void download(float* host, const float* src, int64_t n) override {
    check_cuda(cudaMemcpy(host, src, sizeof(float) * static_cast<size_t>(n), cudaMemcpyDeviceToHost), "download");
  }
};

void run_on_nccl(const ConformanceCase& c) {
  if (!g_no_gpu.empty()) GTEST_SKIP() << g_no_gpu;
  CudaCommMemory memory;
  // NCCL has no tags: receives match by issue order only, and it sums in its ring's order (comm.h).
  c.run({*g_nccl, memory, SelfTransfers::kSupported, TagMatching::kIssueOrderOnly,
         ReduceScatterOrder::kCommunicatorsOwn});
}

// Why this process cannot use a GPU, or empty.
std::string no_gpu_reason() {
  const std::string why = testing::no_usable_gpu();
  return why.empty() ? why : why + "; the NCCL test runs on a machine with one";
}

}  // namespace
}  // namespace pipeshard

int main(int argc, char** argv) {
  using namespace pipeshard;
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<Communicator> world = make_world_communicator();
  g_world = world.get();
  g_no_gpu = no_gpu_reason();
  register_comm_conformance_tests("NcclConformance", run_on_nccl);
  std::unique_ptr<Communicator> nccl, synced;
  if (!g_no_gpu.empty()) {
    std::printf("cuda_nccl_comm_test: skipped, %s\n", g_no_gpu.c_str());  // tests/CMakeLists.txt's skip pattern
  } else if (!GTEST_FLAG_GET(list_tests)) {
    check_cuda(cudaSetDevice(0), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&g_producer, cudaStreamNonBlocking), "cudaStreamCreate");
    nccl = make_nccl_communicator(*world, 0, g_producer);
    synced = make_nccl_communicator(*world, 0);
    g_nccl = nccl.get();
    g_synced = synced.get();
  }
  const int failed = RUN_ALL_TESTS();
  synced.reset();
  nccl.reset();
  if (g_producer != nullptr) cudaStreamDestroy(g_producer);
  world.reset();
  return failed;
}
