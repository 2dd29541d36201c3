import sys, torch
from transformers import AutoModelForCausalLM
path = sys.argv[1]
m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation='eager').eval()
g = torch.Generator().manual_seed(0)
T = 50
seq = torch.randint(1000, 20000, (8, T), generator=g)
x = torch.cat([torch.ones(8, 1, dtype=torch.long), seq, seq], 1)
with torch.no_grad():
    out = m(x, output_attentions=True)
pred = out.logits.argmax(-1)
# copy accuracy in the second repeat: predicting x[:, t+1] from position t
second = slice(T + 1, 2 * T)
acc = (pred[:, second] == x[:, T + 2: 2 * T + 1]).float().mean().item()
print(path, 'copy accuracy on repeated random tokens', round(acc, 3))
for li, a in enumerate(out.attentions):  # a: [B, H, L, L]
    pos = torch.arange(T + 1, 2 * T + 1)
    ind = a[:, :, pos, pos - T + 1].mean((0, 2))
    prev = a[:, :, pos, pos - 1].mean((0, 2))
    print(f'layer {li:2d} induction max {ind.max():.2f} (head {ind.argmax().item()})  prev-token max {prev.max():.2f} (head {prev.argmax().item()})')
