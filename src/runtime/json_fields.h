// json_fields.h — strict reading of memfit's own JSON forms (plans, step configs, optimizer
// specs): each field present, of the written type, exactly representable and in range; anything
// else is an OptionError naming the field as the option "JSON 'key'" ("invalid JSON 'batch' -2:
// expected an integer from 1 to ..."). Private to src/.
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "memfit/errors.h"

namespace memfit::json_fields {

// The error for JSON field `key` holding `value` (a whole document quoted at most in part).
[[noreturn]] inline void refuse(const std::string& key, const nlohmann::json& value, const std::string& expected) {
  throw OptionError("JSON '" + key + "'", printable(value.dump(), 120), expected);
}

inline const nlohmann::json& field(const nlohmann::json& j, const char* key) {
  if (!j.is_object() || !j.contains(key)) throw OptionError(std::string("JSON '") + key + "'", "(missing)", "expected the field");
  return j.at(key);
}

inline int64_t integer(const nlohmann::json& j, const char* key, int64_t min = 0,
                       int64_t max = std::numeric_limits<int64_t>::max()) {
  const auto& v = field(j, key);
  // An unsigned value past int64 reads as something else than written: refused.
  const bool fits = v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX));
  if (!fits || v.get<int64_t>() < min || v.get<int64_t>() > max) {
    refuse(key, v, "expected an integer from " + std::to_string(min) + " to " + std::to_string(max));
  }
  return v.get<int64_t>();
}

// A number given as a value (an array element), named `what` in errors.
inline double value_number(const nlohmann::json& v, const std::string& what, double min = 0,
                     double max = std::numeric_limits<double>::max()) {
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < min || v.get<double>() > max) {
    refuse(what, v, "expected a finite number from " + number_text(min) +
                        (max < std::numeric_limits<double>::max() ? " to " + number_text(max) : std::string(" up")));
  }
  return v.get<double>();
}

inline double number(const nlohmann::json& j, const char* key, double min = 0,
                     double max = std::numeric_limits<double>::max()) {
  return value_number(field(j, key), key, min, max);
}

inline bool boolean(const nlohmann::json& j, const char* key) {
  const auto& v = field(j, key);
  if (!v.is_boolean()) refuse(key, v, "expected true or false");
  return v.get<bool>();
}

inline std::string text(const nlohmann::json& j, const char* key) {
  const auto& v = field(j, key);
  if (!v.is_string()) refuse(key, v, "expected a string");
  return v.get<std::string>();
}

// An array of exactly `n` elements (n < 0: any length).
inline const nlohmann::json& array(const nlohmann::json& j, const char* key, int n = -1) {
  const auto& v = field(j, key);
  if (!v.is_array() || (n >= 0 && v.size() != static_cast<size_t>(n))) {
    refuse(key, v, "expected an array" + (n >= 0 ? " of " + std::to_string(n) : std::string()));
  }
  return v;
}

}  // namespace memfit::json_fields
