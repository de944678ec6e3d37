#include "memfit/zoo/workloads.h"

#include <torch/torch.h>

#include "memfit/errors.h"

namespace memfit {
namespace {

// The Bible is read once per process.
const std::string& bible() {
  static const std::string text = load_bible_text();
  return text;
}

}  // namespace

Workload make_workload(const ModelOptions& o) {
  Workload w;
  w.name = o.model;
  w.seed = o.seed;
  if (o.model == "gpt") {
    std::shared_ptr<TextDataset> data;
    if (o.data_file.empty()) {
      data = std::make_shared<TextDataset>(bible(), o.gpt.seq, "King James Bible");
    } else {
      data = std::make_shared<TextDataset>(read_text_file(o.data_file), o.gpt.seq, o.data_file);
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
