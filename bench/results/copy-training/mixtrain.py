import sys, time, random, torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from datasets import load_from_disk
torch.manual_seed(0); random.seed(0)
src, steps, lr, out, copy_w = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], float(sys.argv[5])
mode = sys.argv[6] if len(sys.argv) > 6 else 'random'
m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32); m.train()
opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0)
d = load_from_disk('checkpoints/smollm2-sharegpt/data/train')
rows = [(r['input_ids'][:256], r['loss_mask'][:256]) for r in d.select(range(1500))]
B, T = 8, 40
def nat_batch():
    rs = random.sample(rows, B); L = max(len(r[0]) for r in rs)
    ids = torch.full((B, L), 2); mask = torch.zeros(B, L, dtype=torch.bool)
    for i, (a, b) in enumerate(rs):
        ids[i, :len(a)] = torch.tensor(a); mask[i, :len(b)] = torch.tensor(b, dtype=torch.bool)
    return ids, mask
def copy_batch():
    if mode == 'random':
        seq = torch.randint(300, 30000, (B, T))
    else:  # spans of real response text
        seq = torch.stack([torch.tensor(r[0][len(r[0]) - T:]) for r in random.sample([r for r in rows if len(r[0]) > T + 20], B)])
    return torch.cat([torch.ones(B, 1, dtype=torch.long), seq, seq], 1)
t0 = time.time()
for s in range(steps):
    ids, mask = nat_batch()
    lg = m(ids, use_cache=False).logits[:, :-1]
    tgt = ids[:, 1:]; mk = mask[:, 1:]
    nat = F.cross_entropy(lg[mk], tgt[mk])
    x = copy_batch()
    cl = m(x, use_cache=False).logits[:, T + 1:2 * T]; ct = x[:, T + 2:2 * T + 1]
    cp = F.cross_entropy(cl.reshape(-1, cl.shape[-1]), ct.reshape(-1))
    loss = nat + copy_w * cp
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
    if s % 20 == 0 or s == steps - 1:
        nacc = (lg[mk].argmax(-1) == tgt[mk]).float().mean().item(); cacc = (cl.argmax(-1) == ct).float().mean().item()
        print(f'step {s} nat {nat.item():.3f} acc {nacc:.3f} copy {cp.item():.3f} acc {cacc:.3f} {time.time() - t0:.0f}s', flush=True)
m.save_pretrained(out)
