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

// Throws OptionError(option, value, expected) unless `ok`.
template <class Value>
void check_option(bool ok, const std::string& option, const Value& value, const std::string& expected) {
  if (ok) return;
  std::ostringstream text;
  text << value;
  throw OptionError(option, text.str(), expected);
}

}  // namespace memfit
