// fuzz_parsers.cpp — seeded random fuzzing of what memfit reads from people as text and from
// its own JSON forms: sizes, step lists and checkpoint specs (text), the JSON forms of
// OptimizerSpec, StepConfig and Plan. Saved state is fuzz_saved_state.cpp's; iterations and
// seeds: fuzz_util.h.
//
// Property everywhere: a reader either returns a value that holds its documented constraints,
// or throws the exception its header promises (std::invalid_argument for text, std::exception
// for JSON); nothing else, no crash, no hang.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "memfit/memfit.h"

namespace memfit {
namespace {

using namespace fuzz;
using nlohmann::json;

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

}  // namespace
}  // namespace memfit
