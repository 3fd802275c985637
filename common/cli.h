// What the command-line tools share: how bad input is reported.
#ifndef PIPESHARD_COMMON_CLI_H_
#define PIPESHARD_COMMON_CLI_H_

#include <cstdio>
#include <map>
#include <string>

#include "common/status.h"

namespace pipeshard {

// Exit status for bad arguments and bad input files (docs/design.md, "Command-line contract").
inline constexpr int kExitBadInput = 2;

// `s` with control characters escaped as \xNN: names and paths come from files nobody
// here wrote, and an error must stay on one line.
inline std::string printable(const std::string& s) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

// The flag a tool sets each library setting with (Status::invalid names the setting).
using FlagNames = std::map<std::string, std::string>;  // setting -> "--flag"

// A library error as a tool says it: "--micro-batches: <message>" when it is about a
// setting that `flags` names, the message alone otherwise.
inline std::string flag_message(const Status& s, const FlagNames& flags) {
  auto it = flags.find(s.setting());
  return it == flags.end() ? s.message() : it->second + ": " + s.message();
}

// Prints "<tool>: error: <message>" as one line on stderr; returns kExitBadInput.
inline int report_bad_input(const char* tool, const std::string& message) {
  std::fprintf(stderr, "%s: error: %s\n", tool, printable(message).c_str());
  return kExitBadInput;
}

}  // namespace pipeshard

#endif  // PIPESHARD_COMMON_CLI_H_
