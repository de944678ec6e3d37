// Blockwise 8-bit Adam/AdamW (techniques/optimizer_8bit.h): the quantizer's error within its
// map's bound, blocks of zeros and of one huge value, non-finite gradients never reaching the
// state, parity with torch::optim::AdamW, a quarter of the bytes as the tracker counts them,
// and a bit-exact save/load round trip. Also the optimizer value's 8-bit form, and the state
// handed back in fp32 to torch's AdamW.
#include <sstream>

#include "test_util.h"

namespace memfit {
namespace {

// num_parameters values over three full blocks and a partial one, each block at its own scale.
at::Tensor blocks_at_scales(bool is_signed) {
  torch::manual_seed(1);
  const int64_t num_parameters = 3 * kQuantBlockSize + 100;
  at::Tensor x = at::randn({num_parameters});
  const double scales[] = {1e-6, 1.0, 1e4, 0.3};
  for (int64_t b = 0; b < 4; ++b) {
    const int64_t start = b * kQuantBlockSize;
    x.narrow(0, start, std::min(kQuantBlockSize, num_parameters - start)).mul_(scales[b]);
  }
  return is_signed ? x : x.square();
}

// max |x - dequantized| / absmax over each block.
std::vector<double> block_errors(const at::Tensor& x, const at::Tensor& restored, const at::Tensor& absmax) {
  std::vector<double> out;
  for (int64_t b = 0; b < absmax.numel(); ++b) {
    const int64_t start = b * kQuantBlockSize, length = std::min(kQuantBlockSize, x.numel() - start);
    const at::Tensor err = (x.narrow(0, start, length) - restored.narrow(0, start, length)).abs().max();
    out.push_back(err.item<double>() / absmax[b].item<double>());
  }
  return out;
}

TEST(Optimizer8BitTest, DynamicMapsAreSortedAndSpanTheirRange) {
  for (bool is_signed : {true, false}) {
    const DynamicMap map = DynamicMap::make(is_signed);
    ASSERT_EQ(map.values.numel(), 256);
    EXPECT_TRUE(at::all(map.values.narrow(0, 1, 255) > map.values.narrow(0, 0, 255)).item<bool>()) << "strictly sorted";
    EXPECT_EQ(map.values.max().item<float>(), 1.0f);
    EXPECT_TRUE(at::any(map.values == 0).item<bool>()) << "zero is exact";
    EXPECT_GE(map.values.min().item<float>(), is_signed ? -1.0f : 0.0f);
    // Non-linear: ~1e-7 relative values are still representable, and the top is fine-grained.
    EXPECT_LT(map.values.abs().masked_select(map.values != 0).min().item<float>(), 1e-6f);
    EXPECT_LT(map.max_error(), is_signed ? 0.0075 : 0.0040);
  }
}

TEST(Optimizer8BitTest, QuantizeDequantizeErrorPerBlockWithinTheMapsBound) {
  for (bool is_signed : {true, false}) {
    const at::Tensor x = blocks_at_scales(is_signed);
    const DynamicMap map = DynamicMap::make(is_signed);
    const BlockwiseCodes q = quantize_blockwise(x, map);
    ASSERT_EQ(q.codes.scalar_type(), at::kByte);
    ASSERT_EQ(q.codes.numel(), x.numel());
    ASSERT_EQ(q.absmax.numel(), 4);
    // The codes are those of the nearest entry, as a search over the midpoints finds them.
    const at::Tensor scale = q.absmax.repeat_interleave(kQuantBlockSize).narrow(0, 0, x.numel());
    EXPECT_TRUE(q.codes.equal(at::bucketize(x / scale, map.midpoints).to(at::kByte)));
    const at::Tensor restored = dequantize_blockwise(q.codes, q.absmax, map);
    const auto errors = block_errors(x, restored, q.absmax);
    for (size_t b = 0; b < errors.size(); ++b) {
      // The absmax is the block's own largest magnitude, stored exactly in fp32.
      const at::Tensor block = x.narrow(0, static_cast<int64_t>(b) * kQuantBlockSize,
                                        std::min(kQuantBlockSize, x.numel() - static_cast<int64_t>(b) * kQuantBlockSize));
      EXPECT_EQ(q.absmax[static_cast<int64_t>(b)].item<float>(), block.abs().max().item<float>());
      EXPECT_LE(errors[b], map.max_error() * (1 + 1e-5)) << (is_signed ? "signed" : "unsigned") << " block " << b;
      EXPECT_GT(errors[b], 0.0) << "8 bits cannot be exact for random values";
    }
  }
}

TEST(Optimizer8BitTest, AllZeroBlocksStayExactlyZero) {
  at::Tensor x = at::zeros({2 * kQuantBlockSize + 10});
  x.narrow(0, kQuantBlockSize, kQuantBlockSize).normal_();
  for (bool is_signed : {true, false}) {
    const DynamicMap map = DynamicMap::make(is_signed);
    const at::Tensor input = is_signed ? x : x.abs();
    const BlockwiseCodes q = quantize_blockwise(input, map);
    EXPECT_EQ(q.absmax[0].item<float>(), 0.0f);
    EXPECT_EQ(q.absmax[2].item<float>(), 0.0f);
    const at::Tensor restored = dequantize_blockwise(q.codes, q.absmax, map);
    EXPECT_TRUE(at::isfinite(restored).all().item<bool>()) << "no 0/0";
    EXPECT_TRUE(restored.narrow(0, 0, kQuantBlockSize).eq(0).all().item<bool>());
    EXPECT_TRUE(restored.narrow(0, 2 * kQuantBlockSize, 10).eq(0).all().item<bool>());
  }
}

TEST(Optimizer8BitTest, OneHugeValueCostsOnlyItsOwnBlock) {
  torch::manual_seed(2);
  at::Tensor x = at::randn({2 * kQuantBlockSize});
  x[17] = 1e30f;
  const DynamicMap map = DynamicMap::make(true);
  const BlockwiseCodes q = quantize_blockwise(x, map);
  const at::Tensor restored = dequantize_blockwise(q.codes, q.absmax, map);
  EXPECT_EQ(restored[17].item<float>(), 1e30f) << "the absmax itself is exact";
  // In its block the others are ~1e-30 of the absmax: below the map's smallest entry, they
  // become 0 (error within the bound); the next block keeps its own scale.
  EXPECT_TRUE(restored.narrow(0, 0, 17).eq(0).all().item<bool>());
  const auto errors = block_errors(x, restored, q.absmax);
  EXPECT_LE(errors[0], map.max_error());
  EXPECT_LE(errors[1], map.max_error() * (1 + 1e-5));
  EXPECT_LT((x.narrow(0, kQuantBlockSize, kQuantBlockSize) - restored.narrow(0, kQuantBlockSize, kQuantBlockSize))
                .abs()
                .max()
                .item<float>(),
            0.05f);
}

// A model with one tensor quantized (8192 weights) and one kept in fp32 (64 biases).
struct TwoTensors {
  torch::nn::Linear layer{nullptr};
  std::unique_ptr<Adam8bit> optimizer;
  explicit TwoTensors(Adam8bitOptions o = Adam8bitOptions(0.01)) {
    torch::manual_seed(3);
    layer = torch::nn::Linear(128, 64);
    optimizer = std::make_unique<Adam8bit>(layer->parameters(), o);
  }
  void step(double grad_scale, uint64_t seed) {
    torch::manual_seed(seed);
    for (auto& p : layer->parameters()) p.mutable_grad() = at::randn_like(p) * grad_scale;
    optimizer->step();
  }
  const Adam8bitParamState& state_of(const at::Tensor& p) const {
    return static_cast<const Adam8bitParamState&>(*optimizer->state().at(param_state_key(p)));
  }
};

std::vector<at::Tensor> state_copies(const Adam8bitParamState& s) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : read_param_state(s).tensors) out.push_back(t.defined() ? t.clone() : t);
  return out;
}

void expect_same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << " slot " << i;
    if (a[i].defined()) EXPECT_TRUE(a[i].equal(b[i])) << what << " slot " << i;
  }
}

// The decision tested: a parameter whose gradient holds inf or NaN (or whose square overflows)
// is not updated at all, its state left bit for bit; the other parameters step normally.
TEST(Optimizer8BitTest, NonFiniteGradientsLeaveThatParametersStateUnchanged) {
  TwoTensors m;
  m.step(0.1, 10);
  const at::Tensor& w = m.layer->weight;
  const at::Tensor& b = m.layer->bias;
  ASSERT_TRUE(m.state_of(w).quantized());
  ASSERT_FALSE(m.state_of(b).quantized());
  const float poison[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(), 1e20f};
  int64_t skipped = 0;
  for (float bad : poison) {
    const at::Tensor w_before = w.detach().clone(), b_before = b.detach().clone();
    const auto w_state = state_copies(m.state_of(w));
    const int64_t w_step = m.state_of(w).step(), b_step = m.state_of(b).step();
    w.mutable_grad() = at::randn_like(w) * 0.1;
    w.mutable_grad().view(-1)[4321] = bad;
    b.mutable_grad() = at::randn_like(b) * 0.1;
    m.optimizer->step();
    EXPECT_EQ(m.optimizer->skipped_updates(), ++skipped) << bad;
    EXPECT_TRUE(w.detach().equal(w_before)) << bad << ": weights untouched";
    expect_same(state_copies(m.state_of(w)), w_state, "weight state after a gradient with " + std::to_string(bad));
    EXPECT_EQ(m.state_of(w).step(), w_step);
    EXPECT_FALSE(b.detach().equal(b_before)) << "the finite parameter still steps";
    EXPECT_EQ(m.state_of(b).step(), b_step + 1);
  }
  m.step(0.1, 11);  // and training goes on with finite state
  for (const at::Tensor& t : state_copies(m.state_of(w))) {
    if (t.defined() && t.is_floating_point()) EXPECT_TRUE(at::isfinite(t).all().item<bool>());
  }
  EXPECT_TRUE(at::isfinite(w).all().item<bool>());
}

// Tensors under 4096 values keep fp32 moments, updated exactly as torch::optim does.
TEST(Optimizer8BitTest, SmallTensorsFollowTorchAdamWAndAdamBitForBit) {
  for (bool decoupled : {true, false}) {
    torch::manual_seed(4);
    torch::nn::Linear a(16, 8), b(16, 8);
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].detach().copy_(a->parameters()[i].detach());
    Adam8bit mine(a->parameters(), Adam8bitOptions(0.01).weight_decay(0.1).decoupled_weight_decay(decoupled));
    std::unique_ptr<torch::optim::Optimizer> theirs;
    if (decoupled) {
      theirs = std::make_unique<torch::optim::AdamW>(b->parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.1));
    } else {
      theirs = std::make_unique<torch::optim::Adam>(b->parameters(), torch::optim::AdamOptions(0.01).weight_decay(0.1));
    }
    for (int step = 0; step < 5; ++step) {
      for (size_t i = 0; i < a->parameters().size(); ++i) {
        const at::Tensor g = at::randn_like(a->parameters()[i]);
        a->parameters()[i].mutable_grad() = g.clone();
        b->parameters()[i].mutable_grad() = g.clone();
      }
      mine.step();
      theirs->step();
    }
    for (size_t i = 0; i < a->parameters().size(); ++i) {
      EXPECT_TRUE(a->parameters()[i].equal(b->parameters()[i])) << (decoupled ? "AdamW" : "Adam") << " parameter " << i;
    }
  }
}

// The fused CPU step (one pass per block) against the tensor-op step every device runs: the
// same weights and the same codes, up to the rounding of LibTorch's vectorized kernels.
TEST(Optimizer8BitTest, FusedCpuStepMatchesTheTensorOpStep) {
  for (bool decoupled : {true, false}) {
    torch::manual_seed(7);
    torch::nn::Linear a(300, 70), b(300, 70);  // 21000 weights: 10 full blocks and one of 520 values
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].detach().copy_(a->parameters()[i].detach());
    const auto options = Adam8bitOptions(0.01).weight_decay(0.1).decoupled_weight_decay(decoupled);
    Adam8bit fused(a->parameters(), Adam8bitOptions(options).fused_cpu(true));
    Adam8bit tensor_ops(b->parameters(), Adam8bitOptions(options).fused_cpu(false));
    for (int step = 0; step < 6; ++step) {
      for (size_t i = 0; i < a->parameters().size(); ++i) {
        const at::Tensor g = at::randn_like(a->parameters()[i]) * (step + 1);
        a->parameters()[i].mutable_grad() = g.clone();
        b->parameters()[i].mutable_grad() = g.clone();
      }
      fused.step();
      tensor_ops.step();
    }
    const std::string what = decoupled ? "AdamW" : "Adam";
    const at::Tensor wa = a->weight.detach(), wb = b->weight.detach();
    const double max_diff = (wa - wb).abs().max().item<double>();
    RecordProperty(what + "_weights_max_abs_diff", std::to_string(max_diff));  // 0 here: bit-equal on this machine
    EXPECT_TRUE(at::allclose(wa, wb, 1e-6, 1e-7)) << what << ": max |diff| " << max_diff;
    const auto& sa = static_cast<const Adam8bitParamState&>(*fused.state().at(param_state_key(a->weight)));
    const auto& sb = static_cast<const Adam8bitParamState&>(*tensor_ops.state().at(param_state_key(b->weight)));
    ASSERT_TRUE(sa.quantized() && sb.quantized());
    for (const auto& [x, y] : {std::pair(sa.exp_avg_codes(), sb.exp_avg_codes()), std::pair(sa.exp_avg_sq_codes(), sb.exp_avg_sq_codes())}) {
      const int64_t differing = x.ne(y).sum().item<int64_t>();
      RecordProperty(what + "_codes_differing", std::to_string(differing));
      EXPECT_LE(differing, x.numel() / 1000) << what << ": codes differing (a value on a midpoint rounds either way)";
    }
    EXPECT_TRUE(at::allclose(sa.exp_avg_absmax(), sb.exp_avg_absmax(), 1e-6, 0)) << what;
    EXPECT_TRUE(at::allclose(sa.exp_avg_sq_absmax(), sb.exp_avg_sq_absmax(), 1e-6, 0)) << what;
  }
}

// State carried into 8 bits and back (a plan's Adam8bit handed back to the user's AdamW): the
// step count kept, the moments shaped as the parameter, each within its block's absmax times the
// map's max_error of the moment carried in; a small tensor's fp32 moments as they were.
TEST(Optimizer8BitTest, Fp32StateFromEightBitIsWithinTheMapsBoundOfTheStateCarriedIn) {
  torch::manual_seed(3);
  const at::Tensor param = at::zeros({3, kQuantBlockSize + 100});  // 3 full blocks and one of 300 values
  const at::Tensor m = at::randn_like(param) * 1e-2, v = at::randn_like(param).square() * 1e-4;
  const auto eight = adam8bit_state_from_fp32(7, m, v);
  ASSERT_TRUE(eight->quantized());
  const AdamFp32State back = fp32_state_from_adam8bit(*eight, param);
  EXPECT_EQ(back.step, 7);
  const std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> moments[] = {
      {back.exp_avg, m, eight->exp_avg_absmax(), true}, {back.exp_avg_sq, v, eight->exp_avg_sq_absmax(), false}};
  for (const auto& [moment, original, absmax, is_signed] : moments) {
    ASSERT_EQ(moment.sizes(), param.sizes());
    ASSERT_EQ(moment.scalar_type(), at::kFloat);
    for (double e : block_errors(original.reshape(-1), moment.reshape(-1), absmax)) {
      EXPECT_LE(e, dynamic_map(is_signed).max_error() * (1 + 1e-5)) << (is_signed ? "exp_avg" : "exp_avg_sq");
    }
  }
  const at::Tensor small = at::zeros({10, 10});
  const AdamFp32State kept = fp32_state_from_adam8bit(*adam8bit_state_from_fp32(2, small + 1, small + 2), small);
  EXPECT_EQ(kept.step, 2);
  EXPECT_TRUE(kept.exp_avg.equal(small + 1) && kept.exp_avg_sq.equal(small + 2));
}

// What the state is given back for: torch's AdamW, stepping from it, makes the very step the
// 8-bit optimizer would have made (both read the same dequantized moments, with the same math).
TEST(Optimizer8BitTest, Fp32AdamWFromTheGivenBackStateStepsAsTheEightBitOneWould) {
  torch::manual_seed(4);
  at::Tensor w8 = at::randn({3, kQuantBlockSize + 100}).requires_grad_();
  Adam8bit eight({w8}, Adam8bitOptions(1e-2).fused_cpu(false));  // the step that reads the moments as tensors
  for (int s = 0; s < 3; ++s) {
    w8.mutable_grad() = at::randn_like(w8);
    eight.step();
  }
  const auto& state = static_cast<const Adam8bitParamState&>(*eight.state().at(param_state_key(w8)));
  const AdamFp32State back = fp32_state_from_adam8bit(state, w8);
  EXPECT_EQ(back.step, 3);
  const at::Tensor read = dequantize_blockwise(state.exp_avg_codes(), state.exp_avg_absmax(), dynamic_map(true));
  EXPECT_TRUE(back.exp_avg.reshape(-1).equal(read)) << "the moment as the 8-bit step reads it";
  at::Tensor w32 = w8.detach().clone().requires_grad_();
  torch::optim::AdamW fp32({w32}, torch::optim::AdamWOptions(1e-2));
  auto given = std::make_unique<torch::optim::AdamWParamState>();
  given->step(back.step);
  given->exp_avg(back.exp_avg.clone());
  given->exp_avg_sq(back.exp_avg_sq.clone());
  fp32.state()[param_state_key(w32)] = std::move(given);
  const at::Tensor g = at::randn_like(w8);
  w8.mutable_grad() = g.clone();
  w32.mutable_grad() = g.clone();
  eight.step();
  fp32.step();
  EXPECT_TRUE(w32.equal(w8)) << "max |diff| " << (w32 - w8).abs().max().item<double>();
}

// A small regression MLP trained by each optimizer on the same data (full batch).
struct Regression {
  torch::nn::Sequential net;
  std::vector<at::Tensor> initial;
  at::Tensor x, y;
  Regression() {
    torch::manual_seed(5);
    net = torch::nn::Sequential(torch::nn::Linear(64, 128), torch::nn::GELU(), torch::nn::Linear(128, 64),
                                torch::nn::GELU(), torch::nn::Linear(64, 1));
    for (const auto& p : net->parameters()) initial.push_back(p.detach().clone());
    torch::manual_seed(6);
    x = at::randn({2048, 64});
    y = at::sin(x.narrow(1, 0, 4).sum(1, true)) + 0.3 * at::randn({2048, 1});
  }
  std::vector<double> train(torch::optim::Optimizer& optimizer, int steps) {
    std::vector<double> losses;
    for (int s = 0; s < steps; ++s) {
      optimizer.zero_grad();
      const at::Tensor loss = torch::mse_loss(net->forward(x), y);
      loss.backward();
      optimizer.step();
      losses.push_back(loss.item<double>());
    }
    return losses;
  }
  // |theta - other's theta| / |other's theta - theta at the start|, over all parameters.
  double drift_from(const Regression& other) const {
    double apart = 0, moved = 0;
    for (size_t i = 0; i < initial.size(); ++i) {
      const at::Tensor mine = net->parameters()[i].detach(), theirs = other.net->parameters()[i].detach();
      apart += (mine - theirs).square().sum().item<double>();
      moved += (theirs - other.initial[i]).square().sum().item<double>();
    }
    return std::sqrt(apart / moved);
  }
};

TEST(Optimizer8BitTest, EightBitAdamWFollowsFp32AdamWClosely) {
  Regression fp32, q8;
  torch::optim::AdamW reference(fp32.net->parameters(), torch::optim::AdamWOptions(1e-3));
  Adam8bit mine(q8.net->parameters(), Adam8bitOptions(1e-3));
  std::vector<double> a, b;
  // 60 steps (the loss falls to half). Past that the model memorizes its 2048 samples and
  // any difference grows: by step 100 the drift is ~0.105 (8-bit's loss then slightly lower).
  for (int round = 0; round < 3; ++round) {  // 3 x 20 steps
    const auto more_a = fp32.train(reference, 20), more_b = q8.train(mine, 20);
    a.insert(a.end(), more_a.begin(), more_a.end());
    b.insert(b.end(), more_b.begin(), more_b.end());
    const double drift = q8.drift_from(fp32);
    RecordProperty("drift_" + std::to_string(20 * (round + 1)), std::to_string(drift));
    EXPECT_LT(drift, 0.1) << "after " << 20 * (round + 1) << " steps, the 8-bit weights stay within 10% of the way fp32 moved";
  }
  EXPECT_LT(a.back(), 0.5 * a.front()) << "the reference learns";
  for (size_t s = 0; s < a.size(); s += 10) EXPECT_NEAR(b[s], a[s], 0.02 * a[s]) << "loss at step " << s;
}

// The bytes as memfit counts them: the tracker over a real step of each.
TEST(Optimizer8BitTest, StateBytesAreAQuarterOfFp32AsTheTrackerCounts) {
  test::use_memfit_allocator();
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  torch::nn::Sequential model(torch::nn::Linear(512, 512), torch::nn::Linear(512, 100));
  const int64_t maps = dynamic_maps_bytes();  // made once per process, here if not before
  EXPECT_EQ(maps, 2 * (4 * 256 + 4 * 255 + 65536 + 4 * 65536));
  for (auto& p : model->parameters()) p.mutable_grad() = at::randn_like(p);
  const int64_t before = tracker->current(test::cpu_counted());
  Adam8bit optimizer(model->parameters());
  optimizer.step();
  const int64_t state = tracker->current(test::cpu_counted()) - before;
  int64_t expected = 0;  // one byte per value and an fp32 absmax per block, per moment
  for (const auto& p : model->parameters()) {
    expected += p.numel() < kMin8bitNumel ? 8 * p.numel() : 2 * (p.numel() + 4 * num_quant_blocks(p.numel()));
  }
  EXPECT_EQ(state, expected);
  int64_t held = 0;  // the same tensors the breakdown counts as optimizer state
  for (const auto& t : optimizer_state_tensors(optimizer)) held += static_cast<int64_t>(t.nbytes());
  EXPECT_EQ(held, expected);
  const OptimizerCost fp32 = measure_optimizer(OptimizerSpec{}, model->parameters(), *tracker);
  EXPECT_EQ(fp32.state_bytes, 2 * parameter_bytes(*model));
  EXPECT_LE(static_cast<double>(state), 0.27 * static_cast<double>(fp32.state_bytes));
  RecordProperty("ratio", std::to_string(static_cast<double>(state) / static_cast<double>(fp32.state_bytes)));
  // What the planner is given: the state alone, the maps (made above) being resident already.
  const OptimizerCost q8 = measure_optimizer(OptimizerSpec{}.with_state(StatePrecision::k8Bit), model->parameters(), *tracker);
  EXPECT_EQ(q8.state, StatePrecision::k8Bit);
  EXPECT_EQ(q8.state_bytes, expected);
}

TEST(Optimizer8BitTest, SaveAndLoadRoundTripBitExactly) {
  TwoTensors a;
  for (uint64_t s = 0; s < 3; ++s) a.step(0.1, 20 + s);
  std::stringstream bytes;
  {
    torch::serialize::OutputArchive archive;
    a.optimizer->save(archive);
    archive.save_to(bytes);
  }
  TwoTensors b;
  for (size_t i = 0; i < 2; ++i) b.layer->parameters()[i].detach().copy_(a.layer->parameters()[i].detach());
  {
    torch::serialize::InputArchive archive;
    archive.load_from(bytes);
    b.optimizer->load(archive);
  }
  for (const auto& p : a.layer->parameters()) {
    const at::Tensor q = p.is_same(a.layer->weight) ? b.layer->weight : b.layer->bias;
    expect_same(state_copies(b.state_of(q)), state_copies(a.state_of(p)), "loaded state");
    EXPECT_EQ(b.state_of(q).step(), a.state_of(p).step());
  }
  for (uint64_t s = 0; s < 2; ++s) {  // and both continue identically
    a.step(0.1, 30 + s);
    b.step(0.1, 30 + s);
  }
  EXPECT_TRUE(a.layer->weight.equal(b.layer->weight));
  EXPECT_TRUE(a.layer->bias.equal(b.layer->bias));
  // An fp32 AdamW's archive is refused, not read as empty 8-bit state.
  torch::optim::AdamW fp32(a.layer->parameters());
  a.step(0.1, 40);
  fp32.step();
  std::stringstream other;
  torch::serialize::OutputArchive out;
  fp32.save(out);
  out.save_to(other);
  torch::serialize::InputArchive in;
  in.load_from(other);
  EXPECT_THROW(b.optimizer->load(in), c10::Error);
}

TEST(Optimizer8BitTest, SpecBuildsItAndItsStateIsReadAndRebuilt) {
  OptimizerSpec spec;
  spec.state = StatePrecision::k8Bit;
  torch::manual_seed(7);
  torch::nn::Linear layer(128, 64);
  auto optimizer = make_optimizer(spec, layer->parameters());
  ASSERT_NE(dynamic_cast<Adam8bit*>(optimizer.get()), nullptr);
  for (auto& p : layer->parameters()) p.mutable_grad() = at::randn_like(p);
  optimizer->step();
  EXPECT_EQ(param_state_slots(spec), 6u);
  for (const auto& p : layer->parameters()) {
    const ParamStateRecord r = read_param_state(*optimizer->state().at(param_state_key(p)));
    ASSERT_EQ(r.tensors.size(), param_state_slots(spec));
    const ParamStateRecord back = read_param_state(*make_param_state(spec, r));
    EXPECT_EQ(back.step, 1);
    expect_same(back.tensors, r.tensors, "rebuilt state");
    for (size_t slot = 0; slot < r.tensors.size(); ++slot) {
      if (!r.tensors[slot].defined()) continue;
      const at::Tensor empty = empty_param_state_slot(spec, slot, p);
      EXPECT_EQ(empty.sizes(), r.tensors[slot].sizes()) << "slot " << slot;
      EXPECT_EQ(empty.scalar_type(), r.tensors[slot].scalar_type()) << "slot " << slot;
    }
  }
  EXPECT_EQ(optimizer_state_tensors(*optimizer).size(), 6u);  // weight: codes + absmax x 2; bias: 2 fp32
  const OptimizerSpec back = optimizer_spec_from_json(optimizer_spec_json(spec));
  EXPECT_EQ(back.state, StatePrecision::k8Bit);
  EXPECT_NE(spec.describe().find("8-bit state"), std::string::npos);
}

TEST(Optimizer8BitTest, EightBitStateIsForAdamAndAdamWOnly) {
  OptimizerSpec spec;
  spec.family = OptimizerFamily::kSGD;
  spec.state = StatePrecision::k8Bit;
  try {
    check_optimizer_spec(spec);
    FAIL() << "8-bit SGD accepted";
  } catch (const OptionError& e) {
    EXPECT_EQ(e.option(), "optimizer.state");
    EXPECT_NE(std::string(e.what()).find("adam and adamw"), std::string::npos) << e.what();
  }
  spec.state = StatePrecision::kAuto;  // auto: nothing to choose for SGD, but not an error
  EXPECT_NO_THROW(check_optimizer_spec(spec));
  EXPECT_THROW(parse_state_precision("int8"), OptionError);
  nlohmann::json j = optimizer_spec_json(OptimizerSpec{});
  j["state"] = "4bit";
  EXPECT_THROW(optimizer_spec_from_json(j), std::invalid_argument);
  j.erase("state");  // written before the state precision existed: fp32
  EXPECT_EQ(optimizer_spec_from_json(j).state, StatePrecision::kFP32);
}

}  // namespace
}  // namespace memfit
