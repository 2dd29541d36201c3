import sys, torch, copy as cp
from transformers import AutoModelForCausalLM
from datasets import load_from_disk
path = '/root/.cache/distill/models/smollm2-135m-instruct-v1'
full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation='eager').eval()
d = load_from_disk('checkpoints/smollm2-sharegpt/data/val')
g = torch.Generator().manual_seed(0)
T = 50
seq = torch.randint(1000, 20000, (8, T), generator=g)
x = torch.cat([torch.ones(8, 1, dtype=torch.long), seq, seq], 1)
def sub(layers):
    m = cp.deepcopy(full)
    m.model.layers = torch.nn.ModuleList([m.model.layers[i] for i in layers])
    for j, l in enumerate(m.model.layers): l.self_attn.layer_idx = j
    m.config.num_hidden_layers = len(layers)
    if getattr(m.config, 'layer_types', None): m.config.layer_types = [m.config.layer_types[i] for i in layers]
    return m
for spec in sys.argv[1:]:
    layers = [int(s) for s in spec.split(',')]
    m = sub(layers)
    with torch.no_grad():
        o = m(x, use_cache=False, output_attentions=True); pred = o.logits.argmax(-1)
        pos = torch.arange(T + 1, 2 * T + 1)
        ind = [round(a[:, :, pos, pos - T + 1].mean((0, 2)).max().item(), 2) for a in o.attentions]
        acc = (pred[:, T + 1:2 * T] == x[:, T + 2:2 * T + 1]).float().mean().item()
        hit = tot = 0
        for i in range(20):
            ids = d[i]['input_ids']; mask = torch.tensor(d[i]['loss_mask'][1:], dtype=torch.bool)
            p = m(torch.tensor([ids]), use_cache=False).logits[0, :-1].argmax(-1)
            tgt = torch.tensor(ids[1:])
            hit += (p[mask] == tgt[mask]).sum().item(); tot += mask.sum().item()
    print(f'layers {layers}: copy acc {acc:.3f} induction/layer {ind}  val top1 (20 rows) {hit / tot:.3f}', flush=True)
