import torch, torch.nn as nn, torch.nn.functional as F
import memfit  # first: from here on its allocator counts every CPU tensor

class Layer(nn.Module):  # a Hugging Face-style layer: (hidden_states, attention_mask) -> (hidden_states,)
    def __init__(self, d):
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(d), nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    def forward(self, x, attention_mask):
        h = self.ln(x)
        x = x + self.attn(h, h, h, key_padding_mask=attention_mask == 0, need_weights=False)[0]
        return (x + self.mlp(x),)

class TinyLM(nn.Module):
    def __init__(self, vocab=256, d=128, layers=8):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))
    def forward(self, input_ids, attention_mask, labels):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask)[0]
        return {"loss": F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())}

def make_batch(n=32, seed=0):
    ids = torch.randint(0, 256, (n, 129), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "attention_mask": torch.ones(n, 128, dtype=torch.long), "labels": ids[:, 1:]}

if __name__ == "__main__":  # python/examples/tactics.py imports the model
    torch.manual_seed(0)
    model, batch = TinyLM(), make_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = memfit.fit(model, opt, lambda m, b: m(**b)["loss"], batch, budget="150MB")  # the plain step: 370 MB
    print(step.plan)
    for i in range(20):  # your loop, your DataLoader; memfit.remove(model) takes memfit's wrappers off
        loss = step(batch)
    print(f"loss {loss:.3f}; {step.verified}")
