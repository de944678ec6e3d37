// models.h — the reference models, each a Chain of blocks the planner reasons about.
//
// GPT (character level): blocks [embed, attn0, mlp0, attn1, mlp1, ..., head]. Attention and
// MLP halves of a transformer layer are separate blocks so that attention (whose B*H*T*T
// scores dominate activations) can be recomputed alone.
// CNN: [stem, res0, ..., res{N-1}, head] residual conv blocks on 28x28 images.
// MLP: [layer0, ..., layer{N-1}, head].
#pragma once

#include <cstdint>
#include <memory>

#include "memfit/runtime/chain.h"

namespace memfit {

struct GptConfig {
  int64_t vocab = 96;
  int64_t layers = 8;
  int64_t d_model = 256;
  int64_t heads = 8;
  int64_t seq = 128;
  double dropout = 0.1;
};

struct CnnConfig {
  int64_t blocks = 6;
  int64_t channels = 32;
  int64_t classes = 10;
};

struct MlpConfig {
  int64_t layers = 4;
  int64_t width = 512;
  int64_t classes = 10;
};

// Each throws std::invalid_argument naming a bad value (non-positive sizes, heads not
// dividing d_model).
std::shared_ptr<Chain> make_gpt(const GptConfig& config);
std::shared_ptr<Chain> make_cnn(const CnnConfig& config);
std::shared_ptr<Chain> make_mlp(const MlpConfig& config);


}  // namespace memfit
