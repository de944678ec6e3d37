#include "memfit/zoo/workloads.h"

#include <torch/torch.h>

#include <unistd.h>

#include <cstdio>

#include "memfit/errors.h"

namespace memfit {
namespace {

// The Bible is read once per process.
const std::string& bible() {
  static const std::string text = load_bible_text();
  return text;
}

// Parameters the model would have, roughly (as a double: absurd shapes must not overflow).
double estimated_parameters(const ModelOptions& o) {
  if (o.model == "gpt") {
    const double d = static_cast<double>(o.gpt.d_model), vocab = 256;  // at most one token per byte value
    return static_cast<double>(o.gpt.layers) * 12 * d * d + (2 * vocab + static_cast<double>(o.gpt.seq)) * d;
  }
  if (o.model == "cnn") {
    const double c = static_cast<double>(o.cnn.channels);
    return static_cast<double>(o.cnn.blocks) * 18 * c * c + 10 * c + 9 * c;
  }
  const double width = static_cast<double>(o.mlp.width);
  return static_cast<double>(o.mlp.layers) * width * width + 794 * width;
}

// Refuses, before anything is built, a model whose fp32 weights alone exceed this machine's
// memory: building it would only run for minutes and then fail.
void check_model_size(const ModelOptions& o) {
  const double weights = 4 * estimated_parameters(o);
  const double memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  if (weights <= memory) return;
  char text[160];
  std::snprintf(text, sizeof text, "a model of about %.3g parameters (%.3g GiB of fp32 weights) does not fit this machine's %.3g GiB",
                weights / 4, weights / (1 << 30), memory / (1 << 30));
  throw OptionError("model", "'" + o.model + "'", text);
}

}  // namespace

Workload make_workload(const ModelOptions& o) {
  check_option(o.model == "gpt" || o.model == "cnn" || o.model == "mlp", "model", "'" + o.model + "'",
               "expected gpt, cnn or mlp");
  check_model_size(o);
  Workload w;
  w.name = o.model;
  w.seed = o.seed;
  if (o.model == "gpt") {
    std::shared_ptr<TextDataset> data;
    if (o.data_file.empty()) {
      data = std::make_shared<TextDataset>(bible(), o.gpt.seq, "King James Bible", o.shortest);
    } else {
      data = std::make_shared<TextDataset>(read_text_file(o.data_file), o.gpt.seq, o.data_file, o.shortest);
    }
    GptConfig config = o.gpt;
    config.vocab = data->vocab_size();
    torch::manual_seed(o.seed);
    w.chain = make_gpt(config);
    w.data = data;
    w.sample_tokens = config.seq;
    w.loss = [](const at::Tensor& logits, const at::Tensor& target) {  // [B,T,V], [B,T]
      return torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
    };
    w.description = "gpt: " + std::to_string(config.layers) + " layers, d=" + std::to_string(config.d_model) +
                    ", " + std::to_string(config.heads) + " heads, seq " + std::to_string(config.seq) + "; " +
                    data->describe();
  } else if (o.model == "cnn" || o.model == "mlp") {
    auto data = std::make_shared<FashionMnistDataset>(default_fashion_mnist_dir());
    torch::manual_seed(o.seed);
    if (o.model == "cnn") {
      w.chain = make_cnn(o.cnn);
      w.description = "cnn: " + std::to_string(o.cnn.blocks) + " residual blocks, " +
                      std::to_string(o.cnn.channels) + " channels; " + data->describe();
    } else {
      w.chain = make_mlp(o.mlp);
      w.description = "mlp: " + std::to_string(o.mlp.layers) + " layers of " + std::to_string(o.mlp.width) +
                      "; " + data->describe();
    }
    w.data = data;
    w.loss = [](const at::Tensor& logits, const at::Tensor& target) {
      return torch::cross_entropy_loss(logits, target);
    };
  } else {
    throw OptionError("model", "'" + o.model + "'", "expected gpt, cnn or mlp");
  }
  return w;
}

}  // namespace memfit
