#include "memfit/plan/cost_fit.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "memfit/plan/peak_moments.h"

namespace memfit {

namespace {

// A block's bytes at m from two measured sizes (lo at m1, hi at m2): each on the line through
// them, a peak the highest of its moments' lines where both runs' moments match (a held peak's
// excess then the difference of two such), those inside the block calibrated against the
// whole chain's measured peak. `lo_moments`/`hi_moments` may be null (not recorded).
void fit_block_bytes(const BlockCost& lo, const BlockMoments* lo_moments, int64_t m1, const BlockCost& hi,
                     const BlockMoments* hi_moments, int64_t m2, int64_t m, double calibration, BlockCost& f) {
  const auto fit = [&](int64_t BlockCost::*field) { return fit_bytes(m1, lo.*field, m2, hi.*field, m); };
  const auto moments = [&](PeakMoments BlockMoments::*whole) -> std::optional<int64_t> {
    if (lo_moments == nullptr || hi_moments == nullptr) return std::nullopt;
    return highest_moment(lo_moments->*whole, m1, hi_moments->*whole, m2, m);
  };
  const auto peak = [&](int64_t BlockCost::*field, PeakMoments BlockMoments::*whole) {
    return calibrated(moments(whole).value_or(fit(field)), calibration);
  };
  // What holding some tensors to the end adds to the backward's peak.
  const auto held = [&](int64_t BlockCost::*field, PeakMoments BlockMoments::*whole) {
    const auto with = moments(whole), without = moments(&BlockMoments::backward);
    return with && without ? std::max<int64_t>(0, *with - *without) : fit(field);
  };
  f.output_bytes = fit(&BlockCost::output_bytes);
  f.input_copy_bytes = fit(&BlockCost::input_copy_bytes);
  f.kept_bytes = calibrated(fit(&BlockCost::kept_bytes), calibration);
  f.forward_peak = peak(&BlockCost::forward_peak, &BlockMoments::forward);
  f.forward_nograd_peak = peak(&BlockCost::forward_nograd_peak, &BlockMoments::forward_nograd);
  f.forward_left_bytes = calibrated(fit(&BlockCost::forward_left_bytes), calibration);
  f.backward_peak = peak(&BlockCost::backward_peak, &BlockMoments::backward);
  f.backward_peak_accumulating = peak(&BlockCost::backward_peak_accumulating, &BlockMoments::backward_accumulating);
  f.backward_held_input_bytes = held(&BlockCost::backward_held_input_bytes, &BlockMoments::backward_input_held);
  f.backward_held_by_segment_bytes = held(&BlockCost::backward_held_by_segment_bytes, &BlockMoments::backward_segment_end);
  f.backward_held_all_bytes = held(&BlockCost::backward_held_all_bytes, &BlockMoments::backward_all);
  f.recompute_start_extra_bytes = calibrated(fit(&BlockCost::recompute_start_extra_bytes), calibration);
  f.segment_kept_bytes = calibrated(fit(&BlockCost::segment_kept_bytes), calibration);
  f.handed_bytes = calibrated(fit(&BlockCost::handed_bytes), calibration);
  f.handed_new_bytes = calibrated(fit(&BlockCost::handed_new_bytes), calibration);
  f.recomputed_output_copy_bytes = calibrated(fit(&BlockCost::recomputed_output_copy_bytes), calibration);
  const bool block_alone = lo.recompute_peak >= 0 && hi.recompute_peak >= 0;
  f.recompute_peak = block_alone ? calibrated(fit(&BlockCost::recompute_peak), calibration) : -1;
  const bool streamed = lo.backward_peak_streamed >= 0 && hi.backward_peak_streamed >= 0;
  f.backward_peak_streamed = streamed ? calibrated(fit(&BlockCost::backward_peak_streamed), calibration) : -1;
}

// Block i's moments in c, or null where not recorded.
const BlockMoments* moments_of(const ChainProfile& c, size_t i) {
  return i < c.moments.size() ? &c.moments[i] : nullptr;
}

// The sizes the bytes were measured at, ascending: those below small (one and two samples), small
// and large, each once.
std::vector<const ChainProfile*> measured_sizes(const PrecisionProfile& p) {
  std::vector<const ChainProfile*> out;
  for (const ChainProfile& c : p.below) {
    if (c.micro_batch > 0 && c.micro_batch < p.small.micro_batch) out.push_back(&c);
  }
  out.push_back(&p.small);
  if (p.large.micro_batch > p.small.micro_batch) out.push_back(&p.large);
  return out;
}

// The two measured sizes whose line gives the bytes at m: those around it, or past the ends the
// nearest two (a size between two measured ones is on the line through them, above the true
// bytes where these are the highest of several lines: the safe side).
std::pair<const ChainProfile*, const ChainProfile*> sizes_around(const std::vector<const ChainProfile*>& sizes, int64_t m) {
  if (sizes.size() == 1) return {sizes.front(), sizes.front()};
  size_t i = 0;
  while (i + 2 < sizes.size() && sizes[i + 1]->micro_batch < m) ++i;
  return {sizes[i], sizes[i + 1]};
}

}  // namespace

ChainCosts block_costs_at(const PrecisionProfile& p, int64_t m) {
  ChainCosts c;
  const int64_t m1 = p.small.micro_batch, m2 = p.large.micro_batch;
  // Below the smallest timed size a block is not assumed any faster: fixed per-call costs
  // dominate there (these seconds only divide the chain's time among blocks).
  const int64_t mt = std::max(m, m1);
  // Bytes on the line through the measured sizes around m: a library may take another path at
  // one sample than from two on (oneDNN's convolutions: a workspace, or one weight-sized buffer
  // in backward at one sample, two from two), so one sample is not on the line through larger ones.
  const auto [lo, hi] = sizes_around(measured_sizes(p), m);
  for (size_t i = 0; i < p.small.blocks.size(); ++i) {
    const BlockCost& s = p.small.blocks[i];
    const BlockCost& l = p.large.blocks[i];
    BlockCost f;
    f.forward_seconds = fit_line(m1, s.forward_seconds, m2, l.forward_seconds, mt);
    f.backward_seconds = fit_line(m1, s.backward_seconds, m2, l.backward_seconds, mt);
    fit_block_bytes(lo->blocks[i], moments_of(*lo, i), lo->micro_batch, hi->blocks[i], moments_of(*hi, i), hi->micro_batch,
                    m, p.calibration, f);
    f.output_kept = l.output_kept;
    f.recomputable = l.recomputable;
    f.input_copy_kept = l.input_copy_kept;
    f.keeps_own_output = l.keeps_own_output;
    f.segment_output_kept = l.segment_output_kept;
    f.shared_gradient_bytes = l.shared_gradient_bytes;
    f.param_bytes = s.param_bytes;
    f.cast_bytes = s.cast_bytes;
    c.blocks.push_back(f);
  }
  return c;
}

double block_seconds(const ChainProfile& c) {
  double s = 0;
  for (const auto& b : c.blocks) s += b.forward_seconds + b.backward_seconds;
  return s;
}

double fit_line(int64_t m1, double v1, int64_t m2, double v2, int64_t m) {
  if (m2 == m1) return v1;
  const double slope = (v2 - v1) / static_cast<double>(m2 - m1);
  return std::max(0.0, v1 + slope * static_cast<double>(m - m1));
}

int64_t fit_bytes(int64_t m1, int64_t v1, int64_t m2, int64_t v2, int64_t m) {
  return static_cast<int64_t>(std::llround(fit_line(m1, static_cast<double>(v1), m2, static_cast<double>(v2), m)));
}

int64_t calibrated(int64_t bytes, double calibration) {
  return static_cast<int64_t>(std::llround(static_cast<double>(bytes) * calibration));
}

}  // namespace memfit
