// Status and Result<T>: how bad input travels from where it is found to main().
//
// A Status is either OK or carries one human-readable message. Callers add context
// as the error propagates (`status.with_context("node 'fc2' (Gemm)")` gives
// "node 'fc2' (Gemm): <message>"), and the tools print the final message as one
// line on stderr and exit with status 2. Broken invariants are not Statuses: they
// are bugs and end the job through PIPESHARD_CHECK (common/check.h, included here).
#ifndef PIPESHARD_COMMON_STATUS_H_
#define PIPESHARD_COMMON_STATUS_H_

#include <optional>
#include <string>
#include <utility>
#include <variant>

#include "common/check.h"

namespace pipeshard {

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  static Status ok() { return Status(); }
  static Status error(std::string message) { return Status(std::move(message)); }
  // An error about the value of one named setting: `setting` is the field of the options
  // the library was given ("micro_batches", "batch_size"), so that a tool can name its
  // own flag for it. Libraries speak of values, tools of flags (docs/style.md 14).
  static Status invalid(std::string setting, std::string message) {
    Status s(std::move(message));
    s.setting_ = std::move(setting);
    return s;
  }

  bool is_ok() const { return !message_.has_value(); }
  explicit operator bool() const { return is_ok(); }
  // The message; empty for OK.
  const std::string& message() const {
    static const std::string kEmpty;
    return message_ ? *message_ : kEmpty;
  }
  // The setting an invalid() error is about; empty otherwise.
  const std::string& setting() const { return setting_; }
  // Returns a copy whose message is "context: message" (OK stays OK).
  Status with_context(const std::string& context) const {
    if (is_ok()) return *this;
    Status s(context + ": " + *message_);
    s.setting_ = setting_;
    return s;
  }

 private:
  explicit Status(std::string message) : message_(std::move(message)) {}
  std::optional<std::string> message_;
  std::string setting_;
};

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : value_(std::move(status)) {}  // NOLINT: must not be OK
  bool is_ok() const { return std::holds_alternative<T>(value_); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(value_);
  }
  T& value() & { return std::get<T>(value_); }
  const T& value() const& { return std::get<T>(value_); }
  T&& value() && { return std::get<T>(std::move(value_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() { return value(); }
  const T& operator*() const { return value(); }

 private:
  std::variant<T, Status> value_;
};

}  // namespace pipeshard

// Returns early from a function returning Status or Result<T> when `expr` fails.
#define PIPESHARD_RETURN_IF_ERROR(expr) \
  do {                                  \
    ::pipeshard::Status _st = (expr);   \
    if (!_st.is_ok()) return _st;       \
  } while (0)

#endif  // PIPESHARD_COMMON_STATUS_H_
