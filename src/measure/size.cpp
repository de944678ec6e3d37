#include "memfit/measure/size.h"
#include "memfit/errors.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace memfit {

int64_t parse_size(const std::string& text) {
  const std::string accepted =
      "expected a size such as 512MiB, 1.5GiB, 800MB, 1e9 or plain bytes";
  auto fail = [&]() -> int64_t {
    throw OptionError("size", "'" + text + "'", accepted);
  };
  if (text.empty()) return fail();
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    return fail();
  }
  std::string unit = text.substr(used);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.erase(0, 1);
  double scale = 1;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "KiB") scale = 1024.0;
  else if (unit == "MiB") scale = 1024.0 * 1024;
  else if (unit == "GiB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "TiB") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "KB" || unit == "kB" || unit == "k" || unit == "K") scale = 1e3;
  else if (unit == "MB" || unit == "M") scale = 1e6;
  else if (unit == "GB" || unit == "G") scale = 1e9;
  else if (unit == "TB" || unit == "T") scale = 1e12;
  else return fail();
  const double bytes = value * scale;
  if (!std::isfinite(bytes) || bytes < 1 || bytes > 9.0e18) return fail();
  return static_cast<int64_t>(std::llround(bytes));
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes < 0 ? -bytes : bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[48];
  const char* sign = bytes < 0 ? "-" : "";
  if (u == 0) std::snprintf(buf, sizeof buf, "%s%lld B", sign, static_cast<long long>(v));
  else if (v >= 100) std::snprintf(buf, sizeof buf, "%s%.0f %s", sign, v, units[u]);
  else if (v >= 10) std::snprintf(buf, sizeof buf, "%s%.1f %s", sign, v, units[u]);
  else std::snprintf(buf, sizeof buf, "%s%.2f %s", sign, v, units[u]);
  return buf;
}

std::vector<int64_t> parse_step_list(const std::string& text, int64_t last) {
  const std::string expected = "expected step numbers from 1 to " + std::to_string(last) + ", like 3,7";
  std::vector<int64_t> steps;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    const bool digits = !item.empty() && item.size() <= 18 && item.find_first_not_of("0123456789") == std::string::npos;
    const int64_t step = digits ? std::stoll(item) : 0;
    if (step < 1 || step > last) throw OptionError("step list", "'" + text + "'", expected);
    steps.push_back(step);
    start = comma + 1;
  }
  return steps;
}

}  // namespace memfit
