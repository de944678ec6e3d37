#include "memfit/errors.h"

#include <cctype>
#include <charconv>
#include <cstdio>

namespace memfit {
namespace {

constexpr const char* kTorchScriptError = "The following operation failed in the TorchScript interpreter.";

std::string trimmed(const std::string& line) {
  const size_t first = line.find_first_not_of(" \t\r");
  if (first == std::string::npos) return "";
  return line.substr(first, line.find_last_not_of(" \t\r") - first + 1);
}

// "RuntimeError: x" -> "x": a Python exception's type, as the interpreter's last line has it.
std::string without_python_type(const std::string& line) {
  const size_t colon = line.find(": ");
  if (colon == std::string::npos || colon < 5 || line.compare(colon - 5, 5, "Error") != 0) return line;
  for (size_t i = 0; i < colon; ++i) {
    const char c = line[i];
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_') return line;
  }
  return line.substr(colon + 2);
}

std::string last_nonempty_line(const std::string& text) {
  size_t end = text.size();
  while (end > 0) {
    const size_t start = text.rfind('\n', end - 1);
    const size_t from = start == std::string::npos ? 0 : start + 1;
    std::string line = trimmed(text.substr(from, end - from));
    if (!line.empty()) return line;
    if (start == std::string::npos) break;
    end = start;
  }
  return "";
}

// The length of the valid UTF-8 sequence of two to four bytes starting at text[i], or 0.
size_t utf8_length(const std::string& text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = byte(i);
  const size_t n = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
  if (n == 0 || i + n > text.size()) return 0;
  for (size_t k = i + 1; k < i + n; ++k) {
    if ((byte(k) & 0xC0) != 0x80) return 0;
  }
  // Overlong three- and four-byte forms, UTF-16 surrogates and code points past U+10FFFF.
  if ((c == 0xE0 && byte(i + 1) < 0xA0) || (c == 0xED && byte(i + 1) >= 0xA0)) return 0;
  if ((c == 0xF0 && byte(i + 1) < 0x90) || (c == 0xF4 && byte(i + 1) >= 0x90)) return 0;
  return n;
}

}  // namespace

std::string error_cause(const std::string& what) {
  if (what.rfind(kTorchScriptError, 0) == 0) {
    const std::string cause = without_python_type(last_nonempty_line(what));
    if (!cause.empty() && cause != kTorchScriptError) return cause;
  }
  return what.substr(0, what.find('\n'));
}

std::string number_text(double value) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, value).ptr;
  return std::string(text, end);
}

std::string printable(const std::string& text, size_t max_bytes) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    if (out.size() >= max_bytes) return out + "...";
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
      ++i;
    } else if (const size_t n = utf8_length(text, i); n > 0) {
      out += text.substr(i, n);
      i += n;
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, c == '\n' ? "\\n" : c == '\t' ? "\\t" : "\\x%02X", c);
      out += escaped;
      ++i;
    }
  }
  return out;
}

}  // namespace memfit
