// The reference GPT: pre-LayerNorm transformer, causal self-attention, GELU MLP, dropout.
// Shapes: B batch, T sequence, d model width, H heads, hd = d / H, V vocabulary.
#include <torch/torch.h>

#include <cmath>
#include <stdexcept>

#include "memfit/zoo/models.h"
#include "memfit/errors.h"

namespace memfit {
namespace {

// LayerNorm in fp32: under CPU autocast on LibTorch 1.13, layer_norm with a bf16 input and
// fp32 weight throws, so the input is brought back to fp32 first (a no-op when it already is).
at::Tensor layer_norm_fp32(torch::nn::LayerNorm& ln, const at::Tensor& x) {
  return ln->forward(x.scalar_type() == at::kFloat ? x : x.to(at::kFloat));
}

// ATen's linear, the op Python's nn.Linear calls. LibTorch's C++ LinearImpl::forward (1.13 and
// 2.x) runs a 3-d input as matmul, then `+= bias` outside autocast's reach: under bf16 autocast
// each call converts to add the fp32 bias into the bf16 product (a few percent of a bf16 step
// of the default GPT). at::linear is autocast's own op: one cached bf16 bias, fused.
at::Tensor linear(const torch::nn::Linear& layer, const at::Tensor& x) {
  return at::linear(x, layer->weight, layer->bias);
}

struct EmbedImpl : torch::nn::Module {
  EmbedImpl(int64_t vocab, int64_t seq, int64_t d, double p)
      : tokens(register_module("tokens", torch::nn::Embedding(vocab, d))),
        positions(register_module("positions", torch::nn::Embedding(seq, d))),
        dropout(register_module("dropout", torch::nn::Dropout(p))) {}
  at::Tensor forward(const at::Tensor& idx) {  // [B, T] int64 -> [B, T, d] float
    const auto t = idx.size(1);
    auto pos = torch::arange(t, idx.options().dtype(at::kLong));
    return dropout(tokens(idx) + positions(pos));
  }
  torch::nn::Embedding tokens, positions;
  torch::nn::Dropout dropout;
};

struct AttentionHalfImpl : torch::nn::Module {
  AttentionHalfImpl(int64_t d, int64_t h, double p)
      : heads(h),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        qkv(register_module("qkv", torch::nn::Linear(d, 3 * d))),
        proj(register_module("proj", torch::nn::Linear(d, d))),
        attn_dropout(register_module("attn_dropout", torch::nn::Dropout(p))),
        resid_dropout(register_module("resid_dropout", torch::nn::Dropout(p))) {}

  at::Tensor forward(const at::Tensor& x) {  // [B, T, d] -> [B, T, d]
    const auto b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads;
    auto parts = linear(qkv, layer_norm_fp32(ln, x)).chunk(3, -1);        // 3 x [B, T, d]
    auto q = parts[0].view({b, t, heads, hd}).transpose(1, 2);   // [B, H, T, hd]
    auto k = parts[1].view({b, t, heads, hd}).transpose(1, 2);
    auto v = parts[2].view({b, t, heads, hd}).transpose(1, 2);
    q = q * (1.0 / std::sqrt(static_cast<double>(hd)));
    auto scores = torch::matmul(q, k.transpose(-2, -1));          // [B, H, T, T]: the big one
    auto future = torch::ones({t, t}, x.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    auto att = attn_dropout(torch::softmax(scores, -1));
    auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({b, t, d});
    return x + resid_dropout(linear(proj, y));
  }
  int64_t heads;
  torch::nn::LayerNorm ln;
  torch::nn::Linear qkv, proj;
  torch::nn::Dropout attn_dropout, resid_dropout;
};

struct MlpHalfImpl : torch::nn::Module {
  MlpHalfImpl(int64_t d, double p)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc(register_module("fc", torch::nn::Linear(d, 4 * d))),
        out(register_module("out", torch::nn::Linear(4 * d, d))),
        dropout(register_module("dropout", torch::nn::Dropout(p))) {}
  at::Tensor forward(const at::Tensor& x) {  // [B, T, d] -> [B, T, d], hidden [B, T, 4d]
    return x + dropout(linear(out, torch::gelu(linear(fc, layer_norm_fp32(ln, x)))));
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc, out;
  torch::nn::Dropout dropout;
};

struct HeadImpl : torch::nn::Module {
  HeadImpl(int64_t d, int64_t vocab)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        logits(register_module("logits", torch::nn::Linear(torch::nn::LinearOptions(d, vocab).bias(false)))) {}
  at::Tensor forward(const at::Tensor& x) { return linear(logits, layer_norm_fp32(ln, x)); }  // [B, T, V]
  torch::nn::LayerNorm ln;
  torch::nn::Linear logits;
};

}  // namespace

std::shared_ptr<Chain> make_gpt(const GptConfig& c) {
  const std::pair<const char*, int64_t> sizes[] = {
      {"gpt.vocab", c.vocab}, {"gpt.layers", c.layers}, {"gpt.d_model", c.d_model}, {"gpt.heads", c.heads}, {"gpt.seq", c.seq}};
  for (const auto& [name, value] : sizes) check_option(value >= 1, name, value, "expected a positive integer");
  check_option(c.d_model % c.heads == 0, "gpt.heads", c.heads, "must divide d_model (" + std::to_string(c.d_model) + ")");
  check_option(c.dropout >= 0 && c.dropout < 1, "gpt.dropout", c.dropout, "expected 0 <= dropout < 1");
  auto chain = std::make_shared<Chain>();
  chain->add("embed", std::make_shared<EmbedImpl>(c.vocab, c.seq, c.d_model, c.dropout));
  for (int64_t i = 0; i < c.layers; ++i) {
    chain->add("attn" + std::to_string(i), std::make_shared<AttentionHalfImpl>(c.d_model, c.heads, c.dropout));
    chain->add("mlp" + std::to_string(i), std::make_shared<MlpHalfImpl>(c.d_model, c.dropout));
  }
  chain->add("head", std::make_shared<HeadImpl>(c.d_model, c.vocab));
  return chain;
}

}  // namespace memfit
