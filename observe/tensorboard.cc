#include "observe/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "common/crc32c.h"
#include "observe/tensorboard_event.pb.h"

namespace pipeshard {
namespace {

void append_le32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
}

std::string hostname() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == 0) return "localhost";
  return name;
}

}  // namespace

double unix_seconds_now() {
  const auto since_epoch = std::chrono::system_clock::now().time_since_epoch();
  return std::chrono::duration<double>(since_epoch).count();
}

void append_tfrecord(std::string& out, std::string_view data) {
  std::string length;
  const uint64_t n = data.size();
  for (int i = 0; i < 8; ++i) length += static_cast<char>((n >> (8 * i)) & 0xFF);
  out += length;
  append_le32(out, mask_crc32c(crc32c(length)));
  out += data;
  append_le32(out, mask_crc32c(crc32c(data)));
}

Result<std::unique_ptr<TensorBoardWriter>> TensorBoardWriter::create(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir)) {
    return Status::error("cannot create TensorBoard folder '" + dir +
                         "': " + (ec ? ec.message() : std::string("a file of that name is in the way")));
  }
  const double now = unix_seconds_now();
  char stamp[32];
  std::snprintf(stamp, sizeof(stamp), "%010lld", static_cast<long long>(now));
  const std::string path = (std::filesystem::path(dir) / ("events.out.tfevents." + std::string(stamp) + "." +
                                                          hostname() + "." + std::to_string(::getpid())))
                               .string();
  // O_EXCL: never append to, or truncate, another run's file.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::error("cannot create TensorBoard event file '" + path + "': " + std::strerror(errno));
  std::unique_ptr<TensorBoardWriter> writer(new TensorBoardWriter(path, fd));
  tensorboard::Event event;
  event.set_wall_time(now);
  event.set_file_version("brain.Event:2");
  writer->add_event(event.SerializeAsString());
  PIPESHARD_RETURN_IF_ERROR(writer->flush());
  return writer;
}

TensorBoardWriter::~TensorBoardWriter() {
  (void)flush();
  ::close(fd_);
}

void TensorBoardWriter::add_scalar(const std::string& tag, int64_t step, double value, double wall_time) {
  tensorboard::Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  tensorboard::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
  add_event(event.SerializeAsString());
}

void TensorBoardWriter::add_event(const std::string& serialized_event) { append_tfrecord(pending_, serialized_event); }

Status TensorBoardWriter::flush() {
  // One write(2) normally takes it all; a short write (a signal, a full disk) goes on
  // from where it stopped.
  size_t done = 0;
  while (done < pending_.size()) {
    const ssize_t n = ::write(fd_, pending_.data() + done, pending_.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "nothing written";
      pending_.erase(0, done);
      return Status::error("cannot write TensorBoard event file '" + path_ + "': " + why);
    }
    done += static_cast<size_t>(n);
  }
  pending_.clear();
  return Status::ok();
}

}  // namespace pipeshard
