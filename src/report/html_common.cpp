#include "html_common.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace memfit::html {


std::string escape_html(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// Plan values may be numbers or booleans as well as strings.
std::string text_of(const json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_null()) return "";
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string field_text(const json& object, const char* key, const std::string& fallback) {
  if (!object.is_object() || !object.contains(key) || object[key].is_null()) return fallback;
  return text_of(object[key]);
}

bool has_number(const json& object, const char* key) {
  return object.is_object() && object.contains(key) && object[key].is_number();
}

// Byte counts are exact integers; floats are accepted but rounded.
int64_t as_bytes(const json& value) {
  if (value.is_number_unsigned()) {
    const auto v = value.get<uint64_t>();
    return v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
               ? std::numeric_limits<int64_t>::max()
               : static_cast<int64_t>(v);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) return std::llround(value.get<double>());
  return 0;
}

int64_t field_bytes(const json& object, const char* key) {
  return has_number(object, key) ? as_bytes(object[key]) : 0;
}

double field_number(const json& object, const char* key, double fallback) {
  return has_number(object, key) ? object[key].get<double>() : fallback;
}

const json& field_array(const json& object, const char* key) {
  static const json empty = json::array();
  if (!object.is_object() || !object.contains(key) || !object[key].is_array()) return empty;
  return object[key];
}


std::string format_ms(double microseconds) {
  return fmt::format("{:.2f} ms", microseconds / 1000.0);
}

std::string format_percent(double part, double whole) {
  if (whole <= 0) return "";
  return fmt::format("{:.1f}%", 100.0 * part / whole);
}



// A "round" step (1, 2 or 5 times a power of ten) giving about target_count intervals.
double nice_step(double span, int target_count) {
  if (!(span > 0)) return 1;
  const double raw = span / target_count;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  for (double multiple : {1.0, 2.0, 5.0}) {
    if (multiple * magnitude >= raw) return multiple * magnitude;
  }
  return 10 * magnitude;
}

std::vector<double> ticks_between(double lo, double hi, double step) {
  std::vector<double> ticks;
  const double first = std::ceil(lo / step - 1e-9) * step;
  for (double tick = first; tick <= hi + step * 1e-9; tick += step) {
    ticks.push_back(std::fabs(tick) < step * 1e-9 ? 0.0 : tick);
  }
  return ticks;
}



// Byte axis from 0, labelled in the largest binary unit that keeps values >= 1.
ValueAxis byte_axis(double max_bytes) {
  static const char* const kUnits[] = {" B", " KiB", " MiB", " GiB", " TiB"};
  ValueAxis axis;
  max_bytes = std::max(max_bytes, 1.0);
  int unit = 0;
  double unit_bytes = 1;
  while (unit < 4 && max_bytes >= unit_bytes * 1024) {
    unit_bytes *= 1024;
    ++unit;
  }
  const double max_in_unit = max_bytes * 1.04 / unit_bytes;  // a little headroom above the peak
  // Whole bytes only: "0.5 B" is not a size.
  const double step = unit == 0 ? std::max(1.0, nice_step(max_in_unit, 5)) : nice_step(max_in_unit, 5);
  const double top = std::ceil(max_in_unit / step) * step;
  axis.lo = 0;
  axis.hi = top * unit_bytes;
  for (double tick : ticks_between(0, top, step)) axis.ticks.push_back(tick * unit_bytes);
  axis.label_unit = unit_bytes;
  axis.label_suffix = kUnits[unit];
  return axis;
}

// Plain-number axis (loss): rounded outwards to whole steps.
ValueAxis number_axis(double lo, double hi) {
  ValueAxis axis;
  if (hi <= lo) {
    const double pad = std::max(std::fabs(lo) * 0.1, 1.0);
    lo -= pad;
    hi += pad;
  }
  const double step = nice_step(hi - lo, 4);
  axis.lo = std::floor(lo / step) * step;
  axis.hi = std::ceil(hi / step) * step;
  axis.ticks = ticks_between(axis.lo, axis.hi, step);
  return axis;
}



void draw_y_axis(std::string& out, const PlotArea& area, const ValueAxis& axis, const Scale& y) {
  for (double tick : axis.ticks) {
    const double py = y(tick);
    append(out, R"(<line class="grid" x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}"/>)",
           area.left, py, area.right(), py);
    append(out, R"(<text class="tick" x="{:.1f}" y="{:.1f}" text-anchor="end" dominant-baseline="middle">{}</text>)",
           area.left - 8, py, escape_html(axis.tick_label(tick)));
  }
}

void draw_x_axis(std::string& out, const PlotArea& area, const std::vector<double>& ticks,
                 const Scale& x, const std::string& title) {
  append(out, R"(<line class="axis" x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}"/>)",
         area.left, area.bottom(), area.right(), area.bottom());
  for (double tick : ticks) {
    const double px = x(tick);
    append(out, R"(<line class="axis" x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}"/>)",
           px, area.bottom(), px, area.bottom() + 5);
    append(out, R"(<text class="tick" x="{:.1f}" y="{:.1f}" text-anchor="middle">{:g}</text>)",
           px, area.bottom() + 18, tick);
  }
  append(out, R"(<text class="axis-title" x="{:.1f}" y="{:.1f}" text-anchor="middle">{}</text>)",
         area.left + area.width / 2, area.bottom() + 38, escape_html(title));
}

// Rough width of a label in pixels at the 12px chart font; used only to decide
// whether a label fits, so being approximate is fine.
double text_width(const std::string& text) { return 7.0 * static_cast<double>(text.size()); }

// Shared <defs>: the diagonal hatch marking recomputed work.
std::string hatch_pattern(const std::string& id, const std::string& background, const std::string& stripe) {
  return fmt::format(
      R"~(<defs><pattern id="{}" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">)~"
      R"(<rect width="6" height="6" fill="{}"/><line x1="0" y1="0" x2="0" y2="6" stroke="{}" stroke-width="2.5"/>)"
      R"(</pattern></defs>)",
      id, background, stripe);
}


}  // namespace memfit::html
