// profile_cache.h — the planner's measurements kept on disk between runs: a second run of the
// same job plans from them in milliseconds instead of profiling for seconds (`--replan`
// measures again).
//
// A file is keyed by everything the measurements depend on: the program (its executable's
// sha256: a user's C++ blocks are code in it) and LibTorch's and memfit's versions; the model
// (description, fingerprint such as a TorchScript file's sha256, each block's name, module type
// and parameter/buffer shapes and dtypes); the batch (its input's and target's shapes and
// dtypes); the precision candidates; the optimizer spec and the shapes of the parameters this
// process steps; the device, the thread count and the CPU. The key's sha256 names the file,
// DIR/profile-<sha256>.json, which holds the key too: a file whose key differs (stale) or that
// does not read (corrupt, truncated, another format) is ignored with a note and replaced.
// Files are written to a temporary name and renamed, so a reader never sees half of one.
#pragma once

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

#include "memfit/plan/profile.h"

namespace memfit {

// What the planner searches over: the workload's profile and the optimizer's cost per state
// precision (the spec's, or fp32 then 8-bit under auto).
struct MeasuredCosts {
  WorkloadProfile profile;
  std::vector<OptimizerCost> optimizer;
  // The batch cut to shorter lengths, at the precisions plans ran (batch_shape.h), as they were
  // measured: a resumed run plans each batch's shape from the same numbers, so it makes the same
  // choices as the run it continues.
  std::vector<LengthProfile> lengths;
};

nlohmann::json measured_costs_json(const MeasuredCosts& costs);
MeasuredCosts measured_costs_from_json(const nlohmann::json& j);

struct ProfileCacheOptions {
  std::string dir;      // "" : no cache (measure every time)
  bool replan = false;  // measure even when a matching file exists, then replace it
};

// $MEMFIT_CACHE_DIR, else $XDG_CACHE_HOME/memfit, else $HOME/.cache/memfit; "none" in
// MEMFIT_CACHE_DIR turns the cache off (returns "").
std::string default_profile_cache_dir();

// The key of a measurement (see above). `optimized`: the parameters this process steps.
nlohmann::json profile_cache_key(const Workload& workload, const Batch& batch, const std::vector<Precision>& precisions,
                                 const OptimizerSpec& optimizer, const std::vector<at::Tensor>& optimized);

// Where and how the costs came.
struct CostsSource {
  bool cached = false;    // read from the cache
  std::string path;       // the cache file read or written ("" without a cache)
  double seconds = 0;     // measuring, or reading
  std::vector<std::string> notes;  // a stale or corrupt file ignored, a file that could not be written
  nlohmann::json key;              // what the file is keyed by
};

// The costs for `key`: read from the cache when it holds them and replan is off, else
// measure() and stored (a cache that cannot be written is a note, never an error).
MeasuredCosts cached_costs(const ProfileCacheOptions& cache, const nlohmann::json& key,
                           const std::function<MeasuredCosts()>& measure, CostsSource& source);

// Rewrites the cache file `source` was read from or written to with `costs` (the profile grown
// by sizes timed as the search needed them); a file that cannot be written is a note.
void store_costs(CostsSource& source, const MeasuredCosts& costs);
// The workload profiled at each precision and the optimizer's state precisions measured on
// copies of `optimized` (the parameters this process steps; their own state is untouched), or
// both read from the cache (keyed by `options` too). `tracker` must be installed on this thread.
MeasuredCosts measure_costs(Workload& workload, const Batch& batch, const std::vector<Precision>& precisions,
                            const OptimizerSpec& optimizer, const std::vector<at::Tensor>& optimized,
                            MemoryTracker& tracker, const ProfileCacheOptions& cache, CostsSource& source,
                            const ProfileOptions& options = {});

}  // namespace memfit
