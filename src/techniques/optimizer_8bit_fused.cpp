// The fused CPU step of 8-bit Adam (see optimizer_8bit_fused.h). Compiled with
// -ffp-contract=off (CMakeLists.txt): every product and sum rounds as LibTorch's kernels do.
#include "techniques/optimizer_8bit_fused.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "memfit/techniques/optimizer_8bit.h"

namespace memfit {
namespace detail {
namespace {

// The bucket of a value in [-1, 1]: its fp32 pattern's top 16 bits as a signed number, + 32768.
inline int32_t bucket_of(float r) {
  int32_t bits;
  std::memcpy(&bits, &r, sizeof bits);
  return (bits >> 16) + 32768;
}

// The block's moments from their codes: entry * absmax, as dequantize_blockwise computes them.
void dequantize_block(const uint8_t* codes, float absmax, int64_t length, const float* entries, float* out) {
  for (int64_t i = 0; i < length; ++i) out[i] = entries[codes[i]] * absmax;
}

// Adam's math on one block, in place: m and v (the dequantized moments) become the updated
// ones, param the updated weights. No lookups here, so the compiler vectorizes it; every
// operation is the tensor-op path's, in its order (adam_math in optimizer_8bit.cpp).
template <bool kDecoupled>
void adam_block(float* __restrict param, const float* __restrict grad, float* __restrict m, float* __restrict v,
                int64_t length, const FusedAdamScalars& s) {
  const float beta1 = s.beta1, one_minus_beta1 = s.one_minus_beta1, beta2 = s.beta2, one_minus_beta2 = s.one_minus_beta2;
  const float sqrt_bc2 = s.sqrt_bias_correction2, eps = s.eps, neg_step_size = s.neg_step_size;
  const float decay = s.decay, weight_decay = s.weight_decay;
  for (int64_t i = 0; i < length; ++i) {
    float p = param[i], g = grad[i];
    if (kDecoupled) {
      p = p * decay;
    } else {
      g = g + weight_decay * p;
    }
    const float mi = m[i] * beta1 + one_minus_beta1 * g;
    const float vi = v[i] * beta2 + one_minus_beta2 * g * g;
    const float denom = std::sqrt(vi) / sqrt_bc2 + eps;
    param[i] = p + neg_step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

// max |x| (signed map) or max x (unsigned: a second moment is never negative), four running
// maxima so the loop is not one long dependency chain.
float block_absmax(const float* x, int64_t length, bool is_signed) {
  float top[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= length; i += 4) {
    for (int k = 0; k < 4; ++k) top[k] = std::max(top[k], is_signed ? std::fabs(x[i + k]) : x[i + k]);
  }
  for (; i < length; ++i) top[0] = std::max(top[0], is_signed ? std::fabs(x[i]) : x[i]);
  return std::max(std::max(top[0], top[1]), std::max(top[2], top[3]));
}

// Codes of a block's values (overwritten: each becomes x / absmax) and its absmax, as
// quantize_rows computes them: an all-zero block divides by FLT_MIN and keeps absmax 0.
void requantize_block(float* __restrict x, int64_t length, bool is_signed, uint8_t* __restrict codes, float* absmax,
                      const FusedMapTables& map) {
  const float top = block_absmax(x, length, is_signed);
  *absmax = top;
  const float divisor = std::max(top, std::numeric_limits<float>::min());
  for (int64_t i = 0; i < length; ++i) x[i] = x[i] / divisor;
  const uint8_t* bucket_codes = map.bucket_codes;
  const float* thresholds = map.bucket_thresholds;
  for (int64_t i = 0; i < length; ++i) {
    const int32_t b = bucket_of(x[i]);
    codes[i] = static_cast<uint8_t>(bucket_codes[b] + (x[i] > thresholds[b] ? 1 : 0));
  }
}

void step_block(float* param, const float* grad, int64_t block, int64_t n, const FusedMoment& exp_avg,
                const FusedMoment& exp_avg_sq, const FusedAdamScalars& s) {
  const int64_t first = block * kQuantBlockSize, length = std::min(kQuantBlockSize, n - first);
  float m[kQuantBlockSize], v[kQuantBlockSize];  // 16 KiB: the block's fp32 moments, in L1
  dequantize_block(exp_avg.codes + first, exp_avg.absmax[block], length, exp_avg.map.entries, m);
  dequantize_block(exp_avg_sq.codes + first, exp_avg_sq.absmax[block], length, exp_avg_sq.map.entries, v);
  if (s.decoupled) {
    adam_block<true>(param + first, grad + first, m, v, length, s);
  } else {
    adam_block<false>(param + first, grad + first, m, v, length, s);
  }
  requantize_block(m, length, true, exp_avg.codes + first, exp_avg.absmax + block, exp_avg.map);
  requantize_block(v, length, false, exp_avg_sq.codes + first, exp_avg_sq.absmax + block, exp_avg_sq.map);
}

}  // namespace

void fused_adam8bit_cpu(float* param, const float* grad, int64_t n, FusedMoment exp_avg, FusedMoment exp_avg_sq,
                        const FusedAdamScalars& s) {
  const int64_t blocks = num_quant_blocks(n);
  // 16 blocks (32Ki values) per task: enough work to pay for a thread's wake-up.
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) step_block(param, grad, b, n, exp_avg, exp_avg_sq, s);
  });
}

}  // namespace detail
}  // namespace memfit
