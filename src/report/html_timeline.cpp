// The report's first section: live bytes by category over the step (a stacked area chart with
// the phases behind it), the peak and what it is made of, and the time and peak of each phase.
#include <algorithm>
#include <cmath>
#include <optional>

#include "html_common.h"

namespace memfit::html {
namespace {

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


}  // namespace

TimelineSection render_timeline_section(const json& doc, bool has_budget, int64_t budget_bytes) {
  const std::vector<Category> categories = read_categories(doc);
  const ReservedSeries reserved = read_reserved_series(doc);
  const std::vector<TimelinePoint> timeline = read_timeline(doc, categories, reserved);
  const std::vector<Phase> phases = read_phases(doc);
  const PeakInfo peak = read_peak(doc, categories, timeline);
  TimelineSection s;
  s.peak_bytes = peak.bytes;
  s.events = timeline.size();
  s.html = R"(<section class="card"><h2>Live bytes by category</h2><div class="timeline-row"><div class="chart-wrap">)";
  s.html += render_category_legend(categories);
  s.html += render_phase_legend(phases, has_budget, reserved);
  s.html += render_timeline_svg(categories, timeline, phases, peak, has_budget, budget_bytes, reserved);
  s.html += R"(<div id="timeline-tooltip" class="tooltip" style="display:none"></div></div>)";
  s.html += render_peak_panel(categories, phases, peak, has_budget, budget_bytes, reserved);
  s.html += "</div>";
  s.html += render_phase_table(phases);
  s.html += "</section>\n";
  return s;
}

}  // namespace memfit::html
