// Renders a report document (JSON file) to an HTML page, for trying the
// renderer by hand and for the browser check:
//   render_sample tests/data/report_sample.json /tmp/report.html
#include <exception>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "memfit/report/html_report.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " REPORT.json OUT.html\n";
    return 2;
  }
  try {
    std::ifstream input(argv[1]);
    if (!input) {
      std::cerr << "render_sample: cannot open " << argv[1] << "\n";
      return 1;
    }
    const nlohmann::json doc = nlohmann::json::parse(input);
    memfit::write_html_report(argv[2], doc);
  } catch (const std::exception& error) {
    std::cerr << "render_sample: " << error.what() << "\n";
    return 1;
  }
  return 0;
}
