import sys, torch
from datasets import load_from_disk
from transformers import AutoModelForCausalLM
split = sys.argv[1]; n_rows = int(sys.argv[2]); model_dir = sys.argv[3]
d = load_from_disk(f'checkpoints/smollm2-sharegpt/data/{split}')
m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
def ngram_propose(ctx, lo=2, hi=5):
    # longest suffix n-gram (hi..lo) that occurred earlier; propose the token after its most recent earlier occurrence
    L = len(ctx)
    for n in range(hi, lo - 1, -1):
        if L < n + 1: continue
        suf = ctx[L - n:]
        for s in range(L - n - 1, -1, -1):
            if ctx[s:s + n] == suf:
                return ctx[s + n], n
    return None
import collections; stats = collections.defaultdict(lambda: [0, 0])
with torch.no_grad():
    for i in range(min(n_rows, len(d))):
        ids = d[i]['input_ids']; mask = d[i]['loss_mask']
        logits = m(torch.tensor([ids])).logits[0]
        pred = logits.argmax(-1).tolist()
        for t in range(1, len(ids)):
            if not mask[t]: continue
            ctx = ids[:t]; nxt = ids[t]
            r = ngram_propose(ctx); p = r[0] if r else None; n = r[1] if r else 0
            key = 'no_prop' if p is None else ('copy_right' if p == nxt else 'copy_wrong') + ('_n5' if n == 5 else '_n2-4')
            stats[key][0] += 1; stats[key][1] += int(pred[t - 1] == nxt)
tot = sum(v[0] for v in stats.values()); hit = sum(v[1] for v in stats.values())
print(model_dir, split, 'positions', tot, 'draft top1', round(hit / tot, 3))
for k, (n, h) in sorted(stats.items()):
    print(f'  {k:11s} share {n / tot:.3f}  draft top1 {h / max(n, 1):.3f}')
