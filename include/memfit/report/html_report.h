// Self-contained HTML memory report: one page, inline CSS and SVG, no network
// access needed to view it. The input is a JSON document (schema below); the
// renderer does not depend on torch so it can be tested and reused on its own.
//
// Document fields (optional ones may be absent or null):
//   title, device                      strings
//   budget_bytes        (optional)     drawn as a dashed line
//   peak_bytes, peak_time_us           exact peak of the step and when it happened
//   categories                         keys, e.g. weights, gradients, optimizer_state,
//                                      activations, other
//   at_peak                            {category: bytes} at the peak
//   timeline                           [{t_us, phase, <category>: bytes, ..., <reserved key>?}]
//   reserved_series     (optional)     {key, label, peak_bytes}: a line over the areas, e.g.
//                                      what a CUDA caching allocator would reserve
//   phases                             [{name, start_us, end_us, peak_bytes}]
//   blocks              (optional)     [{name, activation_bytes, recomputed}]
//   plan                (optional)     {rows: [[label, value], ...]}
//   steps               (optional)     [{step, loss, live_bytes, peak_bytes, eval_loss?}]
//
// Stable element ids for tests: timeline-chart, peak-value (data-bytes),
// reserved-peak (data-bytes), blocks-chart, plan-table, steps-chart; legend
// entries have class "legend-item" and data-category; the reserved line is a
// path of class "reserved-line".
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace memfit {

// Returns the complete HTML page. Throws std::invalid_argument if `doc` is not
// a JSON object; missing optional fields are skipped.
std::string render_html_report(const nlohmann::json& doc);

// Renders and writes the page atomically: writes `path + ".tmp"`, then renames
// it over `path`. Throws std::runtime_error naming the path on failure and
// leaves no temporary file behind.
void write_html_report(const std::string& path, const nlohmann::json& doc);

}  // namespace memfit
