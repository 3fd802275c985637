// What every group of one in-process job shares (testing/in_process_comm.h): the lock all
// its groups work under, which ranks still hold communicators, and what each rank waits
// for, so that a deadlock is seen as soon as it happens. Internal to in_process_comm.cc.
#ifndef PIPESHARD_TESTING_IN_PROCESS_JOB_H_
#define PIPESHARD_TESTING_IN_PROCESS_JOB_H_

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "testing/in_process_comm.h"

namespace pipeshard::in_process {

enum class WaitResult { kReady, kJobFailed };

class Job {
 public:
  Job(int size, const InProcessOptions& options);
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // One lock for every group of the job: a wait in one group may be blocked by a rank that
  // waits in another, and the deadlock check must see both at once.
  std::mutex& mutex() { return mutex_; }
  int size() const { return static_cast<int>(communicators_.size()); }

  // The rest is called with mutex() held.

  // A communicator of world rank `rank` was made, or destroyed. A rank that holds none has
  // left the job: it can no longer post anything.
  void enter(int rank);
  void leave(int rank);
  // Something a wait may be waiting for has happened (a post, a send): wakes the waits.
  void changed();
  // Blocks world rank `rank` until ready() holds (kReady) or the job fails (kJobFailed).
  // `describe` says what the rank waits for ("all_reduce of 4 floats (sum) on the world,
  // …"), for the deadlock report and the timeout message. A wait longer than the job's
  // timeout is fatal.
  WaitResult wait(std::unique_lock<std::mutex>& lock, int rank, const std::function<bool()>& ready,
                  const std::function<std::string()>& describe);
  // Why the job failed (a deadlock report), or empty while it has not.
  const std::string& failure() const { return failure_; }

 private:
  struct Waiter {
    const std::function<bool()>* ready = nullptr;  // null: not waiting
    const std::function<std::string()>* describe = nullptr;
  };
  // Fails the job when every rank that can still act waits and no wait can complete.
  void check_deadlock();

  std::mutex mutex_;
  std::condition_variable changed_;
  InProcessOptions options_;
  std::vector<int> communicators_;  // [world rank]: communicators it holds
  std::vector<Waiter> waiting_;     // [world rank]
  std::string failure_;
};

}  // namespace pipeshard::in_process

#endif  // PIPESHARD_TESTING_IN_PROCESS_JOB_H_
