#include "memfit/techniques/optimizer_8bit.h"

#include "memfit/compat.h"
#include "techniques/optimizer_8bit_fused.h"

#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <mutex>

namespace memfit {
namespace {

using torch::optim::OptimizerParamGroup;

// Blocks updated together: whole blocks, so a chunk's absmax values are its own; 256 blocks
// (512Ki values) keep the step's fp32 temporaries at a few MiB whatever the tensor's size.
constexpr int64_t kChunkBlocks = 256;

// Positive entries of the dynamic tree map (paper §2.2, after Dettmers 2016). With `bits` bits
// besides the sign (7 for the signed map; 8 for the unsigned, whose sign bit becomes one more
// fraction bit), a code of e leading zero bits (e = 0..6), one indicator bit, then
// f = bits - 1 - e fraction bits stands for 10^-e times the midpoint of one of 2^f equal bins
// of [0.1, 1]: large magnitudes get fine steps, tiny ones (down to ~1e-7) are still represented.
std::vector<double> tree_magnitudes(int bits) {
  std::vector<double> out;
  for (int e = 0; e <= 6; ++e) {
    const int64_t levels = int64_t{1} << (bits - 1 - e);
    const double scale = std::pow(10.0, -e);
    for (int64_t k = 0; k < levels; ++k) {
      const double lo = 0.1 + 0.9 * static_cast<double>(k) / static_cast<double>(levels);
      const double hi = 0.1 + 0.9 * static_cast<double>(k + 1) / static_cast<double>(levels);
      out.push_back(scale * (lo + hi) / 2);
    }
  }
  return out;
}

// The 256 sorted entries: +-magnitudes (signed: 254) or magnitudes (unsigned: 254), plus 0
// and 1 (the block's absmax itself is exact).
std::vector<float> map_entries(bool is_signed) {
  std::vector<double> entries{0.0, 1.0};
  for (double m : tree_magnitudes(is_signed ? 7 : 8)) {
    entries.push_back(m);
    if (is_signed) entries.push_back(-m);
  }
  std::sort(entries.begin(), entries.end());
  TORCH_INTERNAL_ASSERT(entries.size() == 256, "memfit: the dynamic map must hold 256 entries");
  return {entries.begin(), entries.end()};
}

// The bucket of a float in [-1, 1]: its top 16 bits as a signed number, shifted to 0..65535.
at::Tensor buckets_of(const at::Tensor& r) {
  return at::bitwise_right_shift(r.view(at::kInt), 16).add_(32768).view(-1);
}

// For each bucket: the code of its lowest value and the threshold above which the next code
// is nearer (+inf if none), found once with a search over the midpoints (bucketize).
void make_bucket_tables(DynamicMap& map) {
  const at::Tensor top = at::arange(-32768, 32768, at::kInt).mul_(65536);  // a bucket's first bit pattern
  const at::Tensor a = top.view(at::kFloat), b = at::bitwise_or(top, 0xFFFF).view(at::kFloat);
  // Buckets of NaN and inf patterns (never met: gradients are checked) map to code 0.
  const at::Tensor low = at::nan_to_num(at::minimum(a, b), 0, 0, 0), high = at::nan_to_num(at::maximum(a, b), 0, 0, 0);
  const at::Tensor code_low = at::bucketize(low, map.midpoints), code_high = at::bucketize(high, map.midpoints);
  TORCH_INTERNAL_ASSERT((code_high - code_low).le(1).all().item<bool>(),
                        "memfit: a bucket of the dynamic map holds two midpoints");
  const at::Tensor split = code_high.gt(code_low);
  map.bucket_codes = code_low.to(at::kByte);
  map.bucket_thresholds = at::where(split, map.midpoints.index_select(0, code_low.clamp_max(254)),
                                    at::full({}, std::numeric_limits<float>::infinity()));
}

// Rows of one block each: absmax per row, then each value divided by its row's absmax gets the
// code of its nearest map entry. An all-zero row keeps absmax 0 (its values dequantize to 0).
void quantize_rows(const at::Tensor& x, const DynamicMap& map, const at::Tensor& codes, const at::Tensor& absmax) {
  at::Tensor absmax_out = absmax;  // (the same storage: *_out takes a mutable handle)
  at::Tensor r = map.is_signed ? x.abs() : at::empty_like(x);
  at::amax_out(absmax_out, map.is_signed ? r : x, {1});
  // Dividing by at least FLT_MIN: an all-zero block gives zeros, never 0/0.
  at::div_out(r, x, absmax.clamp_min(std::numeric_limits<float>::min()).unsqueeze(1));
  const at::Tensor bucket = buckets_of(r);
  const at::Tensor above = at::gt(r.view(-1), map.bucket_thresholds.index_select(0, bucket));
  at::Tensor codes_out = codes.view(-1);
  at::add_out(codes_out, map.bucket_codes.index_select(0, bucket), above);
}

// Calls fn(first value, the values as rows of one block each, those blocks' absmax) for the
// full blocks, then for the partial last one.
template <class Fn>
void for_block_rows(int64_t num_parameters, const at::Tensor& values, const at::Tensor& absmax, Fn fn) {
  const int64_t full = num_parameters / kQuantBlockSize, rest = num_parameters % kQuantBlockSize;
  if (full > 0) {
    fn(0, values.narrow(0, 0, full * kQuantBlockSize).view({full, kQuantBlockSize}), absmax.narrow(0, 0, full));
  }
  if (rest > 0) fn(full * kQuantBlockSize, values.narrow(0, full * kQuantBlockSize, rest).view({1, rest}), absmax.narrow(0, full, 1));
}

// Whether each gradient may be used: finite, and its largest square too (so the second
// moment cannot overflow). One host synchronization for all of them.
std::vector<bool> usable_gradients(const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> flags;
  for (const auto& g : grads) {
    if (g.numel() == 0) {
      flags.push_back(at::ones({}, g.options().dtype(at::kBool)));
      continue;
    }
    const auto [low, high] = at::aminmax(g);  // one pass; NaN propagates
    flags.push_back(at::isfinite(at::maximum(high, -low).to(at::kFloat).square()));
  }
  std::vector<bool> out;
  if (flags.empty()) return out;
  const at::Tensor host = at::stack(flags).to(c10::kCPU);
  const bool* data = host.data_ptr<bool>();
  for (int64_t i = 0; i < host.numel(); ++i) out.push_back(data[i]);
  return out;
}

struct AdamStepScalars {
  double beta1, beta2, bias_correction1, bias_correction2;
};

AdamStepScalars step_scalars(const Adam8bitOptions& o, int64_t step) {
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  return {beta1, beta2, 1 - std::pow(beta1, static_cast<double>(step)), 1 - std::pow(beta2, static_cast<double>(step))};
}

// torch::optim::AdamW / Adam's update of one parameter (or a chunk of it) and its two moments,
// in this order, so that fp32 moments match torch::optim bit for bit.
void adam_math(at::Tensor param, at::Tensor grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const Adam8bitOptions& o,
               const AdamStepScalars& s) {
  if (o.weight_decay() != 0) {
    if (o.decoupled_weight_decay()) {
      param.mul_(1 - o.lr() * o.weight_decay());
    } else {
      grad = grad.add(param, o.weight_decay());
    }
  }
  exp_avg.mul_(s.beta1).add_(grad, 1 - s.beta1);
  exp_avg_sq.mul_(s.beta2).addcmul_(grad, grad, 1 - s.beta2);
  const at::Tensor denom = (exp_avg_sq.sqrt() / std::sqrt(s.bias_correction2)).add_(o.eps());
  param.addcdiv_(exp_avg, denom, -(o.lr() / s.bias_correction1));
}

// The fp32 scalars the fused CPU step uses: those LibTorch's kernels convert the tensor-op
// path's double arguments to on fp32 tensors.
detail::FusedAdamScalars fused_scalars(const Adam8bitOptions& o, const AdamStepScalars& s) {
  detail::FusedAdamScalars f{};
  f.beta1 = static_cast<float>(s.beta1);
  f.one_minus_beta1 = static_cast<float>(1 - s.beta1);
  f.beta2 = static_cast<float>(s.beta2);
  f.one_minus_beta2 = static_cast<float>(1 - s.beta2);
  f.sqrt_bias_correction2 = static_cast<float>(std::sqrt(s.bias_correction2));
  f.eps = static_cast<float>(o.eps());
  f.neg_step_size = static_cast<float>(-(o.lr() / s.bias_correction1));
  f.decoupled = o.decoupled_weight_decay();
  f.decay = static_cast<float>(1 - o.lr() * o.weight_decay());
  f.weight_decay = static_cast<float>(o.weight_decay());
  return f;
}

detail::FusedMapTables fused_tables(const DynamicMap& map) {
  return {map.values.data_ptr<float>(), map.bucket_codes.data_ptr<uint8_t>(), map.bucket_thresholds.data_ptr<float>()};
}

Adam8bitParamState new_state(const at::Tensor& p, const Adam8bitOptions& o) {
  Adam8bitParamState s;
  const int64_t n = p.numel();
  if (n < o.min_8bit_numel() || p.scalar_type() != at::kFloat) {
    s.exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    s.exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    return s;
  }
  // absmax 0: every value dequantizes to 0, whatever its code.
  const auto codes = p.options().dtype(at::kByte);
  const auto absmax = p.options().dtype(at::kFloat);
  s.exp_avg_codes(at::zeros({n}, codes)).exp_avg_absmax(at::zeros({num_quant_blocks(n)}, absmax));
  s.exp_avg_sq_codes(at::zeros({n}, codes)).exp_avg_sq_absmax(at::zeros({num_quant_blocks(n)}, absmax));
  return s;
}

}  // namespace

DynamicMap DynamicMap::make(bool is_signed, c10::Device device) {
  const std::vector<float> entries = map_entries(is_signed);
  DynamicMap map;
  map.is_signed = is_signed;
  map.values = at::tensor(entries, at::kFloat);
  map.midpoints = (map.values.narrow(0, 0, 255) + map.values.narrow(0, 1, 255)) / 2;
  make_bucket_tables(map);
  for (at::Tensor* t : {&map.values, &map.midpoints, &map.bucket_codes, &map.bucket_thresholds}) *t = t->to(device);
  return map;
}

const DynamicMap& dynamic_map(bool is_signed, c10::Device device) {
  static std::mutex mutex;
  static std::deque<DynamicMap> maps;  // a deque: references stay valid as it grows
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& m : maps) {
    if (m.is_signed == is_signed && m.values.device() == device) return m;
  }
  maps.push_back(DynamicMap::make(is_signed, device));
  return maps.back();
}

int64_t dynamic_maps_bytes() {
  int64_t bytes = 0;
  for (bool is_signed : {true, false}) {
    const DynamicMap& m = dynamic_map(is_signed);
    for (const at::Tensor* t : {&m.values, &m.midpoints, &m.bucket_codes, &m.bucket_thresholds}) {
      bytes += static_cast<int64_t>(t->nbytes());
    }
  }
  return bytes;
}

std::unique_ptr<Adam8bitParamState> adam8bit_state_from_fp32(int64_t step, const at::Tensor& exp_avg,
                                                             const at::Tensor& exp_avg_sq, int64_t min_8bit_numel) {
  auto s = std::make_unique<Adam8bitParamState>();
  s->step(step);
  at::NoGradGuard no_grad;
  if (exp_avg.numel() < min_8bit_numel) {
    s->exp_avg(exp_avg.detach().to(at::kFloat).clone()).exp_avg_sq(exp_avg_sq.detach().to(at::kFloat).clone());
    return s;
  }
  const BlockwiseCodes m = quantize_blockwise(exp_avg, dynamic_map(true, exp_avg.device()));
  const BlockwiseCodes v = quantize_blockwise(exp_avg_sq, dynamic_map(false, exp_avg_sq.device()));
  s->exp_avg_codes(m.codes).exp_avg_absmax(m.absmax).exp_avg_sq_codes(v.codes).exp_avg_sq_absmax(v.absmax);
  return s;
}

AdamFp32State fp32_state_from_adam8bit(const Adam8bitParamState& state, const at::Tensor& param) {
  if (!state.quantized()) return {state.step(), state.exp_avg(), state.exp_avg_sq()};
  TORCH_CHECK(state.exp_avg_codes().numel() == param.numel(), "memfit::fp32_state_from_adam8bit: an 8-bit state of ",
              state.exp_avg_codes().numel(), " values for a parameter of ", param.numel());
  const auto moment = [&](const at::Tensor& codes, const at::Tensor& absmax, bool is_signed) {
    return dequantize_blockwise(codes, absmax, dynamic_map(is_signed, codes.device())).view(param.sizes());
  };
  return {state.step(), moment(state.exp_avg_codes(), state.exp_avg_absmax(), true),
          moment(state.exp_avg_sq_codes(), state.exp_avg_sq_absmax(), false)};
}

double DynamicMap::max_error() const {
  const at::Tensor v = values.to(c10::kCPU, at::kDouble);
  const auto a = v.accessor<double, 1>();
  double bound = is_signed ? a[0] + 1.0 : a[0];  // below the lowest entry: -1 (signed) or 0
  for (int64_t i = 0; i + 1 < v.size(0); ++i) bound = std::max(bound, (a[i + 1] - a[i]) / 2);
  return std::max(bound, 1.0 - a[v.size(0) - 1]);
}

int64_t num_quant_blocks(int64_t num_parameters) { return (num_parameters + kQuantBlockSize - 1) / kQuantBlockSize; }

BlockwiseCodes quantize_blockwise(const at::Tensor& x, const DynamicMap& map) {
  const at::Tensor flat = x.detach().reshape(-1).to(at::kFloat);
  BlockwiseCodes q{at::empty({flat.numel()}, flat.options().dtype(at::kByte)),
                   at::empty({num_quant_blocks(flat.numel())}, flat.options())};
  quantize_blockwise_into(flat, map, q.codes, q.absmax);
  return q;
}

void quantize_blockwise_into(const at::Tensor& x, const DynamicMap& map, const at::Tensor& codes, const at::Tensor& absmax) {
  const int64_t n = x.numel();
  TORCH_CHECK(codes.numel() == n && absmax.numel() == num_quant_blocks(n), "memfit::quantize_blockwise_into: ", n,
              " values need ", n, " codes and ", num_quant_blocks(n), " absmax values");
  for_block_rows(n, codes, absmax, [&](int64_t start, const at::Tensor& code_rows, const at::Tensor& absmax_rows) {
    quantize_rows(x.narrow(0, start, code_rows.numel()).view(code_rows.sizes()), map, code_rows, absmax_rows);
  });
}

at::Tensor dequantize_blockwise(const at::Tensor& codes, const at::Tensor& absmax, const DynamicMap& map) {
  const int64_t n = codes.numel();
  TORCH_CHECK(absmax.numel() == num_quant_blocks(n), "memfit::dequantize_blockwise: ", n, " codes need ",
              num_quant_blocks(n), " absmax values, got ", absmax.numel());
  // Each code's map entry, then each block's entries times its absmax (in place, by rows).
  at::Tensor values = map.values.index_select(0, codes.reshape(-1).to(at::kInt));
  for_block_rows(n, values, absmax, [](int64_t, const at::Tensor& rows, const at::Tensor& absmax_rows) {
    rows.mul_(absmax_rows.unsqueeze(1));
  });
  return values;
}

// --- options and state: serialized field by field, as torch::optim's own ------------------

Adam8bitOptions::Adam8bitOptions(double lr) : lr_(lr) {}

void Adam8bitOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(decoupled_weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(min_8bit_numel);
}

void Adam8bitOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, decoupled_weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, min_8bit_numel);
}

void Adam8bitParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_codes);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_absmax);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq_codes);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq_absmax);
}

void Adam8bitParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_codes);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_absmax);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq_codes);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq_absmax);
}

// --- the optimizer -------------------------------------------------------------------------

Adam8bit::Adam8bit(std::vector<OptimizerParamGroup> param_groups, Adam8bitOptions defaults)
    : Optimizer(std::move(param_groups), std::make_unique<Adam8bitOptions>(defaults)) {
  const auto betas = defaults.betas();
  TORCH_CHECK(defaults.lr() >= 0, "memfit::Adam8bit: invalid learning rate ", defaults.lr());
  TORCH_CHECK(defaults.eps() >= 0, "memfit::Adam8bit: invalid eps ", defaults.eps());
  TORCH_CHECK(std::get<0>(betas) >= 0 && std::get<0>(betas) < 1, "memfit::Adam8bit: invalid beta1 ", std::get<0>(betas));
  TORCH_CHECK(std::get<1>(betas) >= 0 && std::get<1>(betas) < 1, "memfit::Adam8bit: invalid beta2 ", std::get<1>(betas));
  TORCH_CHECK(defaults.weight_decay() >= 0, "memfit::Adam8bit: invalid weight decay ", defaults.weight_decay());
}

Adam8bit::Adam8bit(std::vector<at::Tensor> params, Adam8bitOptions defaults)
    : Adam8bit({OptimizerParamGroup(std::move(params))}, defaults) {}

at::Tensor Adam8bit::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  std::vector<std::pair<at::Tensor, const Adam8bitOptions*>> todo;
  std::vector<at::Tensor> grads;
  for (auto& group : param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      todo.emplace_back(p, &static_cast<const Adam8bitOptions&>(group.options()));
      grads.push_back(p.grad());
    }
  }
  const std::vector<bool> usable = usable_gradients(grads);
  for (size_t i = 0; i < todo.size(); ++i) {
    if (!usable[i]) {
      ++skipped_updates_;  // weights, moments and step count left exactly as they were
      continue;
    }
    update(todo[i].first, grads[i], *todo[i].second);
  }
  return loss;
}

namespace {

// A quantized parameter's step with LibTorch ops over chunks of blocks: any device.
void update_quantized_tensor_ops(at::Tensor& flat_param, const at::Tensor& flat_grad, Adam8bitParamState& s,
                                 const Adam8bitOptions& o, const AdamStepScalars& scalars) {
  const DynamicMap& signed_map = dynamic_map(true, flat_param.device());
  const DynamicMap& unsigned_map = dynamic_map(false, flat_param.device());
  const int64_t n = flat_param.numel(), chunk = kChunkBlocks * kQuantBlockSize;
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t length = std::min(chunk, n - start);
    const int64_t first_block = start / kQuantBlockSize, blocks = num_quant_blocks(length);
    const at::Tensor m_codes = s.exp_avg_codes().narrow(0, start, length);
    const at::Tensor m_absmax = s.exp_avg_absmax().narrow(0, first_block, blocks);
    const at::Tensor v_codes = s.exp_avg_sq_codes().narrow(0, start, length);
    const at::Tensor v_absmax = s.exp_avg_sq_absmax().narrow(0, first_block, blocks);
    const at::Tensor exp_avg = dequantize_blockwise(m_codes, m_absmax, signed_map);
    const at::Tensor exp_avg_sq = dequantize_blockwise(v_codes, v_absmax, unsigned_map);
    adam_math(flat_param.narrow(0, start, length), flat_grad.narrow(0, start, length), exp_avg, exp_avg_sq, o, scalars);
    quantize_blockwise_into(exp_avg, signed_map, m_codes, m_absmax);
    quantize_blockwise_into(exp_avg_sq, unsigned_map, v_codes, v_absmax);
  }
}

// The same step fused per block on the CPU (optimizer_8bit_fused.h).
void update_quantized_fused(at::Tensor& flat_param, const at::Tensor& flat_grad, Adam8bitParamState& s,
                          const Adam8bitOptions& o, const AdamStepScalars& scalars) {
  for (const at::Tensor* t : {&s.exp_avg_codes(), &s.exp_avg_absmax(), &s.exp_avg_sq_codes(), &s.exp_avg_sq_absmax()}) {
    TORCH_CHECK(t->is_contiguous() && t->is_cpu(), "memfit::Adam8bit: 8-bit state must be contiguous CPU tensors here");
  }
  const detail::FusedMoment m{s.exp_avg_codes().data_ptr<uint8_t>(), s.exp_avg_absmax().data_ptr<float>(),
                              fused_tables(dynamic_map(true))};
  const detail::FusedMoment v{s.exp_avg_sq_codes().data_ptr<uint8_t>(), s.exp_avg_sq_absmax().data_ptr<float>(),
                              fused_tables(dynamic_map(false))};
  detail::fused_adam8bit_cpu(flat_param.data_ptr<float>(), flat_grad.data_ptr<float>(), flat_param.numel(), m, v,
                             fused_scalars(o, scalars));
}

}  // namespace

void Adam8bit::update(at::Tensor& param, const at::Tensor& grad, const Adam8bitOptions& o) {
  const auto key = compat::optimizer_state_key(param);
  auto it = state_.find(key);
  if (it == state_.end()) it = state_.emplace(key, std::make_unique<Adam8bitParamState>(new_state(param, o))).first;
  auto& s = static_cast<Adam8bitParamState&>(*it->second);
  s.step(s.step() + 1);
  const AdamStepScalars scalars = step_scalars(o, s.step());
  if (!s.quantized()) {
    adam_math(param, grad, s.exp_avg(), s.exp_avg_sq(), o, scalars);
    return;
  }
  // Flat views of whole blocks at a time (a non-contiguous parameter is updated on a copy).
  at::Tensor flat_param = param.is_contiguous() ? param.view(-1) : param.contiguous().view(-1);
  const at::Tensor flat_grad = grad.contiguous().view(-1).to(at::kFloat);
  if (o.fused_cpu() && flat_param.is_cpu()) {
    update_quantized_fused(flat_param, flat_grad, s, o, scalars);
  } else {
    update_quantized_tensor_ops(flat_param, flat_grad, s, o, scalars);
  }
  if (!param.is_contiguous()) param.copy_(flat_param.view(param.sizes()));
}

void Adam8bit::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<Adam8bitParamState, Adam8bitOptions>(archive, *this);
}

void Adam8bit::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<Adam8bitParamState, Adam8bitOptions>(archive, *this);
  check_loaded_state();
}

namespace {

// Whether `s` is the state this optimizer would have made for `p`: fp32 moments shaped as p
// (small tensors) or codes and absmax of p's size (the others).
bool state_fits(const Adam8bitParamState& s, const at::Tensor& p, const Adam8bitOptions& o) {
  const int64_t n = p.numel(), blocks = num_quant_blocks(n);
  auto sized = [](const at::Tensor& t, int64_t count) { return t.defined() && t.numel() == count; };
  if (n < o.min_8bit_numel() || p.scalar_type() != at::kFloat) {
    return sized(s.exp_avg(), n) && sized(s.exp_avg_sq(), n) && !s.quantized();
  }
  return sized(s.exp_avg_codes(), n) && sized(s.exp_avg_sq_codes(), n) && sized(s.exp_avg_absmax(), blocks) &&
         sized(s.exp_avg_sq_absmax(), blocks) && !s.exp_avg().defined() && !s.exp_avg_sq().defined();
}

}  // namespace

void Adam8bit::check_loaded_state() const {
  // Another optimizer's archive could read as states with missing tensors: refused, not stepped.
  for (const auto& group : param_groups()) {
    const auto& o = static_cast<const Adam8bitOptions&>(group.options());
    for (const auto& p : group.params()) {
      auto it = state_.find(compat::optimizer_state_key(p));
      if (it == state_.end()) continue;
      TORCH_CHECK(state_fits(static_cast<const Adam8bitParamState&>(*it->second), p, o),
                  "memfit::Adam8bit::load: the saved state of a parameter of ", p.numel(),
                  " values is not an 8-bit Adam state for it");
    }
  }
}

}  // namespace memfit
