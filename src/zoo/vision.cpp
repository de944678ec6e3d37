// The reference image models for 1x28x28 inputs: a residual CNN and an MLP.
#include <torch/torch.h>

#include <numeric>
#include <stdexcept>

#include "memfit/zoo/models.h"
#include "memfit/errors.h"

namespace memfit {
namespace {

struct StemImpl : torch::nn::Module {
  explicit StemImpl(int64_t channels)
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, channels, 3).padding(1)))) {}
  at::Tensor forward(const at::Tensor& x) { return torch::relu(conv(x)); }  // [B,1,28,28] -> [B,C,28,28]
  torch::nn::Conv2d conv;
};

// x + conv(relu(norm(conv(relu(norm(x)))))), shape-preserving [B, C, 28, 28].
struct ResidualImpl : torch::nn::Module {
  explicit ResidualImpl(int64_t c)
      : norm1(register_module("norm1", torch::nn::GroupNorm(std::gcd<int64_t>(c, 8), c))),
        conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(c, c, 3).padding(1)))),
        norm2(register_module("norm2", torch::nn::GroupNorm(std::gcd<int64_t>(c, 8), c))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(c, c, 3).padding(1)))) {}
  at::Tensor forward(const at::Tensor& x) {
    // GroupNorm in fp32: on LibTorch 1.13 it throws for a bf16 input with fp32 weights
    // (conv outputs are bf16 under autocast).
    auto h = conv1(torch::relu(norm1(x.to(at::kFloat))));
    return x + conv2(torch::relu(norm2(h.to(at::kFloat))));
  }
  torch::nn::GroupNorm norm1;
  torch::nn::Conv2d conv1;
  torch::nn::GroupNorm norm2;
  torch::nn::Conv2d conv2;
};

struct PoolHeadImpl : torch::nn::Module {
  PoolHeadImpl(int64_t c, int64_t classes) : fc(register_module("fc", torch::nn::Linear(c, classes))) {}
  at::Tensor forward(const at::Tensor& x) {  // [B, C, 28, 28] -> [B, classes]
    return fc(torch::relu(x).mean({2, 3}));
  }
  torch::nn::Linear fc;
};

struct DenseImpl : torch::nn::Module {
  DenseImpl(int64_t in, int64_t out, bool relu)
      : fc(register_module("fc", torch::nn::Linear(in, out))), relu(relu) {}
  at::Tensor forward(const at::Tensor& x) {  // [B, ...] -> [B, out]
    auto y = fc(x.dim() > 2 ? x.flatten(1) : x);
    return relu ? torch::relu(y) : y;
  }
  torch::nn::Linear fc;
  bool relu;
};

}  // namespace

std::shared_ptr<Chain> make_cnn(const CnnConfig& c) {
  check_option(c.blocks >= 1, "cnn.blocks", c.blocks, "expected a positive integer");
  check_option(c.channels >= 1, "cnn.channels", c.channels, "expected a positive integer");
  auto chain = std::make_shared<Chain>();
  chain->add("stem", std::make_shared<StemImpl>(c.channels));
  for (int64_t i = 0; i < c.blocks; ++i) {
    chain->add("res" + std::to_string(i), std::make_shared<ResidualImpl>(c.channels));
  }
  chain->add("head", std::make_shared<PoolHeadImpl>(c.channels, c.classes));
  return chain;
}

std::shared_ptr<Chain> make_mlp(const MlpConfig& c) {
  check_option(c.layers >= 1, "mlp.layers", c.layers, "expected a positive integer");
  check_option(c.width >= 1, "mlp.width", c.width, "expected a positive integer");
  auto chain = std::make_shared<Chain>();
  int64_t in = 28 * 28;
  for (int64_t i = 0; i < c.layers; ++i) {
    chain->add("layer" + std::to_string(i), std::make_shared<DenseImpl>(in, c.width, true));
    in = c.width;
  }
  chain->add("head", std::make_shared<DenseImpl>(in, c.classes, false));
  return chain;
}

}  // namespace memfit
