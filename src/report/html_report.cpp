// Renders the memory report page. Everything is plain string building: the
// SVG charts are drawn here so the page needs no charting library and no
// network when viewed. Layout constants live next to the chart that uses them.
#include "memfit/report/html_report.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace memfit {
namespace {

using nlohmann::json;

template <typename... Args>
void append(std::string& out, fmt::format_string<Args...> format, Args&&... args) {
  fmt::format_to(std::back_inserter(out), format, std::forward<Args>(args)...);
}

// ---------------------------------------------------------------------------
// Reading the document. Every accessor tolerates a missing or mistyped field,
// because reports are also produced from partial runs.

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

std::string field_text(const json& object, const char* key, const std::string& fallback = "") {
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

double field_number(const json& object, const char* key, double fallback = 0.0) {
  return has_number(object, key) ? object[key].get<double>() : fallback;
}

const json& field_array(const json& object, const char* key) {
  static const json empty = json::array();
  if (!object.is_object() || !object.contains(key) || !object[key].is_array()) return empty;
  return object[key];
}

// ---------------------------------------------------------------------------
// Formatting numbers for people.

// Binary units with three significant digits: "512 B", "4.36 MiB", "12.3 GiB".
std::string format_bytes(int64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  const char* sign = bytes < 0 ? "-" : "";
  double value = std::fabs(static_cast<double>(bytes));
  if (value < 1024) return fmt::format("{}{} B", sign, static_cast<int64_t>(value));
  int unit = 0;
  while (value >= 1024 && unit < 5) {
    value /= 1024;
    ++unit;
  }
  // Rounding can carry over (1023.9 KiB -> "1024 KiB"); that is still correct.
  const int decimals = value < 10 ? 2 : value < 100 ? 1 : 0;
  return fmt::format("{}{:.{}f} {}", sign, value, decimals, kUnits[unit]);
}

std::string format_ms(double microseconds) {
  return fmt::format("{:.2f} ms", microseconds / 1000.0);
}

std::string format_percent(double part, double whole) {
  if (whole <= 0) return "";
  return fmt::format("{:.1f}%", 100.0 * part / whole);
}

// ---------------------------------------------------------------------------
// Categories and phases: labels and colors.

struct Category {
  std::string key;
  std::string label;
  std::string color;
};

// Tableau-10 colors: distinct, print well, and readable for most color-blind viewers.
const char* const kFallbackColors[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#bab0ac",
                                       "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f"};

Category make_category(const std::string& key, size_t index) {
  struct Known {
    const char* key;
    const char* label;
    const char* color;
  };
  static const Known kKnown[] = {
      {"weights", "Weights", "#4e79a7"},
      {"buffers", "Buffers", "#76b7b2"},
      {"gradients", "Gradients", "#f28e2b"},
      {"optimizer_state", "Optimizer state", "#59a14f"},
      {"activations", "Activations", "#e15759"},
      {"other", "Other", "#bab0ac"},
  };
  for (const Known& known : kKnown) {
    if (key == known.key) return {key, known.label, known.color};
  }
  // Unknown key: "kv_cache" -> "Kv cache".
  std::string label = key;
  std::replace(label.begin(), label.end(), '_', ' ');
  if (!label.empty()) label[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(label[0])));
  return {key, label, kFallbackColors[index % std::size(kFallbackColors)]};
}

std::vector<Category> read_categories(const json& doc) {
  std::vector<std::string> keys;
  for (const json& key : field_array(doc, "categories")) {
    if (key.is_string()) keys.push_back(key.get<std::string>());
  }
  if (keys.empty()) keys = {"weights", "gradients", "optimizer_state", "activations", "other"};
  std::vector<Category> categories;
  for (size_t i = 0; i < keys.size(); ++i) categories.push_back(make_category(keys[i], i));
  return categories;
}

// Phase tints stay pale so they never compete with the category fills.
std::string phase_color(const std::string& name) {
  if (name == "forward") return "#dbe5f1";
  if (name == "backward") return "#f1e3d3";
  if (name == "recompute") return "#e6d3ee";
  if (name == "optimizer") return "#d9ecd7";
  return "#e4e4e4";
}

struct Phase {
  std::string name;
  double start_us = 0;
  double end_us = 0;
  bool has_peak = false;
  int64_t peak_bytes = 0;
};

std::vector<Phase> read_phases(const json& doc) {
  std::vector<Phase> phases;
  for (const json& item : field_array(doc, "phases")) {
    Phase phase;
    phase.name = field_text(item, "name", "?");
    phase.start_us = field_number(item, "start_us");
    phase.end_us = std::max(phase.start_us, field_number(item, "end_us", phase.start_us));
    phase.has_peak = has_number(item, "peak_bytes");
    phase.peak_bytes = field_bytes(item, "peak_bytes");
    phases.push_back(phase);
  }
  return phases;
}

// ---------------------------------------------------------------------------
// Timeline data.

struct TimelinePoint {
  double t_us = 0;
  std::vector<int64_t> bytes;  // one entry per category, same order
  int64_t total = 0;
  int64_t reserved = -1;       // the reserved series' bytes (-1: none at this point)
};

// A line drawn over the stacked areas: what a caching allocator would reserve ("reserved_series":
// {key, label, peak_bytes}; each timeline point carries its bytes under `key`).
struct ReservedSeries {
  bool present = false;
  std::string key, label;
  int64_t peak_bytes = 0;
};

const char* const kReservedColor = "#6a3d9a";

ReservedSeries read_reserved_series(const json& doc) {
  ReservedSeries r;
  if (!doc.is_object() || !doc.contains("reserved_series") || !doc["reserved_series"].is_object()) return r;
  const json& s = doc["reserved_series"];
  r.key = field_text(s, "key");
  r.label = field_text(s, "label", "reserved");
  r.peak_bytes = field_bytes(s, "peak_bytes");
  r.present = !r.key.empty();
  return r;
}

std::vector<TimelinePoint> read_timeline(const json& doc, const std::vector<Category>& categories,
                                         const ReservedSeries& reserved) {
  std::vector<TimelinePoint> points;
  for (const json& item : field_array(doc, "timeline")) {
    TimelinePoint point;
    point.t_us = field_number(item, "t_us");
    for (const Category& category : categories) {
      point.bytes.push_back(field_bytes(item, category.key.c_str()));
      point.total += point.bytes.back();
    }
    if (reserved.present && has_number(item, reserved.key.c_str())) point.reserved = field_bytes(item, reserved.key.c_str());
    points.push_back(std::move(point));
  }
  // Events arrive in time order; a stable sort only guards against odd input.
  std::stable_sort(points.begin(), points.end(),
                   [](const TimelinePoint& a, const TimelinePoint& b) { return a.t_us < b.t_us; });
  return points;
}

size_t index_of_max_total(const std::vector<TimelinePoint>& points) {
  size_t best = 0;
  for (size_t i = 1; i < points.size(); ++i) {
    if (points[i].total > points[best].total) best = i;
  }
  return best;
}

// Thousands of events would make a heavy SVG. Split the events into buckets and
// keep the lowest and the highest point of each, in time order: the shape
// survives and the maximum-total point is always kept exactly.
std::vector<TimelinePoint> downsample(const std::vector<TimelinePoint>& points, size_t max_points) {
  if (points.size() <= max_points) return points;
  const size_t bucket_count = std::max<size_t>(1, max_points / 2);
  const size_t bucket_size = (points.size() + bucket_count - 1) / bucket_count;
  std::vector<TimelinePoint> kept;
  for (size_t start = 0; start < points.size(); start += bucket_size) {
    const size_t end = std::min(points.size(), start + bucket_size);
    size_t low = start, high = start;
    for (size_t i = start; i < end; ++i) {
      if (points[i].total < points[low].total) low = i;
      if (points[i].total > points[high].total) high = i;
    }
    kept.push_back(points[std::min(low, high)]);
    if (low != high) kept.push_back(points[std::max(low, high)]);
  }
  return kept;
}

// ---------------------------------------------------------------------------
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

// Plot rectangle inside an SVG, in pixels.
struct PlotArea {
  double left, top, width, height;
  double right() const { return left + width; }
  double bottom() const { return top + height; }
};

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

// ---------------------------------------------------------------------------
// Section: the timeline chart, its legend and the peak breakdown.

struct PeakInfo {
  int64_t bytes = 0;
  double t_us = 0;
  std::vector<int64_t> by_category;  // same order as categories
};

PeakInfo read_peak(const json& doc, const std::vector<Category>& categories,
                   const std::vector<TimelinePoint>& timeline) {
  PeakInfo peak;
  const TimelinePoint* max_point = timeline.empty() ? nullptr : &timeline[index_of_max_total(timeline)];
  // The document's own numbers win; the timeline fills in what is missing.
  peak.bytes = has_number(doc, "peak_bytes") ? as_bytes(doc["peak_bytes"]) : (max_point ? max_point->total : 0);
  peak.t_us = has_number(doc, "peak_time_us") ? field_number(doc, "peak_time_us") : (max_point ? max_point->t_us : 0);
  const bool has_breakdown = doc.contains("at_peak") && doc["at_peak"].is_object();
  for (size_t i = 0; i < categories.size(); ++i) {
    if (has_breakdown) {
      peak.by_category.push_back(field_bytes(doc["at_peak"], categories[i].key.c_str()));
    } else {
      peak.by_category.push_back(max_point ? max_point->bytes[i] : 0);
    }
  }
  return peak;
}

std::string phase_at(const std::vector<Phase>& phases, double t_us) {
  // Later phases win at a shared boundary: an event at the boundary belongs to the phase it starts.
  std::string name;
  for (const Phase& phase : phases) {
    if (t_us >= phase.start_us && t_us <= phase.end_us) name = phase.name;
  }
  return name;
}

// Step-shaped outline of one cumulative series: a value holds until the next event.
void append_step_outline(std::vector<std::pair<double, double>>& outline, const std::vector<double>& xs,
                         const std::vector<double>& ys, double x_end) {
  for (size_t i = 0; i < xs.size(); ++i) {
    if (i > 0) outline.emplace_back(xs[i], ys[i - 1]);
    outline.emplace_back(xs[i], ys[i]);
  }
  outline.emplace_back(x_end, ys.back());
}

std::string path_from(const std::vector<std::pair<double, double>>& outline) {
  std::string d;
  for (size_t i = 0; i < outline.size(); ++i) {
    append(d, "{}{:.1f},{:.1f}", i == 0 ? "M" : "L", outline[i].first, outline[i].second);
  }
  d += "Z";
  return d;
}

std::string render_category_legend(const std::vector<Category>& categories) {
  std::string out = R"(<div class="legend">)";
  for (const Category& category : categories) {
    append(out, R"(<span class="legend-item" data-category="{}"><span class="swatch" style="background:{}"></span>{}</span>)",
           escape_html(category.key), category.color, escape_html(category.label));
  }
  out += "</div>";
  return out;
}

// One legend entry per distinct phase name, so narrow unlabeled bands stay identifiable.
std::string render_phase_legend(const std::vector<Phase>& phases, bool has_budget, const ReservedSeries& reserved) {
  std::vector<std::string> names;
  for (const Phase& phase : phases) {
    if (std::find(names.begin(), names.end(), phase.name) == names.end()) names.push_back(phase.name);
  }
  std::string out = R"(<div class="legend legend-secondary">)";
  for (const std::string& name : names) {
    const std::string fill = name == "recompute" ? "repeating-linear-gradient(45deg,#e6d3ee 0 3px,#b07aa1 3px 5px)"
                                                 : phase_color(name);
    append(out, R"(<span class="phase-legend-item"><span class="swatch" style="background:{}"></span>{} phase</span>)",
           fill, escape_html(name));
  }
  if (has_budget) out += R"(<span class="phase-legend-item"><span class="swatch-line"></span>budget</span>)";
  if (reserved.present) {
    append(out, R"(<span class="phase-legend-item reserved-legend-item" data-series="{}"><span class="swatch-line" )"
                R"(style="border-top:2px solid {}"></span>{}</span>)",
           escape_html(reserved.key), kReservedColor, escape_html(reserved.label));
  }
  out += R"(<span class="phase-legend-item"><span class="swatch-dot"></span>peak</span>)";
  out += "</div>";
  return out;
}

// Time domain of the chart: covers both the events and the phase bands.
std::pair<double, double> time_domain(const std::vector<TimelinePoint>& timeline, const std::vector<Phase>& phases) {
  double t_lo = std::numeric_limits<double>::infinity(), t_hi = -t_lo;
  for (const TimelinePoint& point : timeline) {
    t_lo = std::min(t_lo, point.t_us);
    t_hi = std::max(t_hi, point.t_us);
  }
  for (const Phase& phase : phases) {
    t_lo = std::min(t_lo, phase.start_us);
    t_hi = std::max(t_hi, phase.end_us);
  }
  if (!std::isfinite(t_lo)) t_lo = 0, t_hi = 1000;
  if (t_hi <= t_lo) t_hi = t_lo + 1000;
  return {t_lo, t_hi};
}

// Byte axis tall enough for the peak, every point and the budget line.
ValueAxis timeline_byte_axis(const std::vector<TimelinePoint>& timeline, const PeakInfo& peak, bool has_budget,
                             int64_t budget_bytes) {
  double max_bytes = static_cast<double>(peak.bytes);
  for (const TimelinePoint& point : timeline) {
    max_bytes = std::max({max_bytes, static_cast<double>(point.total), static_cast<double>(point.reserved)});
  }
  if (has_budget) max_bytes = std::max(max_bytes, static_cast<double>(budget_bytes));
  return byte_axis(max_bytes);
}

// Phase bands behind everything, and a labelled strip above the plot.
void draw_phase_bands(std::string& out, const PlotArea& area, const std::vector<Phase>& phases, const Scale& x) {
  const double strip_y = area.top - 26, strip_height = 18;
  for (const Phase& phase : phases) {
    const double x0 = x(phase.start_us), x1 = x(phase.end_us);
    const std::string fill = phase.name == "recompute" ? "url(#recompute-band)" : phase_color(phase.name);
    const std::string tooltip = fmt::format("{}: {} to {}{}", phase.name, format_ms(phase.start_us),
                                            format_ms(phase.end_us),
                                            phase.has_peak ? ", peak " + format_bytes(phase.peak_bytes) : "");
    append(out, R"(<rect class="phase-band" x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="{}" opacity="0.55"/>)",
           x0, area.top, std::max(x1 - x0, 0.5), area.height, fill);
    append(out, R"(<g class="phase-strip"><title>{}</title><rect x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="{}"/>)",
           escape_html(tooltip), x0, strip_y, std::max(x1 - x0, 0.5), strip_height, fill);
    if (text_width(phase.name) + 8 < x1 - x0) {
      append(out, R"(<text class="phase-label" x="{:.1f}" y="{:.1f}" text-anchor="middle" dominant-baseline="middle">{}</text>)",
             (x0 + x1) / 2, strip_y + strip_height / 2 + 1, escape_html(phase.name));
    }
    out += "</g>";
  }
}

// Stacked areas, first category at the bottom.
void draw_stacked_areas(std::string& out, const PlotArea& area, const std::vector<Category>& categories,
                        const std::vector<TimelinePoint>& drawn, const Scale& x, const Scale& y) {
  if (drawn.empty()) {
    append(out, R"(<text class="empty" x="{:.1f}" y="{:.1f}" text-anchor="middle">no timeline data</text>)",
           area.left + area.width / 2, area.top + area.height / 2);
    return;
  }
  std::vector<double> xs;
  for (const TimelinePoint& point : drawn) xs.push_back(x(point.t_us));
  std::vector<double> below(drawn.size(), 0.0);  // cumulative bytes under the current category
  for (size_t c = 0; c < categories.size(); ++c) {
    std::vector<double> lower_ys, upper_ys, above(drawn.size());
    for (size_t i = 0; i < drawn.size(); ++i) {
      above[i] = below[i] + static_cast<double>(drawn[i].bytes[c]);
      lower_ys.push_back(y(below[i]));
      upper_ys.push_back(y(above[i]));
    }
    std::vector<std::pair<double, double>> outline, lower;
    append_step_outline(outline, xs, upper_ys, area.right());
    append_step_outline(lower, xs, lower_ys, area.right());
    outline.insert(outline.end(), lower.rbegin(), lower.rend());
    append(out, R"(<path class="area" data-category="{}" d="{}" fill="{}"><title>{}</title></path>)",
           escape_html(categories[c].key), path_from(outline), categories[c].color,
           escape_html(categories[c].label));
    below = above;
  }
}

// Phase boundaries on top of the areas so they stay visible inside them.
void draw_phase_edges(std::string& out, const PlotArea& area, const std::vector<Phase>& phases, const Scale& x) {
  for (size_t i = 1; i < phases.size(); ++i) {
    const double px = x(phases[i].start_us);
    append(out, R"(<line class="phase-edge" x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}"/>)", px, area.top, px,
           area.bottom());
  }
}

void draw_budget_line(std::string& out, const PlotArea& area, const Scale& y, int64_t budget_bytes) {
  const double py = y(static_cast<double>(budget_bytes));
  append(out, R"(<line class="budget" x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}"><title>budget {} bytes</title></line>)",
         area.left, py, area.right(), py, budget_bytes);
  append(out, R"(<text class="budget-label" x="{:.1f}" y="{:.1f}">budget {}</text>)", area.left + 6, py - 6,
         escape_html(format_bytes(budget_bytes)));
}

// Peak marker, labelled on whichever side has room.
void draw_peak_marker(std::string& out, const PlotArea& area, const PeakInfo& peak, const Scale& x, const Scale& y) {
  const double peak_x = x(peak.t_us), peak_y = y(static_cast<double>(peak.bytes));
  const std::string peak_label = "peak " + format_bytes(peak.bytes);
  const bool label_left = peak_x + 12 + text_width(peak_label) > area.right();
  append(out, R"(<g class="peak-marker"><title>peak: {} bytes at {}</title>)", peak.bytes, format_ms(peak.t_us));
  append(out, R"(<line x1="{0:.1f}" y1="{1:.1f}" x2="{0:.1f}" y2="{2:.1f}" class="peak-drop"/>)", peak_x, peak_y,
         area.bottom());
  append(out, R"(<circle cx="{:.1f}" cy="{:.1f}" r="5.5"/>)", peak_x, peak_y);
  append(out, R"(<text class="peak-label" x="{:.1f}" y="{:.1f}" text-anchor="{}">{}</text></g>)",
         label_left ? peak_x - 10 : peak_x + 10, peak_y - 8, label_left ? "end" : "start",
         escape_html(peak_label));
}

// The reserved series as a step line over the areas (it holds until the next event).
void draw_reserved_line(std::string& out, const PlotArea& area, const std::vector<TimelinePoint>& drawn,
                        const ReservedSeries& series, const Scale& x, const Scale& y) {
  std::string d;
  double last_y = 0;
  for (const TimelinePoint& point : drawn) {
    if (point.reserved < 0) continue;
    const double px = x(point.t_us), py = y(static_cast<double>(point.reserved));
    if (d.empty()) {
      append(d, "M{:.1f},{:.1f}", px, py);
    } else {
      append(d, "L{:.1f},{:.1f}L{:.1f},{:.1f}", px, last_y, px, py);
    }
    last_y = py;
  }
  if (d.empty()) return;
  append(d, "L{:.1f},{:.1f}", area.right(), last_y);
  append(out, R"(<path class="reserved-line" data-series="{}" d="{}" stroke="{}"><title>{}: peak {} ({} bytes)</title></path>)",
         escape_html(series.key), d, kReservedColor, escape_html(series.label), escape_html(format_bytes(series.peak_bytes)),
         series.peak_bytes);
}

// Data for the hover readout: the drawn points and the pixel mapping.
std::string timeline_data_script(const std::vector<Category>& categories, const std::vector<TimelinePoint>& drawn,
                                 double t_lo, double t_hi, const PlotArea& area, const ReservedSeries& reserved) {
  json hover = {{"t0", t_lo}, {"t1", t_hi}, {"x0", area.left}, {"x1", area.right()},
                {"labels", json::array()}, {"points", json::array()}};
  for (const Category& category : categories) hover["labels"].push_back(category.label);
  if (reserved.present) hover["reserved_label"] = reserved.label;
  for (const TimelinePoint& point : drawn) {
    // Whole microseconds stay integers in the JSON ("1234", not "1234.0").
    json row = json::array();
    if (point.t_us == std::floor(point.t_us) && std::fabs(point.t_us) < 9e15) {
      row.push_back(static_cast<int64_t>(point.t_us));
    } else {
      row.push_back(point.t_us);
    }
    for (int64_t bytes : point.bytes) row.push_back(bytes);
    if (reserved.present) row.push_back(point.reserved);
    hover["points"].push_back(std::move(row));
  }
  std::string hover_json = hover.dump(-1, ' ', false, json::error_handler_t::replace);
  // "<" only occurs inside JSON strings, where \u003c means the same and cannot close the script.
  std::string safe_json;
  for (char c : hover_json) safe_json += c == '<' ? std::string("\\u003c") : std::string(1, c);
  return R"(<script type="application/json" id="timeline-data">)" + safe_json + "</script>";
}

std::string render_timeline_svg(const std::vector<Category>& categories, const std::vector<TimelinePoint>& timeline,
                                 const std::vector<Phase>& phases, const PeakInfo& peak, bool has_budget,
                                 int64_t budget_bytes, const ReservedSeries& reserved) {
  const double svg_width = 900, svg_height = 430;
  const PlotArea area{78, 44, 800, 330};  // room for the phase strip above and the time axis below

  const auto [t_lo, t_hi] = time_domain(timeline, phases);
  // Axis works in milliseconds, positions in microseconds.
  const Scale x_ms{t_lo / 1000, t_hi / 1000, area.left, area.right()};
  const Scale x{t_lo, t_hi, area.left, area.right()};
  const ValueAxis y_axis = timeline_byte_axis(timeline, peak, has_budget, budget_bytes);
  const Scale y{y_axis.lo, y_axis.hi, area.bottom(), area.top};

  std::string out;
  append(out, R"(<svg id="timeline-chart" class="chart" width="{0}" height="{1}" viewBox="0 0 {0} {1}" )"
              R"(role="img" aria-label="live bytes by category over one training step">)",
         svg_width, svg_height);
  out += hatch_pattern("recompute-band", "#f3eaf7", "#d7bfe2");
  draw_phase_bands(out, area, phases, x);
  draw_y_axis(out, area, y_axis, y);
  draw_x_axis(out, area, ticks_between(t_lo / 1000, t_hi / 1000, nice_step((t_hi - t_lo) / 1000, 10)), x_ms,
              "time within the step (ms)");
  const std::vector<TimelinePoint> drawn = downsample(timeline, 1500);
  draw_stacked_areas(out, area, categories, drawn, x, y);
  draw_phase_edges(out, area, phases, x);
  if (reserved.present) draw_reserved_line(out, area, drawn, reserved, x, y);
  if (has_budget) draw_budget_line(out, area, y, budget_bytes);
  // Nothing to mark in an empty report.
  if (!timeline.empty() || peak.bytes > 0) draw_peak_marker(out, area, peak, x, y);

  // Hover guide line, moved by the inline script.
  append(out, R"(<line id="timeline-guide" x1="0" y1="{:.1f}" x2="0" y2="{:.1f}" visibility="hidden"/>)", area.top,
         area.bottom());
  out += "</svg>";
  out += timeline_data_script(categories, drawn, t_lo, t_hi, area, reserved);
  return out;
}

std::string render_peak_panel(const std::vector<Category>& categories, const std::vector<Phase>& phases,
                              const PeakInfo& peak, bool has_budget, int64_t budget_bytes,
                              const ReservedSeries& reserved) {
  std::string out = R"(<aside class="peak-panel"><h3>Peak of the step</h3>)";
  append(out, R"(<div id="peak-value" class="peak-value" data-bytes="{0}"><span class="peak-exact">{0} bytes</span> )"
              R"(<span class="peak-human">({1})</span></div>)",
         peak.bytes, escape_html(format_bytes(peak.bytes)));
  const std::string phase = phase_at(phases, peak.t_us);
  append(out, R"(<p class="muted">at {}{}</p>)", format_ms(peak.t_us),
         phase.empty() ? "" : ", during " + escape_html(phase));
  if (reserved.present) {
    append(out, R"(<p id="reserved-peak" class="muted" data-bytes="{}">{}: peak {}</p>)", reserved.peak_bytes,
           escape_html(reserved.label), escape_html(format_bytes(reserved.peak_bytes)));
  }
  if (has_budget) {
    const int64_t headroom = budget_bytes - peak.bytes;
    if (headroom >= 0) {
      append(out, R"(<p class="fits">Fits the {} budget: {} headroom ({} of budget)</p>)",
             escape_html(format_bytes(budget_bytes)), escape_html(format_bytes(headroom)),
             format_percent(static_cast<double>(headroom), static_cast<double>(budget_bytes)));
    } else {
      append(out, R"(<p class="over">Over the {} budget by {}</p>)", escape_html(format_bytes(budget_bytes)),
             escape_html(format_bytes(-headroom)));
    }
  }
  out += R"(<table class="breakdown"><thead><tr><th>Category</th><th class="num">Size</th><th class="num">Bytes</th>)"
         R"(<th class="num">Share</th></tr></thead><tbody>)";
  for (size_t i = 0; i < categories.size(); ++i) {
    append(out, R"(<tr data-category="{}"><td><span class="swatch" style="background:{}"></span>{}</td>)"
                R"(<td class="num">{}</td><td class="num mono">{}</td><td class="num">{}</td></tr>)",
           escape_html(categories[i].key), categories[i].color, escape_html(categories[i].label),
           escape_html(format_bytes(peak.by_category[i])), peak.by_category[i],
           format_percent(static_cast<double>(peak.by_category[i]), static_cast<double>(peak.bytes)));
  }
  append(out, R"(</tbody><tfoot><tr><td>Total</td><td class="num">{}</td><td class="num mono">{}</td><td></td></tr>)"
              R"(</tfoot></table></aside>)",
         escape_html(format_bytes(peak.bytes)), peak.bytes);
  return out;
}

// Phases summed by name: recompute can appear many times between backward segments.
std::string render_phase_table(const std::vector<Phase>& phases) {
  if (phases.empty()) return "";
  struct Summary {
    std::string name;
    int segments = 0;
    double duration_us = 0;
    std::optional<int64_t> peak_bytes;  // none: no phase of this name had a peak
  };
  std::vector<Summary> summaries;
  for (const Phase& phase : phases) {
    auto it = std::find_if(summaries.begin(), summaries.end(), [&](const Summary& s) { return s.name == phase.name; });
    if (it == summaries.end()) it = summaries.insert(summaries.end(), Summary{phase.name, 0, 0, std::nullopt});
    it->segments += 1;
    it->duration_us += phase.end_us - phase.start_us;
    if (phase.has_peak) it->peak_bytes = std::max(it->peak_bytes.value_or(phase.peak_bytes), phase.peak_bytes);
  }
  std::string out = R"(<table class="data-table phase-table"><thead><tr><th>Phase</th><th class="num">Segments</th>)"
                    R"(<th class="num">Time</th><th class="num">Peak</th><th class="num">Peak bytes</th></tr></thead><tbody>)";
  for (const Summary& s : summaries) {
    append(out, R"(<tr><td>{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td>)"
                R"(<td class="num mono">{}</td></tr>)",
           escape_html(s.name), s.segments, format_ms(s.duration_us),
           s.peak_bytes ? escape_html(format_bytes(*s.peak_bytes)) : "&ndash;",
           s.peak_bytes ? std::to_string(*s.peak_bytes) : "&ndash;");
  }
  out += "</tbody></table>";
  return out;
}

// ---------------------------------------------------------------------------
// Section: activation bytes per block.

struct Block {
  std::string name;
  int64_t bytes;
  bool recomputed;
};

std::vector<Block> read_blocks(const json& doc) {
  std::vector<Block> blocks;
  for (const json& item : field_array(doc, "blocks")) {
    const bool recomputed = item.is_object() && item.contains("recomputed") && item["recomputed"].is_boolean() &&
                            item["recomputed"].get<bool>();
    blocks.push_back({field_text(item, "name", "?"), field_bytes(item, "activation_bytes"), recomputed});
  }
  return blocks;
}

// Vertical gridlines with byte labels under the bars.
void draw_byte_gridlines(std::string& out, const PlotArea& area, const ValueAxis& axis, const Scale& x) {
  for (double tick : axis.ticks) {
    const double px = x(tick);
    append(out, R"(<line class="grid" x1="{0:.1f}" y1="{1:.1f}" x2="{0:.1f}" y2="{2:.1f}"/>)", px, area.top,
           area.bottom());
    append(out, R"(<text class="tick" x="{:.1f}" y="{:.1f}" text-anchor="middle">{}</text>)", px,
           area.bottom() + 18, escape_html(axis.tick_label(tick)));
  }
}

// One row per block: its name, a bar (hatched when recomputed) and its size.
void draw_block_rows(std::string& out, const PlotArea& area, const std::vector<Block>& blocks, const Scale& x,
                     double row_height, const std::string& stored_color) {
  const double bar_height = 15;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& block = blocks[i];
    const double row_y = area.top + row_height * static_cast<double>(i);
    const double bar_y = row_y + (row_height - bar_height) / 2;
    const double bar_width = std::max(x(static_cast<double>(block.bytes)) - area.left, 1.0);
    append(out, R"(<g class="block-bar{}" data-block="{}" data-bytes="{}"><title>{}: {} ({} bytes){}</title>)",
           block.recomputed ? " recomputed" : "", escape_html(block.name), block.bytes, escape_html(block.name),
           escape_html(format_bytes(block.bytes)), block.bytes, block.recomputed ? ", recomputed" : "");
    append(out, R"(<text class="block-name" x="{:.1f}" y="{:.1f}" text-anchor="end" dominant-baseline="middle">{}</text>)",
           area.left - 8, row_y + row_height / 2, escape_html(block.name));
    append(out, R"(<rect x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="{}" stroke="{}" stroke-width="1"/>)",
           area.left, bar_y, bar_width, bar_height, block.recomputed ? "url(#recomputed-bar)" : stored_color,
           stored_color);
    append(out, R"(<text class="tick" x="{:.1f}" y="{:.1f}" dominant-baseline="middle">{}</text></g>)",
           area.left + bar_width + 6, row_y + row_height / 2, escape_html(format_bytes(block.bytes)));
  }
}

std::string render_blocks_section(const json& doc) {
  const std::vector<Block> blocks = read_blocks(doc);
  if (blocks.empty()) return "";

  const std::string stored_color = "#e15759";  // same red as the Activations area
  size_t longest_name = 0;
  int64_t max_bytes = 1;
  int recomputed_count = 0;
  for (const Block& block : blocks) {
    longest_name = std::max(longest_name, block.name.size());
    max_bytes = std::max(max_bytes, block.bytes);
    recomputed_count += block.recomputed ? 1 : 0;
  }
  const double label_width = std::clamp(text_width(std::string(longest_name, 'x')) + 12, 60.0, 220.0);
  const double row_height = 22;
  const PlotArea area{label_width, 10, 880 - label_width - 90, row_height * static_cast<double>(blocks.size())};
  const ValueAxis axis = byte_axis(static_cast<double>(max_bytes));
  const Scale x{axis.lo, axis.hi, area.left, area.right()};
  const double svg_width = 900, svg_height = area.bottom() + 30;

  std::string out = R"(<section class="card"><h2>Activation bytes per block</h2>)";
  append(out, R"(<p class="muted">Activations each block keeps for backward. {} of {} blocks are recomputed: )"
              R"(their activations are freed after forward and rebuilt during backward.</p>)",
         recomputed_count, blocks.size());
  append(out, R"(<div class="legend legend-secondary"><span class="blocks-legend-item" data-kind="stored"><span class="swatch" )"
              R"(style="background:{}"></span>stored</span><span class="blocks-legend-item" data-kind="recomputed">)"
              R"~(<span class="swatch" style="background:repeating-linear-gradient(45deg,#fbe1e2 0 3px,{} 3px 5px)">)~"
              R"(</span>recomputed</span></div>)",
         stored_color, stored_color);
  append(out, R"(<svg id="blocks-chart" class="chart" width="{0}" height="{1}" viewBox="0 0 {0} {1}" role="img" )"
              R"(aria-label="activation bytes per block">)",
         svg_width, svg_height);
  out += hatch_pattern("recomputed-bar", "#fbe1e2", stored_color);
  draw_byte_gridlines(out, area, axis, x);
  draw_block_rows(out, area, blocks, x, row_height, stored_color);
  append(out, R"(<line class="axis" x1="{0:.1f}" y1="{1:.1f}" x2="{0:.1f}" y2="{2:.1f}"/>)", area.left, area.top,
         area.bottom());
  out += "</svg></section>";
  return out;
}

// ---------------------------------------------------------------------------
// Section: the plan as a two-column table.

std::string render_plan_section(const json& doc) {
  if (!doc.contains("plan") || !doc["plan"].is_object()) return "";
  const json& rows = field_array(doc["plan"], "rows");
  if (rows.empty()) return "";
  std::string out = R"(<section class="card"><h2>Plan</h2><table id="plan-table" class="data-table"><tbody>)";
  for (const json& row : rows) {
    // A row is [label, value]; anything else is shown as well as it can be.
    const std::string label = row.is_array() && !row.empty() ? text_of(row[0]) : text_of(row);
    const std::string value = row.is_array() && row.size() > 1 ? text_of(row[1]) : "";
    append(out, R"(<tr><th>{}</th><td>{}</td></tr>)", escape_html(label), escape_html(value));
  }
  out += "</tbody></table></section>";
  return out;
}

// ---------------------------------------------------------------------------
// Section: data-parallel state bytes per rank (weights, gradients at the optimizer step, AdamW
// state), which ZeRO stages 1 and 2 shard.

std::string render_ranks_section(const json& doc) {
  if (!doc.contains("ranks") || !doc["ranks"].is_array() || doc["ranks"].size() < 2) return "";
  const int stage = doc.contains("zero_stage") && doc["zero_stage"].is_number_integer() ? doc["zero_stage"].get<int>() : 0;
  std::string out;
  append(out, R"(<section class="card"><h2>State per rank (ZeRO stage {})</h2>)", stage);
  out += R"(<table id="ranks-table" class="data-table"><thead><tr><th>rank</th><th>weights</th><th>gradients</th>)"
         R"(<th>optimizer state</th><th>total</th></tr></thead><tbody>)";
  for (const json& r : doc["ranks"]) {
    if (!r.is_object()) continue;
    const int64_t wts = r.value("weights", int64_t{0}), grads = r.value("gradients", int64_t{0}),
                  opt = r.value("optimizer_state", int64_t{0});
    append(out, R"(<tr><td>{}</td><td title="{} bytes">{}</td><td title="{} bytes">{}</td><td title="{} bytes">{}</td><td>{}</td></tr>)",
           r.value("rank", 0), wts, escape_html(format_bytes(wts)), grads, escape_html(format_bytes(grads)), opt,
           escape_html(format_bytes(opt)), escape_html(format_bytes(wts + grads + opt)));
  }
  out += "</tbody></table>";
  const int64_t gathered = doc.value("largest_gathered_block_bytes", int64_t{0});
  if (gathered > 0) {
    append(out, R"(<p id="ranks-gathered">Each rank also gathers one block's weights in full while it runs: the largest is )"
                R"(<span title="{} bytes">{}</span> (with its gradients until they are reduced to their owners).</p>)",
           gathered, escape_html(format_bytes(gathered)));
  }
  out += "</section>";
  return out;
}

// ---------------------------------------------------------------------------
// Section: per-step loss and memory for training runs.

struct Series {
  std::string name;
  std::string color;
  std::vector<std::pair<double, double>> points;  // (step, value)
  bool dots = false;
};

void draw_line_panel(std::string& out, const PlotArea& area, const std::string& title, const std::vector<Series>& series,
                     const Scale& x, const std::vector<double>& x_ticks, const ValueAxis& y_axis,
                     const std::vector<std::pair<std::string, double>>& dashed_lines) {
  const Scale y{y_axis.lo, y_axis.hi, area.bottom(), area.top};
  append(out, R"(<text class="panel-title" x="{:.1f}" y="{:.1f}">{}</text>)", area.left, area.top - 24,
         escape_html(title));
  draw_y_axis(out, area, y_axis, y);
  draw_x_axis(out, area, x_ticks, x, "step");
  for (const auto& [label, value] : dashed_lines) {
    const double py = y(value);
    append(out, R"(<line class="budget" x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}"/>)", area.left, py,
           area.right(), py);
    append(out, R"(<text class="budget-label" x="{:.1f}" y="{:.1f}" text-anchor="end">{}</text>)", area.right() - 4,
           py - 5, escape_html(label));
  }
  // Legend along the top edge of the panel.
  double legend_x = area.left;
  for (const Series& s : series) {
    if (s.points.empty()) continue;
    append(out, R"(<line x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}" stroke="{}" stroke-width="2.5"/>)", legend_x,
           area.top - 8, legend_x + 16, area.top - 8, s.color);
    append(out, R"(<text class="tick" x="{:.1f}" y="{:.1f}" dominant-baseline="middle">{}</text>)", legend_x + 21,
           area.top - 8, escape_html(s.name));
    legend_x += 34 + text_width(s.name);
  }
  for (const Series& s : series) {
    if (s.points.empty()) continue;
    std::string points;
    for (const auto& [step, value] : s.points) append(points, "{:.1f},{:.1f} ", x(step), y(value));
    append(out, R"(<polyline class="series" points="{}" stroke="{}"><title>{}</title></polyline>)", points, s.color,
           escape_html(s.name));
    // Dots where points are sparse enough to tell apart, or the line would be invisible.
    if (s.dots || s.points.size() <= 1) {
      for (const auto& [step, value] : s.points) {
        append(out, R"(<circle cx="{:.1f}" cy="{:.1f}" r="3" fill="{}"><title>{} at step {:g}: {:g}</title></circle>)",
               x(step), y(value), s.color, escape_html(s.name), step, value);
      }
    }
  }
}

std::string render_steps_section(const json& doc, bool has_budget, int64_t budget_bytes) {
  const json& steps = field_array(doc, "steps");
  if (steps.empty()) return "";
  Series loss{"train loss", "#4e79a7", {}, false};
  Series eval_loss{"eval loss", "#e15759", {}, true};
  Series live{"live bytes", "#59a14f", {}, false};
  Series peak{"peak bytes", "#f28e2b", {}, false};
  double step_lo = std::numeric_limits<double>::infinity(), step_hi = -step_lo;
  for (size_t i = 0; i < steps.size(); ++i) {
    const json& item = steps[i];
    const double step = field_number(item, "step", static_cast<double>(i + 1));
    step_lo = std::min(step_lo, step);
    step_hi = std::max(step_hi, step);
    if (has_number(item, "loss")) loss.points.emplace_back(step, field_number(item, "loss"));
    if (has_number(item, "eval_loss")) eval_loss.points.emplace_back(step, field_number(item, "eval_loss"));
    if (has_number(item, "live_bytes")) live.points.emplace_back(step, static_cast<double>(field_bytes(item, "live_bytes")));
    if (has_number(item, "peak_bytes")) peak.points.emplace_back(step, static_cast<double>(field_bytes(item, "peak_bytes")));
  }
  if (step_hi <= step_lo) step_hi = step_lo + 1;
  loss.dots = loss.points.size() <= 40;

  double loss_lo = std::numeric_limits<double>::infinity(), loss_hi = -loss_lo;
  for (const Series* s : {&loss, &eval_loss}) {
    for (const auto& point : s->points) {
      loss_lo = std::min(loss_lo, point.second);
      loss_hi = std::max(loss_hi, point.second);
    }
  }
  if (!std::isfinite(loss_lo)) loss_lo = 0, loss_hi = 1;
  double bytes_hi = has_budget ? static_cast<double>(budget_bytes) : 0;
  for (const Series* s : {&live, &peak}) {
    for (const auto& point : s->points) bytes_hi = std::max(bytes_hi, point.second);
  }

  // Two panels side by side, filling the card width.
  const double svg_width = 1280, svg_height = 300;
  const PlotArea loss_area{60, 52, 530, 190};
  const PlotArea bytes_area{730, 52, 530, 190};
  const std::vector<double> step_ticks = ticks_between(step_lo, step_hi, std::max(1.0, nice_step(step_hi - step_lo, 6)));

  std::string out = R"(<section class="card"><h2>Training steps</h2>)";
  append(out, R"(<svg id="steps-chart" class="chart" width="{0}" height="{1}" viewBox="0 0 {0} {1}" role="img" )"
              R"(aria-label="loss and memory per training step">)",
         svg_width, svg_height);
  draw_line_panel(out, loss_area, "Loss", {loss, eval_loss}, Scale{step_lo, step_hi, loss_area.left, loss_area.right()},
                  step_ticks, number_axis(loss_lo, loss_hi), {});
  std::vector<std::pair<std::string, double>> budget_line;
  if (has_budget) budget_line.emplace_back("budget " + format_bytes(budget_bytes), static_cast<double>(budget_bytes));
  draw_line_panel(out, bytes_area, "Memory", {live, peak}, Scale{step_lo, step_hi, bytes_area.left, bytes_area.right()},
                  step_ticks, byte_axis(bytes_hi), budget_line);
  out += "</svg></section>";
  return out;
}

// ---------------------------------------------------------------------------
// Page shell.

const char* const kStyle = R"CSS(
:root { color-scheme: light; }
body { margin: 0; padding: 24px 32px 48px; background: #f4f5f7; color: #1f2328;
       font: 14px/1.45 "DejaVu Sans", "Liberation Sans", "Helvetica Neue", Arial, sans-serif; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 0 0 10px; }
h3 { font-size: 14px; margin: 0 0 8px; text-transform: uppercase; letter-spacing: .04em; color: #57606a; }
.subtitle { color: #57606a; margin: 0 0 20px; }
.card { background: #fff; border: 1px solid #d8dee4; border-radius: 8px; padding: 18px 20px; margin: 0 0 20px;
        max-width: 1340px; box-sizing: border-box; }
.timeline-row { display: flex; flex-wrap: wrap; gap: 20px; align-items: flex-start; }
.chart-wrap { position: relative; }
.chart { display: block; max-width: 100%; height: auto; font-size: 12px; }
.chart .grid { stroke: #e3e6ea; stroke-width: 1; }
.chart .axis { stroke: #8c959f; stroke-width: 1; }
.chart .tick { fill: #57606a; }
.chart .axis-title, .chart .panel-title { fill: #1f2328; font-weight: bold; }
.chart .phase-label { fill: #3d444d; font-size: 11px; }
.chart .phase-edge { stroke: #ffffff; stroke-width: 1; stroke-opacity: .8; stroke-dasharray: 3 3; }
.chart .area { stroke: #ffffff; stroke-width: .4; fill-opacity: .9; }
.chart .budget { stroke: #1f2328; stroke-width: 1.5; stroke-dasharray: 7 5; }
.chart .budget-label { fill: #1f2328; font-weight: bold; paint-order: stroke; stroke: #fff; stroke-width: 3px; }
.chart .peak-marker circle { fill: #fff; stroke: #1f2328; stroke-width: 2.5; }
.chart .peak-drop { stroke: #1f2328; stroke-width: 1; stroke-dasharray: 2 3; }
.chart .peak-label { fill: #1f2328; font-weight: bold; paint-order: stroke; stroke: #fff; stroke-width: 3px; }
.chart .series { fill: none; stroke-width: 2; }
.chart .reserved-line { fill: none; stroke-width: 2; }
.chart .block-name { fill: #1f2328; font-family: "DejaVu Sans Mono", monospace; font-size: 11px; }
.chart .empty { fill: #8c959f; font-size: 16px; }
#timeline-guide { stroke: #1f2328; stroke-width: 1; pointer-events: none; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 18px; margin: 0 0 6px; }
.legend-secondary { font-size: 12px; color: #57606a; }
.legend-item, .phase-legend-item, .blocks-legend-item { display: inline-flex; align-items: center; gap: 6px; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 6px; vertical-align: -1px; }
.legend-item .swatch, .phase-legend-item .swatch, .blocks-legend-item .swatch { margin-right: 0; }
.swatch-line { display: inline-block; width: 18px; border-top: 2px dashed #1f2328; }
.swatch-dot { display: inline-block; width: 8px; height: 8px; border: 2px solid #1f2328; border-radius: 50%; }
.peak-panel { flex: 1 1 340px; min-width: 340px; max-width: 400px; }
.peak-value { font-size: 15px; margin-bottom: 2px; }
.peak-exact { font-family: "DejaVu Sans Mono", monospace; font-weight: bold; font-size: 17px; }
.peak-human { color: #57606a; }
.muted { color: #57606a; margin: 0 0 10px; }
.fits { color: #1a7f37; margin: 0 0 12px; }
.over { color: #cf222e; font-weight: bold; margin: 0 0 12px; }
table { border-collapse: collapse; }
.breakdown { width: 100%; font-size: 13px; }
.breakdown th, .breakdown td, .data-table th, .data-table td { padding: 5px 8px; border-bottom: 1px solid #eaeef2; text-align: left; }
.breakdown thead th, .data-table thead th { color: #57606a; font-weight: normal; font-size: 12px; }
.breakdown tfoot td { font-weight: bold; border-bottom: none; }
.num { text-align: right !important; white-space: nowrap; }
.mono { font-family: "DejaVu Sans Mono", monospace; font-size: 12px; }
.data-table { font-size: 13px; min-width: 420px; }
#plan-table th { font-weight: normal; color: #57606a; padding-right: 28px; white-space: nowrap; }
.phase-table { margin-top: 14px; }
.tooltip { position: absolute; pointer-events: none; background: rgba(31,35,40,.92); color: #fff; font-size: 12px;
           padding: 6px 9px; border-radius: 4px; white-space: pre; font-family: "DejaVu Sans Mono", monospace; }
)CSS";

// Hover readout for the timeline: shows every category at the cursor's time.
// Built with textContent only, so document strings are never parsed as HTML.
const char* const kScript = R"JS(
(function () {
  var svg = document.getElementById('timeline-chart');
  var dataElement = document.getElementById('timeline-data');
  var tip = document.getElementById('timeline-tooltip');
  var guide = document.getElementById('timeline-guide');
  if (!svg || !dataElement || !tip || !guide || !svg.getScreenCTM) return;
  var data = JSON.parse(dataElement.textContent);
  if (!data.points.length) return;
  function formatBytes(bytes) {
    var units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'], value = Math.abs(bytes), unit = 0;
    if (value < 1024) return bytes + ' B';
    while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit++; }
    return (bytes < 0 ? '-' : '') + value.toFixed(value < 10 ? 2 : value < 100 ? 1 : 0) + ' ' + units[unit];
  }
  function hide() { tip.style.display = 'none'; guide.setAttribute('visibility', 'hidden'); }
  svg.addEventListener('mouseleave', hide);
  svg.addEventListener('mousemove', function (event) {
    var cursor = svg.createSVGPoint();
    cursor.x = event.clientX; cursor.y = event.clientY;
    var p = cursor.matrixTransform(svg.getScreenCTM().inverse());
    if (p.x < data.x0 || p.x > data.x1) { hide(); return; }
    var t = data.t0 + (p.x - data.x0) / (data.x1 - data.x0) * (data.t1 - data.t0);
    // Last event at or before t: live bytes hold until the next event.
    var lo = 0, hi = data.points.length - 1;
    while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (data.points[mid][0] <= t) lo = mid; else hi = mid - 1; }
    var row = data.points[lo], total = 0, lines = [(t / 1000).toFixed(2) + ' ms'];
    for (var i = 0; i < data.labels.length; i++) { total += row[i + 1]; lines.push(data.labels[i] + ': ' + formatBytes(row[i + 1])); }
    lines.push('Total: ' + formatBytes(total));
    if (data.reserved_label && row[data.labels.length + 1] >= 0) lines.push(data.reserved_label + ': ' + formatBytes(row[data.labels.length + 1]));
    tip.textContent = lines.join('\n');
    guide.setAttribute('x1', p.x); guide.setAttribute('x2', p.x); guide.setAttribute('visibility', 'visible');
    var box = svg.parentNode.getBoundingClientRect();
    tip.style.display = 'block';
    tip.style.left = (event.clientX - box.left + 14) + 'px';
    tip.style.top = (event.clientY - box.top + 14) + 'px';
  });
})();
)JS";

}  // namespace

std::string render_html_report(const nlohmann::json& doc) {
  if (!doc.is_object()) throw std::invalid_argument("memfit report: document must be a JSON object");

  const std::vector<Category> categories = read_categories(doc);
  const ReservedSeries reserved = read_reserved_series(doc);
  const std::vector<TimelinePoint> timeline = read_timeline(doc, categories, reserved);
  const std::vector<Phase> phases = read_phases(doc);
  const PeakInfo peak = read_peak(doc, categories, timeline);
  const bool has_budget = has_number(doc, "budget_bytes") && as_bytes(doc["budget_bytes"]) > 0;
  const int64_t budget_bytes = has_budget ? as_bytes(doc["budget_bytes"]) : 0;
  const std::string title = field_text(doc, "title", "memfit memory report");
  const std::string device = field_text(doc, "device");

  std::string page;
  page.reserve(64 * 1024);
  append(page, "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
               "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>{}</title>\n",
         escape_html(title));
  page += "<style>";
  page += kStyle;
  page += "</style>\n</head>\n<body>\n";
  append(page, "<h1>{}</h1>\n", escape_html(title));

  std::string subtitle = "Live memory over one training step";
  if (!device.empty()) subtitle += " on " + device;
  subtitle += fmt::format(" · peak {}", format_bytes(peak.bytes));
  if (has_budget) subtitle += fmt::format(" · budget {}", format_bytes(budget_bytes));
  if (!timeline.empty()) subtitle += fmt::format(" · {} allocator events", timeline.size());
  append(page, "<p class=\"subtitle\">{}</p>\n", escape_html(subtitle));

  page += R"(<section class="card"><h2>Live bytes by category</h2><div class="timeline-row"><div class="chart-wrap">)";
  page += render_category_legend(categories);
  page += render_phase_legend(phases, has_budget, reserved);
  page += render_timeline_svg(categories, timeline, phases, peak, has_budget, budget_bytes, reserved);
  page += R"(<div id="timeline-tooltip" class="tooltip" style="display:none"></div></div>)";
  page += render_peak_panel(categories, phases, peak, has_budget, budget_bytes, reserved);
  page += "</div>";
  page += render_phase_table(phases);
  page += "</section>\n";

  page += render_blocks_section(doc);
  page += render_plan_section(doc);
  page += render_ranks_section(doc);
  page += render_steps_section(doc, has_budget, budget_bytes);

  page += "\n<script>";
  page += kScript;
  page += "</script>\n</body>\n</html>\n";
  return page;
}

void write_html_report(const std::string& path, const nlohmann::json& doc) {
  // Render first: a rendering error must not leave any file behind.
  const std::string page = render_html_report(doc);
  const std::string temp_path = path + ".tmp";
  {
    std::ofstream file(temp_path, std::ios::binary | std::ios::trunc);
    if (!file) {
      throw std::runtime_error(fmt::format("cannot write HTML report '{}': cannot open '{}' for writing ({})", path,
                                           temp_path, std::strerror(errno)));
    }
    file.write(page.data(), static_cast<std::streamsize>(page.size()));
    file.flush();
    file.close();
    if (file.fail()) {
      std::remove(temp_path.c_str());
      throw std::runtime_error(fmt::format("cannot write HTML report '{}': writing '{}' failed", path, temp_path));
    }
  }
  // rename() replaces the target in one step, so readers never see a partial page.
  if (std::rename(temp_path.c_str(), path.c_str()) != 0) {
    const int error = errno;
    std::remove(temp_path.c_str());
    throw std::runtime_error(fmt::format("cannot write HTML report '{}': rename from '{}' failed ({})", path,
                                         temp_path, std::strerror(error)));
  }
}

}  // namespace memfit
