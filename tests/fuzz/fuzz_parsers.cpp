// fuzz_parsers.cpp — seeded random fuzzing of everything memfit reads from people or disk:
// sizes, step lists and checkpoint specs (text), the JSON forms of OptimizerSpec, StepConfig and
// Plan, and saved state (a manifest and a zip archive).
//
// Property everywhere: a reader either returns a value that holds its documented constraints,
// or throws the exception its header promises (std::invalid_argument for text, std::exception
// for JSON, a one-line std::runtime_error for saved state); nothing else, no crash, no hang.
//
// Bounded for CI (a few seconds in all). Environment:
//   MEMFIT_FUZZ_ITERATIONS=N  iterations per target (default: each target's own, 2000 to 20000);
//                             saved state makes N/100 variants of each random kind (at least 40)
//   MEMFIT_FUZZ_SEED=S        one seed for every target instead of each target's fixed one
// A failure prints the seed, the iteration and the input.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "memfit/memfit.h"

namespace memfit {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// --- shared ---------------------------------------------------------------------------------

int64_t env_int(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  return (end != nullptr && *end == '\0' && value > 0) ? value : fallback;
}

int64_t iterations(int64_t fallback) { return env_int("MEMFIT_FUZZ_ITERATIONS", fallback); }

uint64_t seed_of(uint64_t fixed) { return static_cast<uint64_t>(env_int("MEMFIT_FUZZ_SEED", static_cast<int64_t>(fixed))); }

std::string seed_line(uint64_t seed) {
  return "seed " + std::to_string(seed) + " (rerun: MEMFIT_FUZZ_SEED=" + std::to_string(seed) +
         " ./memfit_tests --gtest_filter='" + ::testing::UnitTest::GetInstance()->current_test_info()->test_suite_name() +
         "." + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "')";
}

// Non-printing characters shown as \xNN, so a failing input reads on one line.
std::string shown(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

bool one_line(const std::string& text) { return !text.empty() && text.find('\n') == std::string::npos; }

// Stops a target after this many failures: the first ones say it all.
constexpr int kMaxFailures = 8;

// Random strings from an alphabet of the pieces people type: digits, units, signs, commas,
// colons, letters, words, huge numbers, and nothing (empty items between commas).
class TextGenerator {
 public:
  explicit TextGenerator(uint64_t seed) : rng_(seed) {}

  std::string digits(int n) {
    std::string s;
    for (int i = 0; i < n; ++i) s += static_cast<char>('0' + pick(10));
    return s;
  }

  std::string token() {
    static const char* const pieces[] = {
        "0", "1", "2", "3", "5", "7", "9", "10", "16", "42", "100", "512", "1024", "4096", "999999",
        ".", ".5", "1.5", "0.1", "e", "E", "e9", "e-3", "e308", "e400", "+", "-", "--", ",", ",,", ":",
        " ", "\t", "B", "b", "KiB", "MiB", "GiB", "TiB", "PiB", "KB", "kB", "MB", "GB", "TB", "k", "K",
        "M", "G", "T", "iB", "x", "a", "Z", "inf", "nan", "NaN", "infinity", "0x", "0x1p3", "every:",
        "all", "none", "auto", "every", ";", "/", "%", "\xc3\xa9", "2147483647", "2147483648", "-2147483649",
        "4294967296", "9223372036854775807", "9223372036854775808", "18446744073709551616", "1e18", "9e18",
        "1e19"};
    switch (pick(10)) {
      case 0: return digits(20 + pick(30));                    // past 64 bits
      case 1: return pick(4) == 0 ? digits(310 + pick(100)) : digits(1 + pick(19));  // past a double, or any width
      case 2: return "";
      default: return pieces[pick(std::size(pieces))];
    }
  }

  std::string text() {
    std::string s;
    const int n = pick(7);
    for (int i = 0; i < n; ++i) s += token();
    return s;
  }

  // Comma-separated items, some empty, some numbers near `last`.
  std::string list(int64_t last) {
    std::string s;
    const int n = 1 + pick(5);
    for (int i = 0; i < n; ++i) {
      if (i > 0) s += pick(8) == 0 ? ",," : ",";
      switch (pick(6)) {
        case 0: s += text(); break;
        case 1: s += ""; break;
        default: s += std::to_string(static_cast<int64_t>(pick(static_cast<uint64_t>(std::min<int64_t>(last, 1000)) + 3)) - 1);
      }
    }
    if (pick(10) == 0) s = (pick(2) ? "," : " ") + s;
    if (pick(10) == 0) s += pick(2) ? "," : " ";
    return s;
  }

  uint64_t pick(uint64_t n) { return n == 0 ? 0 : std::uniform_int_distribution<uint64_t>(0, n - 1)(rng_); }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

// Runs `call`; the exception it threw: "" (none), "invalid_argument", "runtime_error",
// "exception" (another std::exception) or "non-std" — with its message in `what`.
std::string thrown_by(const std::function<void()>& call, std::string* what) {
  try {
    call();
    return "";
  } catch (const std::invalid_argument& e) {
    *what = e.what();
    return "invalid_argument";
  } catch (const std::runtime_error& e) {
    *what = e.what();
    return "runtime_error";
  } catch (const std::exception& e) {
    *what = e.what();
    return "exception";
  } catch (...) {
    *what = "(not a std::exception)";
    return "non-std";
  }
}

// --- text: sizes, step lists, checkpoint specs -------------------------------------------

TEST(FuzzParsers, ParseSize) {
  const uint64_t seed = seed_of(0x5173a11);
  TextGenerator gen(seed);
  const int64_t n = iterations(20000);
  int failures = 0, accepted = 0;
  for (int64_t i = 0; i < n && failures < kMaxFailures; ++i) {
    std::string text;
    switch (gen.pick(4)) {
      case 0: text = gen.digits(1 + static_cast<int>(gen.pick(40))); break;  // plain bytes, any width
      case 1: text = gen.token() + gen.token(); break;
      default: text = gen.text();
    }
    int64_t value = -1;
    std::string what;
    const std::string kind = thrown_by([&] { value = parse_size(text); }, &what);
    const auto fail = [&](const std::string& why) {
      ++failures;
      ADD_FAILURE() << seed_line(seed) << " iteration " << i << ": parse_size('" << shown(text) << "') " << why;
    };
    if (kind.empty()) {
      ++accepted;
      // A size: at least one byte (the parser refuses less), within int64.
      if (value < 1) fail("returned " + std::to_string(value) + ", not a size >= 1");
      // Plain bytes that a double holds exactly are read exactly.
      if (!text.empty() && text.size() <= 15 && text.find_first_not_of("0123456789") == std::string::npos &&
          value != std::stoll(text)) {
        fail("returned " + std::to_string(value) + " for plain bytes");
      }
    } else if (kind != "invalid_argument") {
      fail("threw " + kind + " (" + shown(what) + "), expected std::invalid_argument");
    }
  }
  RecordProperty("iterations", static_cast<int>(n));
  RecordProperty("accepted", accepted);
  EXPECT_GT(accepted, 0) << "the generator never made a valid size: it tests nothing";
}

TEST(FuzzParsers, ParseStepList) {
  const uint64_t seed = seed_of(0x57e9115);
  TextGenerator gen(seed);
  const int64_t n = iterations(20000);
  const int64_t lasts[] = {1, 3, 10, 1000, 999999, std::numeric_limits<int64_t>::max()};
  int failures = 0, accepted = 0;
  for (int64_t i = 0; i < n && failures < kMaxFailures; ++i) {
    const int64_t last = lasts[gen.pick(std::size(lasts))];
    const std::string text = gen.pick(3) == 0 ? gen.text() : gen.list(last);
    std::vector<int64_t> steps;
    std::string what;
    const std::string kind = thrown_by([&] { steps = parse_step_list(text, last); }, &what);
    const auto fail = [&](const std::string& why) {
      ++failures;
      ADD_FAILURE() << seed_line(seed) << " iteration " << i << ": parse_step_list('" << shown(text) << "', " << last
                    << ") " << why;
    };
    if (kind.empty()) {
      ++accepted;
      if (steps.empty()) fail("returned no steps");
      std::string joined, written;
      for (int64_t s : steps) {
        if (s < 1 || s > last) fail("returned step " + std::to_string(s) + ", outside 1.." + std::to_string(last));
        joined += (joined.empty() ? "" : ",") + std::to_string(s);
      }
      // What was accepted is exactly what was written (leading zeros aside).
      std::stringstream items(text);
      for (std::string item; std::getline(items, item, ',');) {
        item.erase(0, std::min(item.find_first_not_of('0'), item.size()));
        written += (written.empty() ? "" : ",") + item;
      }
      if (joined != written) fail("returned " + joined + ", not the steps written");
    } else if (kind != "invalid_argument") {
      fail("threw " + kind + " (" + shown(what) + "), expected std::invalid_argument");
    }
  }
  RecordProperty("iterations", static_cast<int>(n));
  RecordProperty("accepted", accepted);
  EXPECT_GT(accepted, 0);
}

// Segments [first, last]: sorted, disjoint, inside 0..blocks-1.
std::string segment_problem(const CheckpointPlan& plan, int blocks) {
  int next = 0;
  for (const auto& [first, last] : plan.segments) {
    if (first < next || last < first || last >= blocks) {
      return "segment [" + std::to_string(first) + ", " + std::to_string(last) + "] is not sorted, disjoint and inside 0.." +
             std::to_string(blocks - 1);
    }
    next = last + 1;
  }
  return "";
}

TEST(FuzzParsers, CheckpointPlanParse) {
  const uint64_t seed = seed_of(0xc4ec4);
  TextGenerator gen(seed);
  const int64_t n = iterations(20000);
  const int block_counts[] = {0, 1, 2, 4, 14, 100};
  int failures = 0, accepted = 0;
  for (int64_t i = 0; i < n && failures < kMaxFailures; ++i) {
    const int blocks = block_counts[gen.pick(std::size(block_counts))];
    std::string spec;
    switch (gen.pick(5)) {
      case 0: spec = gen.text(); break;
      case 1: spec = "every:" + (gen.pick(2) ? gen.token() : std::to_string(gen.pick(2 * blocks + 3)) + gen.token()); break;
      default: spec = gen.list(blocks);
    }
    CheckpointPlan plan;
    std::string what;
    const std::string kind = thrown_by([&] { plan = CheckpointPlan::parse(spec, blocks); }, &what);
    const auto fail = [&](const std::string& why) {
      ++failures;
      ADD_FAILURE() << seed_line(seed) << " iteration " << i << ": CheckpointPlan::parse('" << shown(spec) << "', "
                    << blocks << ") " << why;
    };
    if (kind.empty()) {
      ++accepted;
      if (const std::string problem = segment_problem(plan, blocks); !problem.empty()) fail(problem);
      (void)plan.describe();
    } else if (kind != "invalid_argument") {
      fail("threw " + kind + " (" + shown(what) + "), expected std::invalid_argument");
    }
  }
  RecordProperty("iterations", static_cast<int>(n));
  RecordProperty("accepted", accepted);
  EXPECT_GT(accepted, 0);
}

// every:K on chains of up to INT_MAX blocks with K near it: segments inside the chain, no
// overflow. Runs in a child process held to 20 seconds and (unsanitized) 2 GiB of heap: an
// overflowing loop there appends segments without end.
[[noreturn]] void huge_chains_child(uint64_t seed, const std::string& where) {
  ::alarm(20);
#ifndef __SANITIZE_ADDRESS__
  const rlimit heap{2ull << 30, 2ull << 30};
  ::setrlimit(RLIMIT_DATA, &heap);
#endif
  TextGenerator gen(seed);
  const int large_blocks[] = {INT_MAX, INT_MAX - 1, (1 << 30) + 7};
  for (int i = 0; i < 200; ++i) {
    const int blocks = large_blocks[gen.pick(std::size(large_blocks))];
    const int k = (1 << 29) + static_cast<int>(gen.pick(static_cast<uint64_t>(INT_MAX - (1 << 29)) + 1));
    const std::string spec = "every:" + std::to_string(k);
    CheckpointPlan plan;
    std::string what;
    const std::string kind = thrown_by([&] { plan = CheckpointPlan::parse(spec, blocks); }, &what);
    std::string problem = kind.empty() ? segment_problem(plan, blocks) : "";
    if (!kind.empty() && kind != "invalid_argument") problem = "threw " + kind + " (" + shown(what) + ")";
    if (!problem.empty()) {
      std::fprintf(stderr, "%s case %d: CheckpointPlan::parse('%s', %d) %s\n", where.c_str(), i, spec.c_str(), blocks,
                   problem.c_str());
      std::fflush(stderr);
      std::_Exit(1);
    }
  }
  std::_Exit(0);
}

TEST(FuzzParsers, CheckpointEveryOnHugeChains) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const uint64_t seed = seed_of(0xc4ec5);
  EXPECT_EXIT(huge_chains_child(seed, seed_line(seed)), ::testing::ExitedWithCode(0), "");
}

// --- JSON: OptimizerSpec, StepConfig, Plan -------------------------------------------------

constexpr int kBlocks = 6;

OptimizerSpec random_spec(TextGenerator& gen) {
  OptimizerSpec s;
  s.family = static_cast<OptimizerFamily>(gen.pick(5));
  s.lr = std::ldexp(1.0, -static_cast<int>(gen.pick(20)));
  const bool momentum = s.family == OptimizerFamily::kSGD || s.family == OptimizerFamily::kRMSprop;
  if (momentum && gen.pick(2)) s.momentum = 0.5 + 0.01 * static_cast<double>(gen.pick(49));
  if (gen.pick(2)) s.weight_decay = 0.001 * static_cast<double>(gen.pick(100));
  if ((s.family == OptimizerFamily::kAdam || s.family == OptimizerFamily::kAdamW) && gen.pick(2)) {
    s.beta1 = 0.01 * static_cast<double>(gen.pick(100));
    s.beta2 = 0.001 * static_cast<double>(gen.pick(1000));
  }
  // State precision: 8bit only where it applies (Adam, AdamW), auto anywhere.
  const bool adam_like = s.family == OptimizerFamily::kAdam || s.family == OptimizerFamily::kAdamW;
  s.state = static_cast<StatePrecision>(gen.pick(3));
  if (s.state == StatePrecision::k8Bit && !adam_like) s.state = StatePrecision::kFP32;
  return s;
}

StepConfig random_config(TextGenerator& gen) {
  StepConfig c;
  c.batch = 1 + static_cast<int64_t>(gen.pick(64));
  c.micro_batch = static_cast<int64_t>(gen.pick(static_cast<uint64_t>(c.batch) + 1));
  c.precision = gen.pick(2) ? Precision::kFP32 : Precision::kBF16;
  switch (gen.pick(3)) {
    case 0: c.checkpoint = CheckpointPlan::none(); break;
    case 1: c.checkpoint = CheckpointPlan::every(1 + static_cast<int>(gen.pick(kBlocks)), kBlocks); break;
    default: {
      std::vector<int> blocks;
      for (int b = 0; b < kBlocks; ++b) {
        if (gen.pick(2)) blocks.push_back(b);
      }
      c.checkpoint = CheckpointPlan::of_blocks(blocks, kBlocks);
    }
  }
  c.set_to_none = gen.pick(2) != 0;
  c.optimizer = random_spec(gen);
  return c;
}

Plan random_plan(TextGenerator& gen) {
  Plan p;
  p.feasible = gen.pick(4) != 0;
  p.budget_bytes = 1 + static_cast<int64_t>(gen.pick(1ull << 40));
  p.floor_bytes = static_cast<int64_t>(gen.pick(static_cast<uint64_t>(p.budget_bytes)));
  p.config = random_config(gen);
  p.checkpoint_pinned = gen.pick(2) != 0;
  p.predicted_peak = static_cast<int64_t>(gen.pick(static_cast<uint64_t>(p.budget_bytes)));
  p.predicted_seconds = 0.001 * static_cast<double>(gen.pick(10000));
  p.baseline_precision = Precision::kFP32;
  p.plain_predicted_peak = static_cast<int64_t>(gen.pick(1ull << 41));
  p.plain_predicted_seconds = 0.001 * static_cast<double>(gen.pick(10000));
  p.notes = {"fp32 chosen", "micro-batch " + std::to_string(p.config.micro_batch_size())};
  return p;
}

// A hostile JSON value: wrong types, NaN, infinities, huge, negative, fractional, empty.
json hostile_value(TextGenerator& gen) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  switch (gen.pick(40)) {
    case 0: return nullptr;
    case 1: return true;
    case 2: return false;
    case 3: return 0;
    case 4: return -1;
    case 5: return 1;
    case 6: return -0.0;
    case 7: return 0.5;
    case 8: return 2.7;
    case 9: return nan;
    case 10: return inf;
    case 11: return -inf;
    case 12: return 1e300;
    case 13: return -1e300;
    case 14: return 4.9e-324;
    case 15: return std::numeric_limits<int64_t>::max();
    case 16: return std::numeric_limits<int64_t>::min();
    case 17: return std::numeric_limits<uint64_t>::max();
    case 18: return static_cast<uint64_t>(1) << 63;
    case 19: return static_cast<int64_t>(1) << 31;
    case 20: return static_cast<int64_t>(1) << 32;
    case 21: return -(static_cast<int64_t>(1) << 31) - 1;
    case 22: return "";
    case 23: return "abc";
    case 24: return "1";
    case 25: return "cpu";
    case 26: return "cuda";
    case 27: return "cuda:99999999999";
    case 28: return gen.pick(2) ? "cuda:-1" : "meta";
    case 29: return gen.pick(2) ? "fp16" : "bf16";
    case 30: return gen.pick(2) ? "sgd" : "lamb";
    case 31: return json::array();
    case 32: return json::object();
    case 33: return json::array({1, 2});
    case 34: return json::parse("[[0,0]]");
    case 35: return json::parse(gen.pick(2) ? "[[1,0]]" : "[[-1,0]]");
    case 36: return json::parse(gen.pick(2) ? "[[0,1],[1,2]]" : "[[3,3],[1,1]]");
    case 37: return json::parse(gen.pick(2) ? "[[0,5,9]]" : "[[4294967296,4294967296]]");
    case 38: return json::parse(R"({"a": 1})");
    default: return gen.text();
  }
}

// A value as the log shows it: dump() writes NaN and the infinities as null.
std::string described(const json& value) {
  if (value.is_number_float() && !std::isfinite(value.get<double>())) {
    const double v = value.get<double>();
    return std::isnan(v) ? "NaN" : (v > 0 ? "inf" : "-inf");
  }
  return value.dump();
}

// Every location in a document (JSON pointers), the root included.
void locations(const json& j, const json::json_pointer& at, std::vector<json::json_pointer>& out) {
  out.push_back(at);
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) locations(it.value(), at / it.key(), out);
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) locations(j[i], at / i, out);
  }
}

// One to three mutations: a key or element deleted, a value replaced by a hostile one,
// wrapped in an array, an element added, the document itself replaced.
json mutate(json doc, TextGenerator& gen, std::string* log) {
  const int count = 1 + static_cast<int>(gen.pick(3));
  for (int m = 0; m < count; ++m) {
    std::vector<json::json_pointer> where;
    locations(doc, json::json_pointer(), where);
    const json::json_pointer at = where[gen.pick(where.size())];
    const std::string path = at.to_string().empty() ? "(root)" : at.to_string();
    switch (gen.pick(5)) {
      case 0:
        if (!at.empty()) {
          json& parent = doc[at.parent_pointer()];
          if (parent.is_object()) parent.erase(at.back());
          else if (parent.is_array()) parent.erase(parent.begin() + static_cast<std::ptrdiff_t>(std::stoul(at.back())));
          *log += " delete " + path + ";";
          break;
        }
        [[fallthrough]];
      case 1:
      case 2: {
        json value = hostile_value(gen);
        *log += " " + path + " = " + described(value) + ";";
        doc[at] = std::move(value);
        break;
      }
      case 3:
        doc[at] = json::array({doc[at]});
        *log += " wrap " + path + ";";
        break;
      default:
        if (doc[at].is_array()) {
          doc[at].push_back(hostile_value(gen));
          *log += " append to " + path + ";";
        } else if (doc[at].is_object()) {
          doc[at]["zz_unknown"] = hostile_value(gen);
          *log += " add key to " + path + ";";
        } else {
          doc[at] = hostile_value(gen);
          *log += " " + path + " replaced;";
        }
    }
  }
  // Half the time through text, as it travels (NaN and infinities become null there).
  if (gen.pick(2)) doc = json::parse(doc.dump());
  return doc;
}

// The shared loop: writer -> mutate -> reader; the reader throws a std::exception or returns
// a value whose JSON form reads back and passes `check`.
template <class Value>
void fuzz_json_reader(const char* name, uint64_t seed, int64_t n, const std::function<json(TextGenerator&)>& valid,
                      const std::function<Value(const json&)>& read, const std::function<json(const Value&)>& write,
                      const std::function<void(const Value&)>& check) {
  TextGenerator gen(seed);
  int failures = 0, accepted = 0, refused = 0;
  for (int64_t i = 0; i < n && failures < kMaxFailures; ++i) {
    const json original = valid(gen);
    if (i == 0) {
      std::string what;
      const std::string kind = thrown_by([&] { (void)read(original); }, &what);
      ASSERT_EQ(kind, "") << name << " refuses its own writer's JSON: " << what << "\n" << original.dump();
    }
    std::string log;
    const json doc = mutate(original, gen, &log);
    Value value;
    std::string what;
    const std::string kind = thrown_by([&] { value = read(doc); }, &what);
    const auto fail = [&](const std::string& why) {
      ++failures;
      ADD_FAILURE() << seed_line(seed) << " iteration " << i << ": " << name << " of" << log << " " << why
                    << "\n  input: " << doc.dump();
    };
    if (kind == "non-std") {
      fail("threw something that is not a std::exception");
    } else if (!kind.empty()) {
      ++refused;
    } else {
      ++accepted;
      std::string check_what;
      const std::string check_kind = thrown_by([&] { check(value); }, &check_what);
      if (!check_kind.empty()) fail("returned a value its check refuses: " + check_what);
      const std::string again = thrown_by([&] { (void)read(json::parse(write(value).dump())); }, &check_what);
      if (!again.empty()) fail("returned a value whose JSON form does not read back: " + check_what);
    }
  }
  ::testing::Test::RecordProperty("iterations", static_cast<int>(n));
  ::testing::Test::RecordProperty("accepted", accepted);
  ::testing::Test::RecordProperty("refused", refused);
  EXPECT_GT(refused, 0);
}

TEST(FuzzJson, OptimizerSpecFromJson) {
  fuzz_json_reader<OptimizerSpec>(
      "optimizer_spec_from_json", seed_of(0x0971), iterations(4000),
      [](TextGenerator& gen) { return optimizer_spec_json(random_spec(gen)); },
      [](const json& j) { return optimizer_spec_from_json(j); },
      [](const OptimizerSpec& s) { return optimizer_spec_json(s); },
      [](const OptimizerSpec& s) { check_optimizer_spec(s); });
}

TEST(FuzzJson, StepConfigFromJson) {
  fuzz_json_reader<StepConfig>(
      "step_config_from_json", seed_of(0x57ec), iterations(4000),
      [](TextGenerator& gen) { return step_config_json(random_config(gen)); },
      [](const json& j) { return step_config_from_json(j, kBlocks); },
      [](const StepConfig& c) { return step_config_json(c); },
      [](const StepConfig& c) {
        check_step_config(c, kBlocks);
        if (const std::string problem = segment_problem(c.checkpoint, kBlocks); !problem.empty()) {
          throw std::runtime_error(problem);
        }
      });
}

TEST(FuzzJson, PlanFromJson) {
  fuzz_json_reader<Plan>(
      "plan_from_json", seed_of(0x91a7), iterations(4000),
      [](TextGenerator& gen) { return plan_json(random_plan(gen)); },
      [](const json& j) { return plan_from_json(j, kBlocks); },
      [](const Plan& p) { return plan_json(p); },
      [](const Plan& p) {
        if (p.feasible) check_step_config(p.config, kBlocks);
      });
}

// Nothing silent: an integer field given a number it cannot hold exactly (a fraction, past
// its type, NaN, a bool) is refused, not truncated; a pair or a B1,B2 with a third element is
// refused, not cut. (A reader that casts 1e300 to int64_t is also undefined behaviour.)
TEST(FuzzJson, NumbersReadExactlyOrRefused) {
  const uint64_t seed = seed_of(0xe7ac7);
  TextGenerator gen(seed);
  const int64_t n = iterations(2000);
  int failures = 0, refused = 0;
  const json inexact[] = {2.5, -0.5, 1e300, -1e300, 4294967296.0 + 0.25, std::numeric_limits<uint64_t>::max(),
                          static_cast<uint64_t>(1) << 63, json(true)};
  for (int64_t i = 0; i < n && failures < kMaxFailures; ++i) {
    const Plan plan = [&] {
      Plan p = random_plan(gen);
      p.feasible = true;
      return p;
    }();
    json doc = plan_json(plan);
    const json bad = inexact[gen.pick(std::size(inexact))];
    std::string where;
    switch (gen.pick(8)) {
      case 0: where = "/budget_bytes"; break;
      case 1: where = "/floor_bytes"; break;
      case 2: where = "/predicted/peak_bytes"; break;
      case 3: where = "/plain/predicted_peak_bytes"; break;
      case 4: where = "/config/batch"; break;
      case 5: where = "/config/micro_batch"; break;
      case 6: where = doc["config"]["segments"].empty() ? "/config/batch" : "/config/segments/0/1"; break;
      default: where = "/config/optimizer/betas"; break;
    }
    std::string change;
    if (where == "/config/optimizer/betas") {
      doc[json::json_pointer(where)].push_back(0.5);
      change = "a third beta";
    } else if (where == "/config/segments/0/1" && gen.pick(3) == 0) {
      doc["config"]["segments"][0].push_back(0);
      change = "a third element in a segment";
    } else if (where == "/config/segments/0/1" && gen.pick(2) == 0) {
      // An int that wraps to a valid block index when narrowed to int.
      doc[json::json_pointer(where)] = (static_cast<int64_t>(1) << 32) + doc[json::json_pointer(where)].get<int64_t>();
      change = "2^32 + its block index";
    } else {
      doc[json::json_pointer(where)] = bad;
      change = described(bad);
    }
    std::string what;
    const std::string kind = thrown_by([&] { (void)plan_from_json(doc, kBlocks); }, &what);
    if (kind.empty()) {
      ++failures;
      ADD_FAILURE() << seed_line(seed) << " iteration " << i << ": plan_from_json accepted " << where << " = " << change
                    << " (read as something else than written)\n  input: " << doc.dump();
    } else if (kind == "non-std") {
      ++failures;
      ADD_FAILURE() << seed_line(seed) << " iteration " << i << ": plan_from_json threw a non-std exception";
    } else {
      ++refused;
    }
  }
  RecordProperty("iterations", static_cast<int>(n));
  RecordProperty("refused", refused);
}

// --- saved state ------------------------------------------------------------------------------

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The records of a zip archive (PyTorch's are stored, uncompressed), from its central
// directory: name, data offset, size.
struct ZipRecord {
  std::string name;
  size_t offset = 0, size = 0;
};

std::vector<ZipRecord> zip_records(const std::string& z) {
  auto u16 = [&](size_t at) {
    return static_cast<size_t>(static_cast<unsigned char>(z[at])) | static_cast<size_t>(static_cast<unsigned char>(z[at + 1])) << 8;
  };
  auto u32 = [&](size_t at) { return u16(at) | u16(at + 2) << 16; };
  std::vector<ZipRecord> out;
  const size_t end = z.rfind(std::string("PK\x05\x06", 4));
  if (end == std::string::npos || end + 22 > z.size()) return out;
  size_t at = u32(end + 16);
  for (size_t i = 0, count = u16(end + 10); i < count && at + 46 <= z.size(); ++i) {
    if (z.compare(at, 4, std::string("PK\x01\x02", 4)) != 0) break;
    const size_t size = u32(at + 20), name_length = u16(at + 28), extra = u16(at + 30), comment = u16(at + 32);
    const size_t local = u32(at + 42);
    if (local + 30 <= z.size()) {
      const size_t data = local + 30 + u16(local + 26) + u16(local + 28);
      if (data + size <= z.size()) out.push_back({z.substr(at + 46, name_length), data, size});
    }
    at += 46 + name_length + extra + comment;
  }
  return out;
}

// Runs `call` in a forked child held to 20 seconds: what it threw (as thrown_by says, "" for
// nothing) and its message; "crashed" with the signal or exit status when the child died.
// LibTorch's TorchScript loader is not hardened against hostile archives, and past a matching
// checksum memfit hands it the bytes.
std::string thrown_in_child(const std::function<void()>& call, std::string* what) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return thrown_by(call, what);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    return thrown_by(call, what);
  }
  if (pid == 0) {
    ::close(pipe_fds[0]);
    ::alarm(20);
    std::string message;
    const std::string kind = thrown_by(call, &message);
    const std::string out = kind + "\n" + message;
    if (::write(pipe_fds[1], out.data(), out.size()) < 0) std::_Exit(3);
    std::_Exit(0);
  }
  ::close(pipe_fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || out.find('\n') == std::string::npos) {
    *what = WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                                : "exit status " + std::to_string(WEXITSTATUS(status));
    return "crashed";
  }
  *what = out.substr(out.find('\n') + 1);
  return out.substr(0, out.find('\n'));
}

TEST(FuzzSavedState, OpenRefusesEveryCorruptedVariant) {
  const uint64_t seed = seed_of(0x5a7ed);
  TextGenerator gen(seed);
  const int64_t random_per_kind = std::max<int64_t>(40, iterations(4000) / 100);
  const fs::path root = fs::temp_directory_path() / ("memfit-fuzz-state-" + std::to_string(::getpid()));
  fs::remove_all(root);
  const fs::path original = root / "original";

  torch::manual_seed(3);
  auto make_model = [] { return torch::nn::Linear(4, 3); };
  torch::nn::Linear model = make_model();
  OptimizerSpec spec;  // AdamW
  auto optimizer = make_optimizer(spec, model->parameters());
  model->forward(torch::randn({5, 4})).pow(2).sum().backward();
  optimizer->step();
  save_state(original, *model, *optimizer, spec, json{{"step", 3}}, c10::kCPU);

  // The head (JSON: meta, optimizer spec, generators) and one part (an archive: a Linear's own
  // parameters and their state).
  const std::vector<fs::path> state_names = {"state-00000003.json", "state-00000003.part-0000.pt"};
  std::map<fs::path, std::string> originals;
  for (const auto& name : state_names) originals[name] = read_bytes(original / name);
  const std::string manifest_text = read_bytes(original / "state.json");
  const json manifest = json::parse(manifest_text);
  ASSERT_EQ(manifest["files"].size(), 2u);
  for (const auto& [name, bytes] : originals) ASSERT_GT(bytes.size(), 100u) << name;

  // The untouched original opens and loads into a fresh model and optimizer.
  {
    SavedState saved = SavedState::open(original);
    EXPECT_EQ(saved.meta().at("step").get<int64_t>(), 3);
    torch::nn::Linear fresh = make_model();
    auto fresh_optimizer = make_optimizer(spec, fresh->parameters());
    saved.load_into(*fresh, *fresh_optimizer, spec, c10::kCPU);
    EXPECT_EQ(weights_sha256(*fresh), weights_sha256(*model));
  }


  int variants = 0, refused = 0, accepted = 0, failures = 0, resigned = 0, resigned_refused = 0, resigned_accepted = 0,
      resigned_crashed = 0;
  int counter = 0;
  std::map<std::string, int> resigned_accepted_kinds;  // "state byte flipped": 12
  std::vector<std::string> resigned_crashes;
  // One variant: DIR is a copy of the original, `change` corrupts it; SavedState::open must
  // throw a one-line std::runtime_error. With `resign`, the manifest is then rewritten to match
  // the corrupted state file: the archive reader itself is fuzzed (in a child process), and may
  // accept (LibTorch checks no CRC of tensor records) but only ever throws a one-line
  // std::runtime_error; a crash there is LibTorch's, counted and printed, not failed.
  // `resign`: the manifest entry of that file (index into state_names) is rewritten.
  auto variant = [&](const std::string& what, const std::function<void(const fs::path&)>& change, int resign = -1) {
    if (failures >= kMaxFailures) return;
    const fs::path dir = root / ("v" + std::to_string(counter++));
    fs::copy(original, dir, fs::copy_options::recursive);
    change(dir);
    bool same = fs::is_regular_file(dir / "state.json") && read_bytes(dir / "state.json") == manifest_text;
    for (const auto& [name, bytes] : originals) same = same && fs::is_regular_file(dir / name) && read_bytes(dir / name) == bytes;
    if (same) {  // a change that changed nothing (zeroes over zeroes): not a variant
      fs::remove_all(dir);
      return;
    }
    ++variants;
    std::string message;
    const std::string kind = thrown_by([&] { (void)SavedState::open(dir); }, &message);
    if (kind.empty()) {
      ++accepted;
      ++failures;
      ADD_FAILURE() << seed_line(seed) << ": SavedState::open accepted a corrupted state: " << what;
    } else if (kind != "runtime_error" || !one_line(message)) {
      ++failures;
      ADD_FAILURE() << seed_line(seed) << ": SavedState::open of a corrupted state (" << what << ") threw " << kind
                    << " with message '" << shown(message) << "'; expected a one-line std::runtime_error";
    } else {
      ++refused;
    }
    if (resign >= 0 && fs::is_regular_file(dir / state_names[static_cast<size_t>(resign)])) {
      const std::string bytes = read_bytes(dir / state_names[static_cast<size_t>(resign)]);
      json m = manifest;
      m["files"][resign]["bytes"] = static_cast<int64_t>(bytes.size());
      m["files"][resign]["sha256"] = sha256_hex(bytes.data(), bytes.size());
      write_bytes(dir / "state.json", m.dump(2) + "\n");
      ++resigned;
      std::string resigned_message;
      const std::string resigned_kind = thrown_in_child(
          [&] {
            SavedState saved = SavedState::open(dir);
            torch::nn::Linear fresh = make_model();
            auto fresh_optimizer = make_optimizer(spec, fresh->parameters());
            saved.load_into(*fresh, *fresh_optimizer, spec, c10::kCPU);
          },
          &resigned_message);
      if (resigned_kind == "crashed") {
        ++resigned_crashed;
        resigned_crashes.push_back(what + ": " + resigned_message);
      } else if (resigned_kind.empty()) {
        ++resigned_accepted;
        std::string kind_of = what;  // the description without its numbers
        kind_of.erase(std::remove_if(kind_of.begin(), kind_of.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }),
                      kind_of.end());
        ++resigned_accepted_kinds[kind_of];
      } else if (resigned_kind != "runtime_error" || !one_line(resigned_message)) {
        ++failures;
        ADD_FAILURE() << seed_line(seed) << ": a re-signed corrupted state (" << what << ") threw " << resigned_kind
                      << " with message '" << shown(resigned_message)
                      << "' from open or load_into; expected a one-line std::runtime_error";
      } else {
        ++resigned_refused;
      }
    }
    fs::remove_all(dir);
  };
  auto edit_state = [&](const fs::path& name, const std::function<void(std::string&)>& edit) {
    return [&, name, edit](const fs::path& dir) {
      std::string bytes = read_bytes(dir / name);
      edit(bytes);
      write_bytes(dir / name, bytes);
    };
  };
  auto edit_manifest = [&](const std::function<void(json&)>& edit) {
    return [&, edit](const fs::path& dir) {
      json m = manifest;
      edit(m);
      write_bytes(dir / "state.json", m.dump(2) + "\n");
    };
  };
  auto position = [&](size_t size) { return static_cast<size_t>(gen.pick(size)); };

  // Each state file (the head, the part): truncated, flipped (anywhere, and inside tensor
  // records), zeroed, shortened inside a record (bytes cut from the middle, the rest kept), grown.
  for (int f = 0; f < static_cast<int>(state_names.size()); ++f) {
    const fs::path name = state_names[static_cast<size_t>(f)];
    const std::string& state = originals[name];
    const std::string in = name.string() + ": ";
    const bool archive = name.extension() == ".pt";  // the part; the head is JSON
    const std::vector<ZipRecord> records = archive ? zip_records(state) : std::vector<ZipRecord>{};
    std::vector<ZipRecord> tensors;
    for (const auto& r : records) {
      if (r.name.find("/data/") != std::string::npos && r.size > 0) tensors.push_back(r);
    }
    if (archive) ASSERT_FALSE(tensors.empty()) << "no stored tensor records found in " << name << " (" << records.size() << " records)";
    for (int64_t i = 0; i < random_per_kind; ++i) {
      const size_t length = position(state.size());
      variant(in + "truncated to " + std::to_string(length) + " bytes",
              edit_state(name, [length](std::string& b) { b.resize(length); }), f);
    }
    for (int64_t i = 0; i < random_per_kind; ++i) {
      const size_t at = position(state.size());
      const auto mask = static_cast<char>(1 + gen.pick(255));
      variant(in + "byte " + std::to_string(at) + " flipped", edit_state(name, [at, mask](std::string& b) { b[at] ^= mask; }), f);
    }
    for (int64_t i = 0; archive && i < random_per_kind; ++i) {
      const ZipRecord& r = tensors[gen.pick(tensors.size())];
      const size_t at = r.offset + position(r.size);
      const auto mask = static_cast<char>(1 + gen.pick(255));
      variant(in + "byte " + std::to_string(at - r.offset) + " of tensor record " + r.name + " flipped",
              edit_state(name, [at, mask](std::string& b) { b[at] ^= mask; }), f);
    }
    for (int64_t i = 0; i < random_per_kind; ++i) {
      const size_t at = position(state.size());
      const size_t length = 1 + position(std::min<size_t>(64, state.size() - at));
      variant(in + "bytes " + std::to_string(at) + ".." + std::to_string(at + length) + " zeroed",
              edit_state(name, [at, length](std::string& b) { std::fill_n(b.begin() + static_cast<std::ptrdiff_t>(at), length, '\0'); }),
              f);
    }
    for (int64_t i = 0; archive && i < random_per_kind; ++i) {
      const ZipRecord& r = records[gen.pick(records.size())];
      if (r.size < 2) continue;
      const size_t at = r.offset + position(r.size - 1);
      const size_t length = 1 + position(r.offset + r.size - at - 1);
      variant(in + "record " + r.name + " shortened: " + std::to_string(length) + " bytes cut at " + std::to_string(at - r.offset),
              edit_state(name, [at, length](std::string& b) { b.erase(at, length); }), f);
    }
    for (int64_t i = 0; i < random_per_kind / 3; ++i) {
      const size_t at = position(state.size() + 1);
      const std::string junk = gen.text() + "x";
      variant(in + "'" + shown(junk) + "' inserted at " + std::to_string(at),
              edit_state(name, [at, junk](std::string& b) { b.insert(at, junk); }), f);
    }
    variant(in + "emptied", edit_state(name, [](std::string& b) { b.clear(); }));
    variant(in + "deleted", [name](const fs::path& dir) { fs::remove(dir / name); });
    variant(in + "replaced by a directory", [name](const fs::path& dir) {
      fs::remove(dir / name);
      fs::create_directory(dir / name);
    });
  }
  variant("state files replaced by another model's", [&](const fs::path& dir) {
    torch::nn::Linear other(4, 4);
    auto other_optimizer = make_optimizer(spec, other->parameters());
    save_state(root / "other", *other, *other_optimizer, spec, json{{"step", 3}}, c10::kCPU);
    for (const auto& name : state_names) fs::copy_file(root / "other" / name, dir / name, fs::copy_options::overwrite_existing);
    fs::remove_all(root / "other");
  });

  // The manifest: gone, empty, truncated, not JSON, its entry wrong in every field.
  variant("manifest deleted", [&](const fs::path& dir) { fs::remove(dir / "state.json"); });
  variant("manifest emptied", [&](const fs::path& dir) { write_bytes(dir / "state.json", ""); });
  variant("manifest replaced by a directory", [&](const fs::path& dir) {
    fs::remove(dir / "state.json");
    fs::create_directory(dir / "state.json");
  });
  for (int64_t i = 0; i < random_per_kind; ++i) {
    const size_t length = position(manifest_text.size() - 1);  // at least "}\n" cut: never valid JSON
    variant("manifest truncated to " + std::to_string(length) + " bytes",
            [&, length](const fs::path& dir) { write_bytes(dir / "state.json", manifest_text.substr(0, length)); });
  }
  for (const char* text : {"{}", "[]", "null", "0", "\"state-00000003.pt\"", "{\"files\": []}", "{\"files\": {}}",
                           "{\"files\": [null]}", "{\"files\": [[]]}", "{\"files\": [{}]}", "\xff\xfe{", "{\"files\"",
                           "{\"files\": [{\"name\": \"state-00000003.pt\"}]}"}) {
    variant(std::string("manifest is ") + shown(text), [text](const fs::path& dir) { write_bytes(dir / "state.json", text); });
  }
  variant("manifest nested 100000 deep", [](const fs::path& dir) {
    write_bytes(dir / "state.json", std::string(100000, '[') + std::string(100000, ']'));
  });
  const std::string sha = manifest["files"][0]["sha256"].get<std::string>();
  const int64_t size = manifest["files"][0]["bytes"].get<int64_t>();
  std::vector<std::pair<std::string, json>> wrong_sha = {
      {"empty", ""}, {"uppercase", [&] { std::string s = sha; for (char& c : s) c = static_cast<char>(std::toupper(c)); return s; }()},
      {"one character changed", [&] { std::string s = sha; s[gen.pick(s.size())] ^= 1; return s; }()},
      {"63 characters", sha.substr(0, 63)}, {"65 characters", sha + "0"}, {"all zeros", std::string(64, '0')},
      {"a number", 12345}, {"null", nullptr}, {"an array", json::array({sha})}};
  for (const auto& [what, value] : wrong_sha) {
    variant("manifest sha256 " + what, edit_manifest([value = value](json& m) { m["files"][0]["sha256"] = value; }));
  }
  variant("manifest sha256 missing", edit_manifest([](json& m) { m["files"][0].erase("sha256"); }));
  std::vector<std::pair<std::string, json>> wrong_size = {
      {"+1", size + 1}, {"-1", size - 1}, {"0", 0}, {"negative", -size}, {"int64 max", std::numeric_limits<int64_t>::max()},
      {"uint64 max", std::numeric_limits<uint64_t>::max()}, {"1e300", 1e300}, {"size + 0.5", static_cast<double>(size) + 0.5},
      {"a string", std::to_string(size)}, {"true", true}, {"null", nullptr}};
  for (const auto& [what, value] : wrong_size) {
    variant("manifest bytes " + what, edit_manifest([value = value](json& m) { m["files"][0]["bytes"] = value; }));
  }
  variant("manifest bytes missing", edit_manifest([](json& m) { m["files"][0].erase("bytes"); }));
  for (const std::string name : {"../state-00000003.pt", "./state-00000003.pt", "sub/state-00000003.pt", "/tmp/state-00000003.pt",
                                 "..", ".", "", "state-", "state-..", "state-00000004.pt", "state.json", "STATE-00000003.pt",
                                 "state-00000003.pt/", "state-00000003.pt\nx", "state-\n.pt"}) {
    variant("manifest names '" + shown(name) + "'", edit_manifest([name](json& m) { m["files"][0]["name"] = name; }));
  }
  variant("manifest names the state file with a NUL and more after it",
          edit_manifest([](json& m) { m["files"][0]["name"] = std::string("state-00000003.pt\0.bak", 23); }));
  variant("manifest name is a number", edit_manifest([](json& m) { m["files"][0]["name"] = 3; }));
  variant("manifest name missing", edit_manifest([](json& m) { m["files"][0].erase("name"); }));
  variant("manifest files missing", edit_manifest([](json& m) { m.erase("files"); }));
  variant("manifest format 4 (a future memfit's)", edit_manifest([](json& m) { m["format"] = 4; }));
  variant("manifest format 2 (an older memfit's)", edit_manifest([](json& m) { m["format"] = 2; }));
  variant("manifest without its part", edit_manifest([](json& m) { m["files"].erase(1); }));
  variant("manifest with the part twice", edit_manifest([](json& m) { m["files"].push_back(m["files"][1]); }));
  variant("manifest with head and part swapped", edit_manifest([](json& m) { std::swap(m["files"][0], m["files"][1]); }));
  for (const std::string name : {"state-00000003.part-0001.pt", "state-00000003.part-0.pt", "state-00000004.part-0000.pt",
                                 "../state-00000003.part-0000.pt", "state-00000003.pt", "state-00000003.part-0000.pt/"}) {
    variant("manifest names the part '" + shown(name) + "'", edit_manifest([name](json& m) { m["files"][1]["name"] = name; }));
  }
  variant("manifest format 'two'", edit_manifest([](json& m) { m["format"] = "two"; }));
  variant("directory is a file", [](const fs::path& dir) {
    fs::remove_all(dir);
    write_bytes(dir, "not a directory");
  });
  variant("directory missing", [](const fs::path& dir) { fs::remove_all(dir); });

  fs::remove_all(root);
  RecordProperty("variants", variants);
  RecordProperty("refused", refused);
  RecordProperty("accepted", accepted);
  RecordProperty("resigned_variants", resigned);
  RecordProperty("resigned_refused", resigned_refused);
  RecordProperty("resigned_accepted", resigned_accepted);
  RecordProperty("resigned_crashed", resigned_crashed);
  std::printf("saved state: %d variants, %d refused, %d accepted; re-signed (archive reader fuzzed): %d, %d refused, "
              "%d accepted, %d crashed LibTorch's loader\n",
              variants, refused, accepted, resigned, resigned_refused, resigned_accepted, resigned_crashed);
  for (const auto& crash : resigned_crashes) std::printf("  NOTE: re-signed, LibTorch's loader crashed (%s)\n", crash.c_str());
  for (const auto& [kind_of, count] : resigned_accepted_kinds) std::printf("  re-signed and accepted: %d x %s\n", count, kind_of.c_str());
  EXPECT_GE(variants, 200);
  EXPECT_EQ(accepted, 0);
}

}  // namespace
}  // namespace memfit
