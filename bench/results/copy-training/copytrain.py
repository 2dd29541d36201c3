import sys, time, torch
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
src = sys.argv[1]; steps = int(sys.argv[2]); lr = float(sys.argv[3]); out = sys.argv[4]
m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
m.train()
opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0)
B, T = 16, 40
def batch():
    # random spans of natural-ish tokens repeated: prefix of random length then the repeat
    seq = torch.randint(300, 30000, (B, T))
    x = torch.cat([torch.ones(B, 1, dtype=torch.long), seq, seq], 1)
    return x
t0 = time.time()
for s in range(steps):
    x = batch()
    logits = m(x, use_cache=False).logits[:, T + 1:2 * T]
    tgt = x[:, T + 2:2 * T + 1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    opt.zero_grad(); loss.backward(); opt.step()
    if s % 20 == 0 or s == steps - 1:
        acc = (logits.argmax(-1) == tgt).float().mean().item()
        print(f'step {s} loss {loss.item():.3f} copy acc {acc:.3f} {time.time() - t0:.0f}s', flush=True)
m.save_pretrained(out)
