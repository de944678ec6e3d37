#include "memfit/runtime/step_config.h"

#include <algorithm>

#include "memfit/errors.h"
#include "runtime/json_fields.h"

namespace memfit {

std::string OffloadPlan::describe() const {
  if (!any()) return "none";
  std::string blocks;
  for (size_t i = 0; i < activation_blocks.size();) {  // runs of consecutive blocks as "a-b"
    size_t j = i;
    while (j + 1 < activation_blocks.size() && activation_blocks[j + 1] == activation_blocks[j] + 1) ++j;
    blocks += (blocks.empty() ? "" : ",") + std::to_string(activation_blocks[i]) +
              (j > i ? "-" + std::to_string(activation_blocks[j]) : "");
    i = j + 1;
  }
  const std::string activations = blocks.empty() ? "" : "activations of blocks " + blocks;
  if (!optimizer) return activations;
  return activations.empty() ? "optimizer" : "optimizer, " + activations;
}

std::string StepConfig::describe() const {
  return "micro-batch " + std::to_string(micro_batch_size()) + " x " + std::to_string(accumulation()) + ", " +
         precision_name(precision) + ", recompute " + checkpoint.describe() +
         (prefetch_depth > 0 ? ", " + std::to_string(prefetch_depth) + " blocks gathered ahead" : "") +
         (offload.any() ? ", offload " + offload.describe() : "");
}

void check_step_config(const StepConfig& c, int blocks) {
  check_option(c.batch >= 1, "batch", c.batch, "expected a positive integer");
  check_option(c.micro_batch >= 0 && c.micro_batch <= c.batch, "micro_batch", c.micro_batch,
               "expected 0 (the whole batch) or 1 to batch (" + std::to_string(c.batch) + ")");
  int next = 0;
  for (const auto& [first, last] : c.checkpoint.segments) {
    check_option(first >= next && last >= first && last < blocks, "checkpoint", c.checkpoint.describe(),
                 "expected sorted, disjoint segments inside blocks 0 to " + std::to_string(blocks - 1));
    next = last + 1;
  }
  std::string why;
  check_option(precision_supported(c.precision, c.device.type(), &why), "precision", precision_name(c.precision), why);
  check_option(c.prefetch_depth >= 0 && c.prefetch_depth <= kMaxPrefetchDepth, "prefetch_depth", c.prefetch_depth,
               "expected 0 to " + std::to_string(kMaxPrefetchDepth));
  const auto recomputed = c.checkpoint.recomputed_blocks();
  int previous = -1;
  for (int k : c.offload.activation_blocks) {
    check_option(k > previous && k < blocks, "offload", c.offload.describe(),
                 "expected sorted blocks 0 to " + std::to_string(blocks - 1));
    check_option(std::find(recomputed.begin(), recomputed.end(), k) == recomputed.end(), "offload", c.offload.describe(),
                 "block " + std::to_string(k) + " is recomputed: a recomputed block keeps nothing to offload");
    previous = k;
  }
  check_optimizer_spec(c.optimizer);
}

nlohmann::json step_config_json(const StepConfig& c) {
  return {{"device", c.device.str()},
          {"batch", c.batch},
          {"micro_batch", c.micro_batch_size()},
          {"accumulation", c.accumulation()},
          {"precision", precision_name(c.precision)},
          {"segments", c.checkpoint.segments},
          {"recomputed_blocks", c.checkpoint.recomputed_blocks()},
          {"set_to_none", c.set_to_none},
          {"optimizer", optimizer_spec_json(c.optimizer)},
          {"prefetch_depth", c.prefetch_depth},
          {"offload", {{"optimizer", c.offload.optimizer}, {"activation_blocks", c.offload.activation_blocks}}}};
}

StepConfig step_config_from_json(const nlohmann::json& j, int blocks) {
  namespace jf = json_fields;
  StepConfig c;
  try {
    c.device = c10::Device(jf::text(j, "device"));
  } catch (const c10::Error&) {
    jf::refuse("device", jf::field(j, "device"), "expected a device such as cpu or cuda:0");
  }
  c.batch = jf::integer(j, "batch", 1);
  c.micro_batch = jf::integer(j, "micro_batch", 0);
  c.precision = parse_precision(jf::text(j, "precision"));
  for (const auto& segment : jf::array(j, "segments")) {
    if (!segment.is_array() || segment.size() != 2) jf::refuse("segments", segment, "expected [first, last] pairs");
    c.checkpoint.segments.emplace_back(jf::integer({{"first", segment[0]}}, "first", 0, INT32_MAX),
                                       jf::integer({{"last", segment[1]}}, "last", 0, INT32_MAX));
  }
  c.set_to_none = jf::boolean(j, "set_to_none");
  c.optimizer = optimizer_spec_from_json(jf::field(j, "optimizer"));
  // Absent in what earlier versions wrote: their ZeRO 3 gathered nothing ahead.
  if (j.contains("prefetch_depth")) c.prefetch_depth = static_cast<int>(jf::integer(j, "prefetch_depth", 0, kMaxPrefetchDepth));
  if (j.contains("offload")) {  // absent in what earlier versions wrote: nothing offloaded
    const nlohmann::json& o = jf::field(j, "offload");
    c.offload.optimizer = jf::boolean(o, "optimizer");
    for (const auto& k : jf::array(o, "activation_blocks")) {
      c.offload.activation_blocks.push_back(static_cast<int>(jf::integer({{"block", k}}, "block", 0, INT32_MAX)));
    }
  }
  check_step_config(c, blocks);
  return c;
}

}  // namespace memfit
