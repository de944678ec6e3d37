// optimizer_8bit_fused.h (private) — the CPU step of one 8-bit-state parameter in one pass:
// per block of kQuantBlockSize values, dequantize both moments, apply Adam's math to the
// moments and the weights, then requantize, with the block's fp32 moments held in a 16 KiB
// buffer (two rows of 2048 floats) instead of ~20 full-tensor passes of LibTorch ops. Blocks
// run in parallel over LibTorch's own thread pool (at::parallel_for).
//
// The arithmetic is the tensor-op path's, operation by operation in fp32 (same operand order,
// this file compiled without FMA contraction), and the quantization is the same bucket lookup,
// so both paths store the same codes up to the rounding of LibTorch's vectorized kernels.
#pragma once

#include <cstdint>

namespace memfit {
namespace detail {

// Adam's scalars for one step, as fp32 as LibTorch's CPU kernels use them on fp32 tensors.
struct FusedAdamScalars {
  float beta1, one_minus_beta1;      // exp_avg = exp_avg * beta1 + (1 - beta1) * grad
  float beta2, one_minus_beta2;      // exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
  float sqrt_bias_correction2, eps;  // denom = sqrt(exp_avg_sq) / sqrt(bc2) + eps
  float neg_step_size;               // param += -(lr / bc1) * (exp_avg / denom)
  bool decoupled;                    // AdamW: param *= decay first; Adam: grad += weight_decay * param
  float decay;                       // 1 - lr * weight_decay (AdamW)
  float weight_decay;                // (Adam's L2)
};

// A dynamic map's tables on the CPU (see DynamicMap): entries[256], and per fp32-pattern bucket
// (top 16 bits, shifted to 0..65535) the lowest code and the threshold above which the next.
struct FusedMapTables {
  const float* entries;
  const uint8_t* bucket_codes;
  const float* bucket_thresholds;
};

// One quantized moment: codes [n] and absmax [num_quant_blocks(n)], updated in place.
struct FusedMoment {
  uint8_t* codes;
  float* absmax;
  FusedMapTables map;
};

// Steps n values of a contiguous fp32 parameter with its contiguous fp32 gradient.
void fused_adam8bit_cpu(float* param, const float* grad, int64_t n, FusedMoment exp_avg, FusedMoment exp_avg_sq,
                        const FusedAdamScalars& s);

}  // namespace detail
}  // namespace memfit
