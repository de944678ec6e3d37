// The one JSON form of the measurements (profile.h), which the profile cache stores.
#include "memfit/plan/profile.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "runtime/json_fields.h"

namespace memfit {
namespace {

namespace jf = json_fields;

// `recomputable` is written only where false (a Python model's parts around its blocks),
// `forward_left_bytes`, `recompute_start_extra_bytes`, `segment_kept_bytes`, `handed_bytes`,
// `handed_new_bytes` and `recomputed_output_copy_bytes` only where not 0,
// `segment_output_kept` only where true, `recompute_peak` only where measured and
// `backward_peak_streamed` only where measured (by the Python front), so a CLI model's profile
// reads as before.
nlohmann::json block_cost_json(const BlockCost& b) {
  nlohmann::json j{{"forward_seconds", b.forward_seconds}, {"backward_seconds", b.backward_seconds},
          {"output_bytes", b.output_bytes},       {"output_kept", b.output_kept},
          {"kept_bytes", b.kept_bytes},           {"forward_peak", b.forward_peak},
          {"forward_nograd_peak", b.forward_nograd_peak}, {"backward_peak", b.backward_peak},
          {"backward_peak_accumulating", b.backward_peak_accumulating},
          {"backward_held_input_bytes", b.backward_held_input_bytes},
          {"backward_held_by_segment_bytes", b.backward_held_by_segment_bytes},
          {"backward_held_all_bytes", b.backward_held_all_bytes},
          {"param_bytes", b.param_bytes},         {"cast_bytes", b.cast_bytes},
          {"input_copy_bytes", b.input_copy_bytes}, {"input_copy_kept", b.input_copy_kept},
          {"keeps_own_output", b.keeps_own_output}, {"shared_gradient_bytes", b.shared_gradient_bytes}};
  if (!b.recomputable) j["recomputable"] = false;
  if (b.forward_left_bytes != 0) j["forward_left_bytes"] = b.forward_left_bytes;
  if (b.recompute_start_extra_bytes != 0) j["recompute_start_extra_bytes"] = b.recompute_start_extra_bytes;
  if (b.backward_peak_streamed >= 0) j["backward_peak_streamed"] = b.backward_peak_streamed;
  if (b.segment_kept_bytes != 0) j["segment_kept_bytes"] = b.segment_kept_bytes;
  if (b.recompute_peak >= 0) j["recompute_peak"] = b.recompute_peak;
  if (b.segment_output_kept) j["segment_output_kept"] = true;
  if (b.handed_bytes != 0) j["handed_bytes"] = b.handed_bytes;
  if (b.handed_new_bytes != 0) j["handed_new_bytes"] = b.handed_new_bytes;
  if (b.recomputed_output_copy_bytes != 0) j["recomputed_output_copy_bytes"] = b.recomputed_output_copy_bytes;
  return j;
}

BlockCost block_cost_from_json(const nlohmann::json& j) {
  BlockCost b;
  b.forward_seconds = jf::number(j, "forward_seconds");
  b.backward_seconds = jf::number(j, "backward_seconds");
  b.output_bytes = jf::integer(j, "output_bytes");
  b.output_kept = jf::boolean(j, "output_kept");
  b.kept_bytes = jf::integer(j, "kept_bytes");
  b.forward_peak = jf::integer(j, "forward_peak");
  b.forward_nograd_peak = jf::integer(j, "forward_nograd_peak");
  b.backward_peak = jf::integer(j, "backward_peak");
  b.backward_peak_accumulating = jf::integer(j, "backward_peak_accumulating");
  b.backward_held_input_bytes = jf::integer(j, "backward_held_input_bytes");
  b.backward_held_by_segment_bytes = jf::integer(j, "backward_held_by_segment_bytes");
  b.backward_held_all_bytes = jf::integer(j, "backward_held_all_bytes");
  b.param_bytes = jf::integer(j, "param_bytes");
  b.cast_bytes = jf::integer(j, "cast_bytes");
  b.input_copy_bytes = jf::integer(j, "input_copy_bytes");
  b.input_copy_kept = jf::boolean(j, "input_copy_kept");
  b.keeps_own_output = jf::boolean(j, "keeps_own_output");
  b.shared_gradient_bytes = jf::integer(j, "shared_gradient_bytes");
  b.recomputable = !j.contains("recomputable") || jf::boolean(j, "recomputable");
  b.forward_left_bytes = j.contains("forward_left_bytes") ? jf::integer(j, "forward_left_bytes") : 0;
  b.recompute_start_extra_bytes =
      j.contains("recompute_start_extra_bytes") ? jf::integer(j, "recompute_start_extra_bytes") : 0;
  b.backward_peak_streamed = j.contains("backward_peak_streamed") ? jf::integer(j, "backward_peak_streamed") : -1;
  b.segment_kept_bytes = j.contains("segment_kept_bytes") ? jf::integer(j, "segment_kept_bytes") : 0;
  b.recompute_peak = j.contains("recompute_peak") ? jf::integer(j, "recompute_peak") : -1;
  b.segment_output_kept = j.contains("segment_output_kept") && jf::boolean(j, "segment_output_kept");
  b.handed_bytes = j.contains("handed_bytes") ? jf::integer(j, "handed_bytes") : 0;
  b.handed_new_bytes = j.contains("handed_new_bytes") ? jf::integer(j, "handed_new_bytes") : 0;
  b.recomputed_output_copy_bytes =
      j.contains("recomputed_output_copy_bytes") ? jf::integer(j, "recomputed_output_copy_bytes") : 0;
  return b;
}

// The pattern as 16 hex digits (a JSON number past int64 would not read back as one).
nlohmann::json peak_moments_json(const PeakMoments& p) {
  char pattern[17];
  std::snprintf(pattern, sizeof pattern, "%016llx", static_cast<unsigned long long>(p.pattern));
  return {{"pattern", pattern}, {"bytes", p.bytes}};
}

PeakMoments peak_moments_from_json(const nlohmann::json& j) {
  PeakMoments p;
  const std::string pattern = jf::text(j, "pattern");
  char* end = nullptr;
  p.pattern = std::strtoull(pattern.c_str(), &end, 16);
  if (pattern.size() != 16 || end != pattern.c_str() + 16) {
    jf::refuse("pattern", pattern, "expected 16 hex digits");
  }
  for (const auto& v : jf::array(j, "bytes")) {  // (below the start where a run frees first)
    if (!v.is_number_integer()) jf::refuse("bytes", v, "expected integers");
    p.bytes.push_back(v.get<int64_t>());
  }
  return p;
}

// A block's moments, field by field (the names of BlockCost's peaks they fit).
const std::pair<const char*, PeakMoments BlockMoments::*> kMomentFields[] = {
    {"forward_peak", &BlockMoments::forward},
    {"forward_nograd_peak", &BlockMoments::forward_nograd},
    {"backward_peak", &BlockMoments::backward},
    {"backward_peak_accumulating", &BlockMoments::backward_accumulating},
    {"backward_input_held", &BlockMoments::backward_input_held},
    {"backward_segment_end", &BlockMoments::backward_segment_end},
    {"backward_all", &BlockMoments::backward_all}};

nlohmann::json block_moments_json(const BlockMoments& m) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, field] : kMomentFields) j[name] = peak_moments_json(m.*field);
  return j;
}

BlockMoments block_moments_from_json(const nlohmann::json& j) {
  BlockMoments m;
  for (const auto& [name, field] : kMomentFields) m.*field = peak_moments_from_json(jf::field(j, name));
  return m;
}

nlohmann::json chain_profile_json(const ChainProfile& c) {
  nlohmann::json blocks = nlohmann::json::array();
  for (const auto& b : c.blocks) blocks.push_back(block_cost_json(b));
  nlohmann::json j{{"micro_batch", c.micro_batch}, {"blocks", blocks}, {"forward_nograd_seconds", c.forward_nograd_seconds}};
  if (!c.moments.empty()) {
    nlohmann::json moments = nlohmann::json::array();
    for (const auto& m : c.moments) moments.push_back(block_moments_json(m));
    j["moments"] = moments;
  }
  return j;
}

ChainProfile chain_profile_from_json(const nlohmann::json& j, size_t blocks) {
  ChainProfile c;
  c.micro_batch = jf::integer(j, "micro_batch", 1);
  for (const auto& b : jf::array(j, "blocks", static_cast<int>(blocks))) c.blocks.push_back(block_cost_from_json(b));
  c.forward_nograd_seconds = jf::number(j, "forward_nograd_seconds");
  if (j.contains("moments")) {  // absent: not recorded
    for (const auto& m : jf::array(j, "moments", static_cast<int>(blocks))) c.moments.push_back(block_moments_from_json(m));
  }
  return c;
}

nlohmann::json precision_profile_json(const PrecisionProfile& p) {
  nlohmann::json times = nlohmann::json::array();
  for (const auto& t : p.chain_seconds) times.push_back({t.micro_batch, t.seconds});
  nlohmann::json j{{"precision", precision_name(p.precision)},
                   {"small", chain_profile_json(p.small)},
                   {"large", chain_profile_json(p.large)},
                   {"calibration", p.calibration},
                   {"chain_seconds", times}};  // [[micro-batch, seconds], ...]
  if (!p.below.empty()) {
    nlohmann::json below = nlohmann::json::array();
    for (const auto& c : p.below) below.push_back(chain_profile_json(c));
    j["below"] = below;  // absent: none measured
  }
  if (p.fewest_samples != 1) j["fewest_samples"] = p.fewest_samples;  // absent: one
  return j;
}

PrecisionProfile precision_profile_from_json(const nlohmann::json& j, size_t blocks) {
  PrecisionProfile p;
  p.precision = parse_precision(jf::text(j, "precision"));
  p.small = chain_profile_from_json(jf::field(j, "small"), blocks);
  p.large = chain_profile_from_json(jf::field(j, "large"), blocks);
  if (j.contains("below")) {  // absent: none measured
    int64_t previous = 0;
    for (const auto& c : jf::array(j, "below")) {
      p.below.push_back(chain_profile_from_json(c, blocks));
      if (p.below.back().micro_batch <= previous) jf::refuse("below", c, "expected sizes in ascending order");
      previous = p.below.back().micro_batch;
    }
  }
  if (j.contains("fewest_samples")) p.fewest_samples = jf::integer(j, "fewest_samples");  // absent: one
  p.calibration = jf::number(j, "calibration");
  int64_t previous = 0;
  for (const auto& t : jf::array(j, "chain_seconds")) {
    if (!t.is_array() || t.size() != 2) jf::refuse("chain_seconds", t, "expected [micro-batch, seconds] pairs");
    const nlohmann::json pair{{"micro_batch", t[0]}, {"seconds", t[1]}};
    p.chain_seconds.push_back({jf::integer(pair, "micro_batch", previous + 1), jf::number(pair, "seconds")});
    previous = p.chain_seconds.back().micro_batch;
  }
  return p;
}

}  // namespace

nlohmann::json profile_json(const WorkloadProfile& p) {
  nlohmann::json precisions = nlohmann::json::array();
  for (const auto& pp : p.precisions) precisions.push_back(precision_profile_json(pp));
  nlohmann::json j{{"batch", p.batch},
                   {"weight_bytes", p.weight_bytes},
                   {"batch_bytes", p.batch_bytes},
                   {"segment_overhead_bytes", p.segment_overhead_bytes},
                   {"blocks", p.precisions.empty() ? 0 : p.precisions.front().small.blocks.size()},
                   {"precisions", precisions},
                   {"notes", p.notes}};
  if (p.non_reentrant_checkpoint) j["non_reentrant_checkpoint"] = true;  // the Python package's (absent: the CLI's)
  return j;
}

WorkloadProfile profile_from_json(const nlohmann::json& j) {
  WorkloadProfile p;
  p.batch = jf::integer(j, "batch", 1);
  p.weight_bytes = jf::integer(j, "weight_bytes");
  p.batch_bytes = jf::integer(j, "batch_bytes");
  p.segment_overhead_bytes = jf::integer(j, "segment_overhead_bytes");
  const auto blocks = static_cast<size_t>(jf::integer(j, "blocks", 1));
  const auto& precisions = jf::array(j, "precisions");
  if (precisions.empty()) jf::refuse("precisions", precisions, "expected at least one precision");
  for (const auto& pp : precisions) p.precisions.push_back(precision_profile_from_json(pp, blocks));
  if (std::all_of(p.precisions.begin(), p.precisions.end(), [](const PrecisionProfile& pp) { return pp.chain_seconds.empty(); })) {
    jf::refuse("chain_seconds", nlohmann::json::array(), "expected timings at one precision at least");
  }
  for (const auto& note : jf::array(j, "notes")) {
    if (!note.is_string()) jf::refuse("notes", note, "expected strings");
    p.notes.push_back(note.get<std::string>());
  }
  p.non_reentrant_checkpoint = j.contains("non_reentrant_checkpoint") && jf::boolean(j, "non_reentrant_checkpoint");
  return p;
}

nlohmann::json length_profile_json(const LengthProfile& p) {
  return {{"length", p.length}, {"profile", precision_profile_json(p.profile)}};
}

LengthProfile length_profile_from_json(const nlohmann::json& j, size_t blocks) {
  return {jf::integer(j, "length", 1), precision_profile_from_json(jf::field(j, "profile"), blocks)};
}

nlohmann::json optimizer_cost_json(const OptimizerCost& c) {
  return {{"state_bytes", c.state_bytes}, {"step_bytes", c.step_bytes}, {"seconds", c.seconds},
          {"state", state_precision_name(c.state)}};
}

OptimizerCost optimizer_cost_from_json(const nlohmann::json& j) {
  OptimizerCost c;
  c.state_bytes = jf::integer(j, "state_bytes");
  c.step_bytes = jf::integer(j, "step_bytes");
  c.seconds = jf::number(j, "seconds");
  c.state = parse_state_precision(jf::text(j, "state"));
  if (c.state == StatePrecision::kAuto) jf::refuse("state", j.at("state"), "expected fp32 or 8bit (a measured state)");
  return c;
}

}  // namespace memfit
