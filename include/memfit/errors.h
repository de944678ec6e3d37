// errors.h — how the library says that an input is wrong.
//
// An OptionError names the option in the library's own terms ("batch", "micro_batch",
// "optimizer.lr"), the value given and what is accepted, TORCH_CHECK style:
//   "invalid micro_batch 20: expected 0 (planned) or 1 to batch (16)"
// A front end maps option names to its own (the CLI to its flags: "invalid --micro-batch 20: ...").
// Other messages and notes that name an option quote it in backquotes, in the library's terms
// ("`precision` fp32 forbids it"), so that a front end can say it in its own.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace memfit {

class OptionError : public std::invalid_argument {
 public:
  OptionError(std::string option, const std::string& value, const std::string& expected)
      : std::invalid_argument("invalid " + option + " " + value + ": " + expected),
        option_(std::move(option)), value_(value), expected_(expected) {}
  const std::string& option() const { return option_; }
  const std::string& value() const { return value_; }
  const std::string& expected() const { return expected_; }

 private:
  std::string option_, value_, expected_;
};

// The line of an error message that says what went wrong. A TorchScript interpreter error
// starts "The following operation failed in the TorchScript interpreter.", then both
// tracebacks; its cause is the innermost error, the last line (its Python type, as
// "RuntimeError: ", dropped). Any other message: its first line.
std::string error_cause(const std::string& what);

// `text` fit for one line of a terminal: each byte that is not printable ASCII or part of valid
// UTF-8 as \xNN (newlines and tabs as \n and \t), cut to about `max_bytes` with "..." (at a
// character's start). For text that may hold a file's bytes (parser errors quote them).
std::string printable(const std::string& text, size_t max_bytes = 400);

// A number as the shortest text that reads back as it: 2147483648, 0.001, 1e+300.
std::string number_text(double value);

// Throws OptionError(option, value, expected) unless `ok`.
template <class Value>
void check_option(bool ok, const std::string& option, const Value& value, const std::string& expected) {
  if (ok) return;
  std::ostringstream text;
  text << value;
  throw OptionError(option, text.str(), expected);
}

}  // namespace memfit
