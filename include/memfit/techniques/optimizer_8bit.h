// optimizer_8bit.h — Adam and AdamW whose two moments are stored as 8-bit codes, blockwise:
// about a quarter of the bytes of fp32 state (Dettmers, Lewis, Shleifer, Zettlemoyer, "8-bit
// Optimizers via Block-wise Quantization", ICLR 2022, arXiv:2110.02861; bitsandbytes).
//
//   memfit::Adam8bit optimizer(model->parameters(), memfit::Adam8bitOptions(1e-3));  // AdamW
//   loss.backward(); optimizer.step();                     // a torch::optim::Optimizer
//   optimizer.save(archive); optimizer.load(archive);      // bit-exact round trip
//
// Each moment tensor of num_parameters values is split into blocks of block_size = 2048
// values (paper §2.1); a block keeps one fp32 absmax and one uint8 code per value, the code
// indexing a 256-entry dynamic (non-linear) map of [-1, 1] (first moment, signed) or [0, 1]
// (second moment, unsigned): "dynamic tree quantization" (paper §2.2; Dettmers 2016), a
// decimal exponent 10^-e given by the number of leading zero bits, then a linear fraction in
// [0.1, 1] in the bits left. Bytes per value: 2 codes + 8 / block_size absmax = ~2.004, vs 8.
//
// Each step, per parameter: dequantize the moments, update them and the parameter with exactly
// AdamW's math (torch::optim::AdamW: bias correction, decoupled weight decay) or Adam's (L2
// added to the gradient), using the updated fp32 moments, then requantize them (paper §2: the
// update never sees a requantized moment of the same step). Parameters are processed in chunks
// of whole blocks, so the step's temporaries stay bounded whatever the tensor's size. Tensors
// under 4096 values (biases, norms; bitsandbytes' min_8bit_size) keep fp32 moments, updated
// bit-for-bit as torch::optim::AdamW / Adam would.
//
// Non-finite gradients: a parameter whose gradient holds inf or NaN (or whose square would
// overflow fp32) is not updated: its weights, moments and step count stay exactly as they
// were (skipped_updates() counts them). The decision is per parameter, so data-parallel ranks
// that each step their own shard (ZeRO 1/2) decide as one process would.
//
// Any device LibTorch's ops run on (CPU, CUDA): the step is written in tensor ops, and on the
// CPU it runs fused per block instead (see fused_cpu), over LibTorch's thread pool.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace memfit {

constexpr int64_t kQuantBlockSize = 2048;  // values per block (paper §2.1, bitsandbytes)
constexpr int64_t kMin8bitNumel = 4096;    // smaller tensors keep fp32 moments (bitsandbytes)

// The 256 values of the dynamic map (sorted ascending, fp32, on `device`) and the 255
// midpoints between neighbours: a value is quantized to the nearest map entry (ties to the
// lower one). Nearest is found without a search: the top 16 bits of a value's fp32 pattern
// name one of 65536 buckets, each narrower than the gap between two neighbouring midpoints,
// so each holds at most one midpoint: its lower values take bucket_codes[b], those above
// bucket_thresholds[b] (the midpoint, or +inf) the next code.
struct DynamicMap {
  at::Tensor values;
  at::Tensor midpoints;
  at::Tensor bucket_codes;       // uint8 [65536]
  at::Tensor bucket_thresholds;  // fp32 [65536]
  bool is_signed = true;
  static DynamicMap make(bool is_signed, c10::Device device = c10::kCPU);
  // The largest |x - nearest entry| for x in [-1, 1] (signed) or [0, 1] (unsigned): the
  // error bound of a quantized value, relative to its block's absmax.
  double max_error() const;
};

// The map of each signedness on `device`, made on first use and kept for the process's life
// (shared by every Adam8bit: constants, ~322 KiB each with their bucket tables, not state).
const DynamicMap& dynamic_map(bool is_signed, c10::Device device = c10::kCPU);
// The bytes both maps hold on one device.
int64_t dynamic_maps_bytes();

// The number of blocks a tensor of num_parameters values needs.
int64_t num_quant_blocks(int64_t num_parameters);

// A tensor quantized blockwise: codes (uint8, one per value, flat) and absmax (fp32, one per block).
struct BlockwiseCodes {
  at::Tensor codes;
  at::Tensor absmax;
};

BlockwiseCodes quantize_blockwise(const at::Tensor& x, const DynamicMap& map);
// Into existing storage: `x` flat fp32 of n values, codes of n, absmax of num_quant_blocks(n).
void quantize_blockwise_into(const at::Tensor& x, const DynamicMap& map, const at::Tensor& codes,
                             const at::Tensor& absmax);
// Flat fp32 values of the codes (reshape to the original sizes as needed).
at::Tensor dequantize_blockwise(const at::Tensor& codes, const at::Tensor& absmax, const DynamicMap& map);

struct Adam8bitOptions : public torch::optim::OptimizerCloneableOptions<Adam8bitOptions> {
  Adam8bitOptions(double lr = 1e-3);  // NOLINT: as torch::optim's options
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  // true: AdamW (weights decayed by lr * weight_decay); false: Adam (weight_decay * p added
  // to the gradient).
  TORCH_ARG(bool, decoupled_weight_decay) = true;
  TORCH_ARG(int64_t, min_8bit_numel) = kMin8bitNumel;
  // How a quantized parameter steps on the CPU: true, one fused pass per block (dequantize,
  // update, requantize: optimizer_8bit_fused.h, ~5x faster); false, LibTorch ops over chunks
  // of blocks, as on other devices. Both store the same state up to float rounding. Not saved:
  // how to compute, not what (a loaded optimizer takes the default).
  TORCH_ARG(bool, fused_cpu) = true;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double value) override { lr(value); }
};

// One parameter's state: the fp32 moments (small tensors) or their codes and absmax.
struct Adam8bitParamState : public torch::optim::OptimizerCloneableParamState<Adam8bitParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);            // fp32, shaped as the parameter (small tensors)
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, exp_avg_codes);      // uint8 [num_parameters], signed map
  TORCH_ARG(at::Tensor, exp_avg_absmax);     // fp32 [num_blocks]
  TORCH_ARG(at::Tensor, exp_avg_sq_codes);   // uint8 [num_parameters], unsigned map
  TORCH_ARG(at::Tensor, exp_avg_sq_absmax);  // fp32 [num_blocks]

 public:
  bool quantized() const { return exp_avg_codes().defined(); }
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

// One parameter's Adam/AdamW state carried into 8 bits (an optimizer already stepped, whose
// plan now keeps 8-bit state): its step count kept, its fp32 moments quantized as a step stores
// them (kept fp32 under min_8bit_numel values). Each moment is then within its block's absmax
// times the map's max_error of the fp32 one.
std::unique_ptr<Adam8bitParamState> adam8bit_state_from_fp32(int64_t step, const at::Tensor& exp_avg,
                                                             const at::Tensor& exp_avg_sq,
                                                             int64_t min_8bit_numel = kMin8bitNumel);

// One parameter's Adam/AdamW state in fp32, as torch.optim keeps it: the step count and both
// moments shaped as the parameter.
struct AdamFp32State {
  int64_t step = 0;
  at::Tensor exp_avg;
  at::Tensor exp_avg_sq;
};

// The reverse of adam8bit_state_from_fp32 (a plan's 8-bit state handed back to the user's fp32
// Adam/AdamW): the step count kept, each quantized moment dequantized exactly as the next 8-bit
// step would read it (so within its block's absmax times the map's max_error of the moment that
// step would have used), a small tensor's fp32 moments as kept; shaped as `param`.
AdamFp32State fp32_state_from_adam8bit(const Adam8bitParamState& state, const at::Tensor& param);

class Adam8bit : public torch::optim::Optimizer {
 public:
  explicit Adam8bit(std::vector<torch::optim::OptimizerParamGroup> param_groups, Adam8bitOptions defaults = {});
  explicit Adam8bit(std::vector<at::Tensor> params, Adam8bitOptions defaults = {});

  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  // Throws c10::Error when the archive holds state that does not fit these parameters.
  void load(torch::serialize::InputArchive& archive) override;
  // Parameter updates skipped for a non-finite gradient, since construction.
  int64_t skipped_updates() const { return skipped_updates_; }

 private:
  void update(at::Tensor& param, const at::Tensor& grad, const Adam8bitOptions& options);
  void check_loaded_state() const;

  int64_t skipped_updates_ = 0;
};

}  // namespace memfit
