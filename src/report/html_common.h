// html_common.h — what the HTML report's sections share: tolerant reading of the document,
// numbers for people, and the SVG charts' scales and axes. Private to src/report.
#pragma once

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "memfit/measure/size.h"

namespace memfit::html {

using nlohmann::json;

template <typename... Args>
void append(std::string& out, fmt::format_string<Args...> format, Args&&... args) {
  fmt::format_to(std::back_inserter(out), format, std::forward<Args>(args)...);
}

// Reading the document: every accessor tolerates a missing or mistyped field, because reports
// are also produced from partial runs.
std::string escape_html(const std::string& text);

// Plan values may be numbers or booleans as well as strings.
std::string text_of(const json& value);

std::string field_text(const json& object, const char* key, const std::string& fallback = "");

bool has_number(const json& object, const char* key);

// Byte counts are exact integers; floats are accepted but rounded.
int64_t as_bytes(const json& value);

int64_t field_bytes(const json& object, const char* key);

double field_number(const json& object, const char* key, double fallback = 0.0);

const json& field_array(const json& object, const char* key);

// Numbers for people (sizes: memfit::format_bytes).
std::string format_ms(double microseconds);

std::string format_percent(double part, double whole);

// Scales and axes.
// Maps a data interval onto a pixel interval (either may be reversed).
struct Scale {
  double domain_lo, domain_hi, range_lo, range_hi;
  double operator()(double value) const {
    const double span = domain_hi - domain_lo;
    const double fraction = span == 0 ? 0 : (value - domain_lo) / span;
    return range_lo + fraction * (range_hi - range_lo);
  }
};

// A value axis: the domain ends on a tick so the top gridline frames the plot.
struct ValueAxis {
  double lo = 0, hi = 1;
  std::vector<double> ticks;
  double label_unit = 1;       // tick labels show value / label_unit
  std::string label_suffix;    // " MiB", or "" for plain numbers
  std::string tick_label(double value) const {
    if (value == 0) return "0";
    return fmt::format("{:g}{}", value / label_unit, label_suffix);
  }
};

// Plot rectangle inside an SVG, in pixels.
struct PlotArea {
  double left, top, width, height;
  double right() const { return left + width; }
  double bottom() const { return top + height; }
};

// A "round" step (1, 2 or 5 times a power of ten) giving about target_count intervals.
double nice_step(double span, int target_count);

std::vector<double> ticks_between(double lo, double hi, double step);

// Byte axis from 0, labelled in the largest binary unit that keeps values >= 1.
ValueAxis byte_axis(double max_bytes);

// Plain-number axis (loss): rounded outwards to whole steps.
ValueAxis number_axis(double lo, double hi);

void draw_y_axis(std::string& out, const PlotArea& area, const ValueAxis& axis, const Scale& y);

void draw_x_axis(std::string& out, const PlotArea& area, const std::vector<double>& ticks,
                 const Scale& x, const std::string& title);

// Rough width of a label in pixels at the 12px chart font; used only to decide
// whether a label fits, so being approximate is fine.
double text_width(const std::string& text);

// Shared <defs>: the diagonal hatch marking recomputed work.
std::string hatch_pattern(const std::string& id, const std::string& background, const std::string& stripe);

// The timeline section (html_timeline.cpp), with the peak and the number of events it drew.
struct TimelineSection {
  std::string html;
  int64_t peak_bytes = 0;
  size_t events = 0;
};
TimelineSection render_timeline_section(const json& doc, bool has_budget, int64_t budget_bytes);

}  // namespace memfit::html
