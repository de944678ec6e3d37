// fuzz_util.h — what the seeded fuzz tests share (fuzz_parsers.cpp, fuzz_saved_state.cpp):
// iterations and seeds from the environment, a failing input shown on one line, random text
// from the pieces people type, and which exception a call threw.
//
// Bounded for CI (a few seconds in all). Environment:
//   MEMFIT_FUZZ_ITERATIONS=N  iterations per target (default: each target's own, 2000 to 20000);
//                             saved state makes N/100 variants of each random kind (at least 40)
//   MEMFIT_FUZZ_SEED=S        one seed for every target instead of each target's fixed one
// A failure prints the seed, the iteration and the input.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>

namespace memfit::fuzz {

inline int64_t env_int(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  return (end != nullptr && *end == '\0' && value > 0) ? value : fallback;
}

inline int64_t iterations(int64_t fallback) { return env_int("MEMFIT_FUZZ_ITERATIONS", fallback); }

inline uint64_t seed_of(uint64_t fixed) { return static_cast<uint64_t>(env_int("MEMFIT_FUZZ_SEED", static_cast<int64_t>(fixed))); }

inline std::string seed_line(uint64_t seed) {
  return "seed " + std::to_string(seed) + " (rerun: MEMFIT_FUZZ_SEED=" + std::to_string(seed) +
         " ./memfit_tests --gtest_filter='" + ::testing::UnitTest::GetInstance()->current_test_info()->test_suite_name() +
         "." + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "')";
}

// Non-printing characters shown as \xNN, so a failing input reads on one line.
inline std::string shown(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

inline bool one_line(const std::string& text) { return !text.empty() && text.find('\n') == std::string::npos; }

// Stops a target after this many failures: the first ones say it all.
inline constexpr int kMaxFailures = 8;

// Random strings from an alphabet of the pieces people type: digits, units, signs, commas,
// colons, letters, words, huge numbers, and nothing (empty items between commas).
class TextGenerator {
 public:
  explicit TextGenerator(uint64_t seed) : rng_(seed) {}

  std::string digits(int n) {
    std::string s;
    for (int i = 0; i < n; ++i) s += static_cast<char>('0' + pick(10));
    return s;
  }

  std::string token() {
    static const char* const pieces[] = {
        "0", "1", "2", "3", "5", "7", "9", "10", "16", "42", "100", "512", "1024", "4096", "999999",
        ".", ".5", "1.5", "0.1", "e", "E", "e9", "e-3", "e308", "e400", "+", "-", "--", ",", ",,", ":",
        " ", "\t", "B", "b", "KiB", "MiB", "GiB", "TiB", "PiB", "KB", "kB", "MB", "GB", "TB", "k", "K",
        "M", "G", "T", "iB", "x", "a", "Z", "inf", "nan", "NaN", "infinity", "0x", "0x1p3", "every:",
        "all", "none", "auto", "every", ";", "/", "%", "\xc3\xa9", "2147483647", "2147483648", "-2147483649",
        "4294967296", "9223372036854775807", "9223372036854775808", "18446744073709551616", "1e18", "9e18",
        "1e19"};
    switch (pick(10)) {
      case 0: return digits(20 + pick(30));                    // past 64 bits
      case 1: return pick(4) == 0 ? digits(310 + pick(100)) : digits(1 + pick(19));  // past a double, or any width
      case 2: return "";
      default: return pieces[pick(std::size(pieces))];
    }
  }

  std::string text() {
    std::string s;
    const int n = pick(7);
    for (int i = 0; i < n; ++i) s += token();
    return s;
  }

  // Comma-separated items, some empty, some numbers near `last`.
  std::string list(int64_t last) {
    std::string s;
    const int n = 1 + pick(5);
    for (int i = 0; i < n; ++i) {
      if (i > 0) s += pick(8) == 0 ? ",," : ",";
      switch (pick(6)) {
        case 0: s += text(); break;
        case 1: s += ""; break;
        default: s += std::to_string(static_cast<int64_t>(pick(static_cast<uint64_t>(std::min<int64_t>(last, 1000)) + 3)) - 1);
      }
    }
    if (pick(10) == 0) s = (pick(2) ? "," : " ") + s;
    if (pick(10) == 0) s += pick(2) ? "," : " ";
    return s;
  }

  uint64_t pick(uint64_t n) { return n == 0 ? 0 : std::uniform_int_distribution<uint64_t>(0, n - 1)(rng_); }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

// Runs `call`; the exception it threw: "" (none), "invalid_argument", "runtime_error",
// "exception" (another std::exception) or "non-std" — with its message in `what`.
inline std::string thrown_by(const std::function<void()>& call, std::string* what) {
  try {
    call();
    return "";
  } catch (const std::invalid_argument& e) {
    *what = e.what();
    return "invalid_argument";
  } catch (const std::runtime_error& e) {
    *what = e.what();
    return "runtime_error";
  } catch (const std::exception& e) {
    *what = e.what();
    return "exception";
  } catch (...) {
    *what = "(not a std::exception)";
    return "non-std";
  }
}

}  // namespace memfit::fuzz
