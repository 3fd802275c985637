// TensorBoardWriter: scalar summaries in TensorBoard's own file format, so that
// `tensorboard --logdir DIR` shows a run without any converter.
//
// The format is TensorFlow's event file: a sequence of TFRecords, each
//   uint64 length | uint32 masked CRC-32C of those 8 bytes | data | uint32 masked CRC-32C of data
// (little-endian; common/crc32c.h), whose data are serialized Event messages
// (observe/tensorboard_event.proto). The first Event carries file_version
// "brain.Event:2"; every later one a Summary with one scalar.
//
// Records are queued by add_scalar() and reach the file in one write(2) per flush(),
// so a crash loses at most what was queued since the last flush and never leaves a
// record half-written in the file (short of the machine itself failing mid-write).
#ifndef PIPESHARD_OBSERVE_TENSORBOARD_H_
#define PIPESHARD_OBSERVE_TENSORBOARD_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "common/status.h"

namespace pipeshard {

class TensorBoardWriter {
 public:
  // Creates `dir` (and its parents) if needed and a new event file in it, named as
  // TensorFlow and PyTorch name theirs:
  //   events.out.tfevents.<unix seconds, 10 digits>.<hostname>.<pid>
  // (TensorBoard reads every file with "tfevents" in its name; the pid keeps two runs
  // started in the same second apart). Writes and flushes the file_version record.
  // Errors name the path.
  static Result<std::unique_ptr<TensorBoardWriter>> create(const std::string& dir);
  // Flushes what is queued (errors are lost here: call flush() to see them) and closes.
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // Queues one Event: `value` (stored as float, as TensorBoard's simple_value is) under
  // `tag` at `step`, stamped `wall_time` (seconds since the Unix epoch,
  // unix_seconds_now()).
  void add_scalar(const std::string& tag, int64_t step, double value, double wall_time);
  // Appends the queued records to the file in one write.
  Status flush();
  // The event file.
  const std::string& path() const { return path_; }

 private:
  TensorBoardWriter(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  void add_event(const std::string& serialized_event);

  std::string path_;
  int fd_ = -1;
  std::string pending_;  // framed records not yet written
};

// Seconds since the Unix epoch, with the clock's resolution: an Event's wall_time.
double unix_seconds_now();

// Appends `data` to `out` as one TFRecord (the framing above).
void append_tfrecord(std::string& out, std::string_view data);

}  // namespace pipeshard

#endif  // PIPESHARD_OBSERVE_TENSORBOARD_H_
