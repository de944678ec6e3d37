// size.h — byte sizes as people write them, and back.
#pragma once

#include <cstdint>
#include <string>

namespace memfit {

// Parses "512MiB", "1.5GiB", "800MB", "1e9", "4096" (bytes). Binary units: KiB MiB GiB TiB;
// decimal: KB MB GB TB (also k/K, M, G, T). Throws std::invalid_argument with one line naming
// the text and what is accepted.
int64_t parse_size(const std::string& text);

// "1.50 GiB", "12.3 MiB", "512 B": binary units, three significant digits.
std::string format_bytes(int64_t bytes);

}  // namespace memfit
