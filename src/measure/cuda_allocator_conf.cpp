#include "memfit/measure/cuda_allocator_conf.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "memfit/errors.h"

namespace memfit {
namespace {

using namespace cuda_sizes;

struct KeyValue {
  std::string key, value;
};

std::string accepted_options(CudaAllocatorRules rules) {
  if (rules == CudaAllocatorRules::k1_13) {
    return "max_split_size_mb:N (N > 20), roundup_power2_divisions:N (a power of 2), roundup_bypass_threshold_mb:N, "
           "garbage_collection_threshold:X (0 < X < 1), backend:native";
  }
  return "max_split_size_mb:N (N >= 20), max_non_split_rounding_mb:N (N >= 20), roundup_power2_divisions:N or "
         "[MB:N,...,>:N] (powers of 2), garbage_collection_threshold:X (0 < X < 1), expandable_segments:True|False, "
         "backend:native, release_lock_on_cudamalloc, pinned_* options";
}

// One line: the whole setting, what is wrong with it, and what this version accepts.
[[noreturn]] void reject(const std::string& text, CudaAllocatorRules rules, const std::string& why) {
  throw OptionError("PYTORCH_CUDA_ALLOC_CONF", "'" + text + "'",
                    why + "; LibTorch " + cuda_allocator_rules_name(rules) + " accepts " + accepted_options(rules));
}

std::string without_spaces(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c != ' ' && c != '\t' && c != '\n') out += c;
  }
  return out;
}

// Items separated by commas outside brackets ("a:1,b:[1:2,>:4]" -> "a:1", "b:[1:2,>:4]").
std::vector<std::string> split_items(const std::string& text, CudaAllocatorRules rules, const std::string& all) {
  std::vector<std::string> items;
  std::string item;
  int depth = 0;
  for (char c : text) {
    depth += c == '[' ? 1 : c == ']' ? -1 : 0;
    if (depth < 0 || depth > 1) reject(all, rules, "unbalanced brackets");
    if (c == ',' && depth == 0) {
      if (!item.empty()) items.push_back(item);
      item.clear();
    } else {
      item += c;
    }
  }
  if (depth != 0) reject(all, rules, "unbalanced brackets");
  if (!item.empty()) items.push_back(item);
  return items;
}

KeyValue split_key_value(const std::string& item, CudaAllocatorRules rules, const std::string& all) {
  const size_t colon = item.find(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == item.size()) {
    reject(all, rules, "'" + item + "' is not key:value");
  }
  return {item.substr(0, colon), item.substr(colon + 1)};
}

bool parse_count(const std::string& text, int64_t* out) {
  if (text.empty() || text.size() > 15 || !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
  *out = std::strtoll(text.c_str(), nullptr, 10);
  return true;
}

bool is_power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

// 2.x's list form: the first entry also covers the intervals below it; ">" covers the rest,
// from the last entry named (whose own value it replaces, as 2.x does).
void parse_divisions_list(const std::string& list, CudaAllocatorConf& conf, CudaAllocatorRules rules,
                          const std::string& all) {
  auto& divisions = conf.roundup_power2_divisions;
  size_t last_index = 0;
  bool first = true;
  for (const std::string& entry : split_items(list, rules, all)) {
    const KeyValue kv = split_key_value(entry, rules, all);
    int64_t n = 0, mb = 0;
    if (!parse_count(kv.value, &n) || (n != 0 && !is_power_of_two(n))) {
      reject(all, rules, "roundup_power2_divisions entry '" + entry + "': divisions must be 0 or a power of 2");
    }
    if (kv.key == ">") {
      std::fill(divisions.begin() + static_cast<long>(last_index), divisions.end(), n);
      continue;
    }
    if (!parse_count(kv.key, &mb) || !is_power_of_two(mb)) {
      reject(all, rules, "roundup_power2_divisions entry '" + entry + "': the size must be a power of 2 (MiB) or '>'");
    }
    const size_t index = std::min<size_t>(static_cast<size_t>(log2_floor(mb)), kRoundupIntervals - 1);
    if (first) std::fill(divisions.begin(), divisions.begin() + static_cast<long>(index), n);
    first = false;
    divisions[index] = n;
    last_index = index;
  }
}

void parse_divisions(const std::string& value, CudaAllocatorConf& conf, CudaAllocatorRules rules,
                     const std::string& all) {
  if (value.front() == '[') {
    if (value.back() != ']') reject(all, rules, "roundup_power2_divisions:" + value + " does not end with ']'");
    if (rules == CudaAllocatorRules::k1_13) reject(all, rules, "roundup_power2_divisions takes one number in 1.13");
    parse_divisions_list(value.substr(1, value.size() - 2), conf, rules, all);
    return;
  }
  int64_t n = 0;
  if (!parse_count(value, &n) || !is_power_of_two(n)) {
    reject(all, rules, "roundup_power2_divisions:" + value + " is not a power of 2");
  }
  conf.roundup_power2_divisions.fill(n);
}

int64_t parse_mib(const KeyValue& kv, int64_t above, bool inclusive, CudaAllocatorRules rules, const std::string& all) {
  int64_t mb = 0;
  if (!parse_count(kv.value, &mb) || (inclusive ? mb < above : mb <= above)) {
    reject(all, rules, kv.key + ":" + kv.value + " must be a whole number of MiB " + (inclusive ? ">= " : "> ") +
                           std::to_string(above));
  }
  return mb * kMiB;
}

double parse_gc_threshold(const std::string& value, CudaAllocatorRules rules, const std::string& all) {
  char* end = nullptr;
  const double x = std::strtod(value.c_str(), &end);
  if (end != value.c_str() + value.size() || !(x > 0 && x < 1)) {
    reject(all, rules, "garbage_collection_threshold:" + value + " must be a number between 0 and 1 (exclusive)");
  }
  return x;
}

bool parse_true_false(const KeyValue& kv, CudaAllocatorRules rules, const std::string& all) {
  if (kv.value != "True" && kv.value != "False") reject(all, rules, kv.key + ":" + kv.value + " must be True or False");
  return kv.value == "True";
}

bool ignored_option(const std::string& key) {
  return key == "release_lock_on_cudamalloc" || key == "pinned_use_cuda_host_register" ||
         key == "pinned_num_register_threads" || key == "pinned_use_background_threads" ||
         key == "pinned_reserve_segment_size_mb" || key == "graph_capture_record_stream_reuse";
}

// Options both versions read.
bool apply_common(const KeyValue& kv, CudaAllocatorConf& conf, CudaAllocatorRules rules, const std::string& all) {
  const bool v2 = rules == CudaAllocatorRules::k2;
  if (kv.key == "max_split_size_mb") {
    conf.max_split_size = parse_mib(kv, kLargeBuffer / kMiB, /*inclusive=*/v2, rules, all);
  } else if (kv.key == "roundup_power2_divisions") {
    parse_divisions(kv.value, conf, rules, all);
  } else if (kv.key == "garbage_collection_threshold") {
    conf.garbage_collection_threshold = parse_gc_threshold(kv.value, rules, all);
  } else if (kv.key == "backend") {
    if (kv.value != "native") reject(all, rules, "backend:" + kv.value + ": memfit models the native caching allocator only");
  } else {
    return false;
  }
  return true;
}

void apply_option(const KeyValue& kv, CudaAllocatorConf& conf, CudaAllocatorRules rules, const std::string& all) {
  if (apply_common(kv, conf, rules, all)) return;
  if (rules == CudaAllocatorRules::k1_13 && kv.key == "roundup_bypass_threshold_mb") {
    int64_t mb = 0;
    if (!parse_count(kv.value, &mb)) reject(all, rules, kv.key + ":" + kv.value + " must be a whole number of MiB");
    conf.roundup_bypass_threshold = mb * kMiB;
  } else if (rules == CudaAllocatorRules::k2 && kv.key == "expandable_segments") {
    conf.expandable_segments = parse_true_false(kv, rules, all);
  } else if (rules == CudaAllocatorRules::k2 && kv.key == "max_non_split_rounding_mb") {
    conf.max_non_split_rounding = parse_mib(kv, kLargeBuffer / kMiB, /*inclusive=*/true, rules, all);
  } else if (!(rules == CudaAllocatorRules::k2 && ignored_option(kv.key))) {
    reject(all, rules, "unknown option '" + kv.key + "'");
  }
}

}  // namespace

const char* cuda_allocator_rules_name(CudaAllocatorRules rules) {
  return rules == CudaAllocatorRules::k1_13 ? "1.13" : "2.x";
}

CudaAllocatorRules cuda_allocator_rules_from_name(const std::string& name) {
  if (name == "1.13") return CudaAllocatorRules::k1_13;
  if (name == "2.x") return CudaAllocatorRules::k2;
  throw OptionError("cuda_allocator_rules", "'" + name + "'", "expected 1.13 or 2.x");
}

CudaAllocatorConf parse_cuda_alloc_conf(const std::string& text, CudaAllocatorRules rules) {
  CudaAllocatorConf conf;
  conf.text = text;
  for (const std::string& item : split_items(without_spaces(text), rules, text)) {
    apply_option(split_key_value(item, rules, text), conf, rules, text);
  }
  return conf;
}

CudaAllocatorConf cuda_alloc_conf_from_env(CudaAllocatorRules rules) {
  const char* text = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  return parse_cuda_alloc_conf(text == nullptr ? "" : text, rules);
}

}  // namespace memfit
