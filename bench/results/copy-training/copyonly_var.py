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
B, T = 16, 40
def nat_batch():
    rs = random.sample(rows, B); L = max(len(r[0]) for r in rs)
    ids = torch.full((B, L), 2); mask = torch.zeros(B, L, dtype=torch.bool)
    for i, (a, b) in enumerate(rs):
        ids[i, :len(a)] = torch.tensor(a); mask[i, :len(b)] = torch.tensor(b, dtype=torch.bool)
    return ids, mask
pool = torch.tensor([t for r in rows for t, k in zip(*r) if k])
def copy_row():
    L = random.randint(8, 48); a = random.randint(0, 64); b = random.randint(0, 24)
    if True:
        span = pool[torch.randint(len(pool), (L,))]
    else:
        r = random.choice(rows)[0]; st = random.randint(0, max(0, len(r) - L)); span = torch.tensor(r[st:st + L])
        L = len(span)
    fa = pool[torch.randint(len(pool), (a,))]; fb = pool[torch.randint(len(pool), (b,))]
    x = torch.cat([torch.ones(1, dtype=torch.long), fa, span, fb, span])
    m = torch.zeros(len(x), dtype=torch.bool); m[len(x) - L + 1:] = True  # predict span[1:] in the repeat
    return x, m
def copy_batch():
    rs = [copy_row() for _ in range(B)]; Lm = max(len(x) for x, _ in rs)
    ids = torch.full((B, Lm), 2); mk = torch.zeros(B, Lm, dtype=torch.bool)
    for i, (x, m) in enumerate(rs): ids[i, :len(x)] = x; mk[i, :len(m)] = m
    return ids, mk
t0 = time.time()
for s in range(steps):
    nat = torch.zeros(()); lg = None
    x, xm = copy_batch()
    cl = m(x, use_cache=False).logits[:, :-1][xm[:, 1:]]; ct = x[:, 1:][xm[:, 1:]]
    cp = F.cross_entropy(cl, ct)
    loss = copy_w * cp
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
    if s % 20 == 0 or s == steps - 1:
        nacc = 0.0; cacc = (cl.argmax(-1) == ct).float().mean().item()
        print(f'step {s} nat {nat.item():.3f} acc {nacc:.3f} copy {cp.item():.3f} acc {cacc:.3f} {time.time() - t0:.0f}s', flush=True)
m.save_pretrained(out)
