import sys, torch
from transformers import AutoModelForCausalLM
from datasets import load_from_disk
d = load_from_disk('checkpoints/smollm2-sharegpt/data/val')
for path in sys.argv[1:]:
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hit = tot = 0
    with torch.no_grad():
        for i in range(20):
            ids = d[i]['input_ids']; mask = d[i]['loss_mask']
            resp = [t for t, k in zip(ids, mask) if k][:40]
            x = torch.tensor([[1] + resp + resp])
            T = len(resp)
            pred = m(x, use_cache=False).logits[0].argmax(-1)
            hit += (pred[T + 1:2 * T] == x[0, T + 2:2 * T + 1]).sum().item(); tot += T - 1
    print(path, 'text copy acc', round(hit / tot, 3))
