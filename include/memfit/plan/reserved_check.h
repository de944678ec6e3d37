// reserved_check.h — what a plan's step reserves on a CUDA device, judged against the budget:
// the caching allocator reserves segments, not tensors, so a plan whose tensors fit may still
// make the allocator free its cache and retry, or run out of memory, under the memory fraction
// the budget sets. reserved_fit.h makes these checks; a Plan carries the last one.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>

namespace memfit {

struct ReservedCheck {
  int steps = 0;                   // steps replayed (0: not checked, as on the CPU)
  int64_t cap_bytes = 0;           // the reserved bytes the budget allows: budget - memory outside the allocator
  int64_t margin_bytes = 0;        // kept free below the cap (the plan's margin, of the cap)
  int64_t peak_reserved = 0;       // the step's segments at their peak, replayed without a cap
  int64_t peak_allocated = 0;      // its blocks handed out at their peak (rounded as CUDA rounds)
  int64_t workspace_bytes = 0;     // cuBLAS workspaces the replay placed (the trace lacked them)
  int64_t num_alloc_retries = 0;   // replayed under the cap: frees of the cache to retry
  int64_t num_ooms = 0;            // ... and allocations that failed even then
  double reserved_per_allocated = 1.0;  // the relation the plan was made with
  int attempts = 0;                // plans checked before this one held (or the last gave up)

  bool checked() const { return steps > 0; }
  // Under the cap less the margin, without a retry or an out-of-memory error.
  bool held() const {
    return num_alloc_retries == 0 && num_ooms == 0 && peak_reserved <= cap_bytes - margin_bytes;
  }
};

// {"steps", "cap_bytes", "margin_bytes", "peak_reserved_bytes", "peak_allocated_bytes",
//  "workspace_bytes", "num_alloc_retries", "num_ooms", "reserved_per_allocated", "attempts", "held"}
nlohmann::json reserved_check_json(const ReservedCheck& check);
// Reads it back (a saved run's plan); std::invalid_argument naming a bad field.
ReservedCheck reserved_check_from_json(const nlohmann::json& json);

}  // namespace memfit
