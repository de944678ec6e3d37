// Renders the memory report page. Everything is plain string building: the SVG charts are drawn
// here (the timeline in html_timeline.cpp) so the page needs no charting library and no network
// when viewed. Layout constants live next to the chart that uses them.
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

#include "html_common.h"

namespace memfit {
namespace html {
namespace {

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
}  // namespace html

std::string render_html_report(const nlohmann::json& doc) {
  using namespace html;
  if (!doc.is_object()) throw std::invalid_argument("memfit report: document must be a JSON object");

  const bool has_budget = has_number(doc, "budget_bytes") && as_bytes(doc["budget_bytes"]) > 0;
  const int64_t budget_bytes = has_budget ? as_bytes(doc["budget_bytes"]) : 0;
  const std::string title = field_text(doc, "title", "memfit memory report");
  const std::string device = field_text(doc, "device");
  const TimelineSection timeline = render_timeline_section(doc, has_budget, budget_bytes);

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
  subtitle += fmt::format(" · peak {}", format_bytes(timeline.peak_bytes));
  if (has_budget) subtitle += fmt::format(" · budget {}", format_bytes(budget_bytes));
  if (timeline.events > 0) subtitle += fmt::format(" · {} allocator events", timeline.events);
  append(page, "<p class=\"subtitle\">{}</p>\n", escape_html(subtitle));

  page += timeline.html;

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