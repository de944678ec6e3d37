// size.h — byte sizes and step lists as people write them, and back.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memfit {

// Parses "512MiB", "1.5GiB", "800MB", "1e9", "4096" (bytes). Binary units: KiB MiB GiB TiB;
// decimal: KB MB GB TB (also k/K, M, G, T). Throws std::invalid_argument with one line naming
// the text and what is accepted.
int64_t parse_size(const std::string& text);

// "1.50 GiB", "12.3 MiB", "512 B": binary units, three significant digits.
std::string format_bytes(int64_t bytes);

// Parses "3,7,12": step numbers from 1 to `last`, comma-separated. Throws
// std::invalid_argument with one line naming the text and what is accepted.
std::vector<int64_t> parse_step_list(const std::string& text, int64_t last);

}  // namespace memfit
