// Tests for the HTML report renderer: the stable DOM hooks the browser check
// relies on, escaping of document strings, graceful handling of missing
// fields, and atomic writing.
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "memfit/report/html_report.h"

// The build points this at tests/data; the default works when run from the repo root.
#ifndef MEMFIT_TEST_DATA_DIR
#define MEMFIT_TEST_DATA_DIR "tests/data"
#endif

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

json load_sample() {
  const std::string path = std::string(MEMFIT_TEST_DATA_DIR) + "/report_sample.json";
  std::ifstream file(path);
  if (!file) throw std::runtime_error("cannot open test data " + path);
  return json::parse(file);
}

std::string read_file(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The data-bytes attribute of #peak-value, or "" when missing.
std::string peak_data_bytes(const std::string& html) {
  std::smatch match;
  if (std::regex_search(html, match, std::regex(R"re(id="peak-value"[^>]*data-bytes="(-?\d+)")re"))) return match[1];
  return "";
}

// A unique scratch directory per test, removed afterwards.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / (std::string("memfit_html_") + info->name() + "_" +
                                         std::to_string(std::hash<std::string>{}(info->test_suite_name())));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

TEST(HtmlReport, SampleHasStableHooks) {
  const json doc = load_sample();
  const std::string html = memfit::render_html_report(doc);
  EXPECT_TRUE(contains(html, "<!DOCTYPE html>"));
  EXPECT_TRUE(contains(html, R"(id="timeline-chart")"));
  EXPECT_TRUE(contains(html, R"(id="blocks-chart")"));
  EXPECT_TRUE(contains(html, R"(id="plan-table")"));
  EXPECT_TRUE(contains(html, R"(id="steps-chart")"));
  EXPECT_TRUE(contains(html, R"(class="area")")) << "stacked areas are drawn as paths";
  EXPECT_TRUE(contains(html, R"(class="budget")")) << "budget line is drawn";
}

TEST(HtmlReport, PeakValueCarriesExactBytes) {
  const json doc = load_sample();
  const std::string html = memfit::render_html_report(doc);
  const std::string expected = std::to_string(doc["peak_bytes"].get<int64_t>());
  EXPECT_EQ(peak_data_bytes(html), expected);
  EXPECT_TRUE(contains(html, expected + " bytes"));
}

TEST(HtmlReport, LegendLabelsEveryCategory) {
  const std::string html = memfit::render_html_report(load_sample());
  const std::pair<const char*, const char*> expected[] = {{"weights", "Weights"},
                                                          {"gradients", "Gradients"},
                                                          {"optimizer_state", "Optimizer state"},
                                                          {"activations", "Activations"},
                                                          {"other", "Other"}};
  for (const auto& [key, label] : expected) {
    const std::regex legend_item(std::string(R"(<span class="legend-item" data-category=")") + key +
                                 R"("><span class="swatch"[^>]*></span>)" + label + "</span>");
    EXPECT_TRUE(std::regex_search(html, legend_item)) << "legend item for " << key;
  }
}

TEST(HtmlReport, EscapesDocumentStrings) {
  json doc = load_sample();
  doc["title"] = "<script>alert(1)</script> & co";
  doc["device"] = "\"cuda\" <0>";
  doc["categories"].push_back("<evil>");
  doc["blocks"][0]["name"] = "<img src=x>";
  doc["plan"]["rows"].push_back({"<b>label</b>", "<i>value</i>"});
  doc["phases"][0]["name"] = "<phase>";
  const std::string html = memfit::render_html_report(doc);

  EXPECT_FALSE(contains(html, "<script>alert"));
  EXPECT_TRUE(contains(html, "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co"));
  EXPECT_FALSE(contains(html, "<evil>"));
  EXPECT_FALSE(contains(html, "<img"));
  EXPECT_FALSE(contains(html, "<b>label"));
  EXPECT_FALSE(contains(html, "<i>value"));
  EXPECT_FALSE(contains(html, "<phase>"));
  EXPECT_TRUE(contains(html, "&quot;cuda&quot; &lt;0&gt;"));
  // Only the renderer's own two scripts: the hover data and the hover code.
  size_t script_tags = 0;
  for (size_t at = html.find("<script"); at != std::string::npos; at = html.find("<script", at + 1)) ++script_tags;
  EXPECT_EQ(script_tags, 2u);
}

TEST(HtmlReport, MinimalDocumentRenders) {
  const std::string html = memfit::render_html_report(json::object());
  EXPECT_TRUE(contains(html, R"(id="timeline-chart")"));
  EXPECT_EQ(peak_data_bytes(html), "0");
  EXPECT_TRUE(contains(html, "no timeline data"));
  // Optional sections are left out rather than drawn empty.
  EXPECT_FALSE(contains(html, R"(id="blocks-chart")"));
  EXPECT_FALSE(contains(html, R"(id="plan-table")"));
  EXPECT_FALSE(contains(html, R"(id="steps-chart")"));
  EXPECT_FALSE(contains(html, R"(class="budget")"));
}

TEST(HtmlReport, OptionalFieldsMissingOrNull) {
  json doc = load_sample();
  doc["budget_bytes"] = nullptr;
  doc.erase("blocks");
  doc.erase("plan");
  doc.erase("steps");
  doc.erase("at_peak");
  const std::string html = memfit::render_html_report(doc);
  EXPECT_EQ(peak_data_bytes(html), std::to_string(doc["peak_bytes"].get<int64_t>()));
  EXPECT_FALSE(contains(html, R"(class="budget")"));
  EXPECT_FALSE(contains(html, R"(id="blocks-chart")"));
  EXPECT_FALSE(contains(html, R"(id="steps-chart")"));
  // Without at_peak the breakdown comes from the highest timeline point, which is the peak here.
  const int64_t activations_at_peak = load_sample()["at_peak"]["activations"].get<int64_t>();
  EXPECT_TRUE(contains(html, std::to_string(activations_at_peak)));
}

TEST(HtmlReport, DownsamplingKeepsTheMaximumPoint) {
  json doc = {{"title", "long timeline"}};
  json timeline = json::array();
  const int spike_index = 3217;
  for (int i = 0; i < 20000; ++i) {
    const int64_t activations = i == spike_index ? 987654321 : 1000 * (i % 97);
    timeline.push_back({{"t_us", i}, {"weights", 5000}, {"activations", activations}});
  }
  doc["timeline"] = timeline;
  const std::string html = memfit::render_html_report(doc);
  // No peak_bytes given: the peak is the highest timeline total, kept exactly.
  EXPECT_EQ(peak_data_bytes(html), std::to_string(987654321 + 5000));
  EXPECT_TRUE(contains(html, "[3217,5000,0,0,987654321,0]")) << "spike row kept in the hover data";
  EXPECT_LT(html.size(), 1500000u) << "timeline was downsampled";
}

TEST(HtmlReport, DrawsTheReservedSeriesBesideAllocated) {
  json doc = {{"title", "reserved"}, {"categories", {"weights", "activations"}}};
  json timeline = json::array();
  for (int i = 0; i < 10; ++i) {
    timeline.push_back({{"t_us", i * 10}, {"weights", 1000}, {"activations", 100 * i}, {"cuda_reserved", 2097152}});
  }
  doc["timeline"] = timeline;
  doc["reserved_series"] = {{"key", "cuda_reserved"}, {"label", "CUDA reserved (predicted)"}, {"peak_bytes", 2097152}};
  const std::string html = memfit::render_html_report(doc);
  EXPECT_TRUE(contains(html, R"(class="reserved-line" data-series="cuda_reserved")"));
  EXPECT_TRUE(contains(html, R"(id="reserved-peak" class="muted" data-bytes="2097152")"));
  EXPECT_TRUE(contains(html, R"(data-series="cuda_reserved"><span class="swatch-line")")) << "legend entry";
  EXPECT_TRUE(contains(html, "[90,1000,900,2097152]")) << "reserved bytes in the hover data";
  EXPECT_TRUE(contains(html, ">2 MiB</text>")) << "the byte axis reaches the reserved line";
  // Without the series: no line, no legend entry, hover rows as before.
  doc.erase("reserved_series");
  const std::string plain = memfit::render_html_report(doc);
  EXPECT_FALSE(contains(plain, R"(class="reserved-line")"));
  EXPECT_TRUE(contains(plain, "[90,1000,900]"));
}

TEST(HtmlReport, RejectsNonObjectDocument) {
  EXPECT_THROW(memfit::render_html_report(json::array()), std::invalid_argument);
}

TEST(HtmlReport, OverBudgetIsReported) {
  json doc = load_sample();
  doc["budget_bytes"] = doc["peak_bytes"].get<int64_t>() - 1024 * 1024;
  const std::string html = memfit::render_html_report(doc);
  EXPECT_TRUE(contains(html, "Over the")) << "peak above budget is called out";
}

TEST(HtmlReport, WriteIsAtomicAndLeavesNoTempFile) {
  ScratchDir scratch;
  const fs::path path = scratch.path() / "report.html";
  const json doc = load_sample();
  { std::ofstream(path) << "old contents"; }  // an existing report is replaced
  memfit::write_html_report(path.string(), doc);
  EXPECT_EQ(read_file(path), memfit::render_html_report(doc));
  EXPECT_FALSE(fs::exists(path.string() + ".tmp"));
  size_t files = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(scratch.path())) ++files;
  EXPECT_EQ(files, 1u);
}

TEST(HtmlReport, WriteFailsClearlyForMissingDirectory) {
  ScratchDir scratch;
  const std::string path = (scratch.path() / "no_such_dir" / "report.html").string();
  try {
    memfit::write_html_report(path, load_sample());
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& error) {
    const std::string message = error.what();
    EXPECT_TRUE(contains(message, path)) << message;
    EXPECT_FALSE(contains(message, "\n")) << "one-line message";
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

}  // namespace
