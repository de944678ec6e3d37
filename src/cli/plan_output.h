// plan_output.h — a plan as text, the same for `memfit plan` and `memfit train`.
#pragma once

#include <string>
#include <vector>

#include "flags.h"

namespace memfit::cli {

// "   33.1 MiB      34655745 B": a size both ways, aligned in tables.
std::string bytes_cell(int64_t bytes);

// The plan's table: configuration, predicted (and, verified, measured) peak and step time,
// the plain step and the floor, `planning` (how long planning took and where the measurements
// came from), then the plan's notes.
void print_plan(const Plan& plan, const std::vector<std::string>& block_names, const Verification* verified,
                const std::string& planning);

}  // namespace memfit::cli
