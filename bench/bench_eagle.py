"""EAGLE-1 head study: does a draft head on the target's own features beat the truncated draft on this CPU?

An EAGLE head (vLLM `method: eagle`) is not a model of its own: at position t it reads the target's final
hidden state h_t (after the final norm) and the embedding of the next token x_{t+1}, mixes them with a linear
layer `fc` ([2H] -> [H]) and one decoder layer, and the target's own head turns the result f_t into the
prediction of x_{t+2}. It shares the target's embeddings and head (vLLM takes them from the target), so its
own weights are `fc` and the layer. Draft step k >= 2 feeds f back in place of h, which is why f is also
regressed onto h_{t+1} (EAGLE's feature loss).

This bench trains such a head on a run folder's data (the data stage's target responses) with the target as
an online teacher (its hidden states are needed, so the cached top-k logits do not suffice): loss = forward
KL(target || head) on the response positions + `--reg-weight` x smooth-L1(f_t, h_{t+1}); it reports the top-1
agreement with the target on the validation split (the same measure as the train stage's first drafted token)
during training, then times the head inside vLLM beside no speculation on held-out ShareGPT `test` prompts
(the product's vLLM worker, compiled decoding, batch 1, medians of `--repeats` passes; each configuration is
its own engine, run one after another like `distill eval`).

The head starts as the identity on h_t: `fc` = [0 | I] and the layer (copied from target layer
`--init-layer`) with zeroed output projections, so step 0 predicts what the target predicted at t (calibrated
logits) and training learns the one-token shift. Copying the layer unchanged, or a random `fc`, starts with
logits hundreds of nats off and diverged at lr 2e-3 in the first trials (BENCHMARKS.md).

    python -m bench.bench_eagle --run-dir checkpoints/smollm2-sharegpt --steps 200 --lr 3e-4
    python -m bench.bench_eagle --quick                 # 4 steps, 2 prompts: a self-check in minutes
    python -m bench.bench_eagle --no-vllm ...           # validation top-1 only

Writes bench/out/eagle.json and bench/out/eagle.md (or `--name`); the head to bench/out/work/NAME/head.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    OUT_DIR,
    fmt,
    markdown_table,
    positive_int,
    run_study,
)

log = logging.getLogger("bench.eagle")

FULL: dict[str, Any] = {"steps": 200, "batch_size": 16, "prompts": 32, "max_tokens": 128, "val_rows": None}
QUICK: dict[str, Any] = {"steps": 4, "batch_size": 4, "prompts": 2, "max_tokens": 16, "val_rows": 8}


# ---------------------------------------------------------------------------------------------------------
# The head


def head_config(target_config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """config.json of an EAGLE-1 head for a Llama target: the target's config with `num_layers` layers.

    vLLM (`EAGLEConfig`) turns architecture `LlamaForCausalLM` into `EagleLlamaForCausalLM`; the name is
    written already prefixed so the folder says what it is (it is not loadable as a causal LM).
    """
    cfg = dict(target_config)
    cfg["num_hidden_layers"] = int(num_layers)
    cfg["architectures"] = ["EagleLlamaForCausalLM"]
    cfg.pop("_name_or_path", None)
    return cfg


def build_head(target: Any, num_layers: int, init_layer: int) -> Any:
    """An EAGLE-1 head (fc + `num_layers` Llama decoder layers) that starts as the identity on h_t.

    Layer 0 has no input norm and the stack no final norm, as vLLM's `EagleLlamaForCausalLM` computes it.
    """
    import copy

    import torch
    from torch import nn
    from transformers import LlamaModel

    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = num_layers
    n_target = int(target.config.num_hidden_layers)
    if not -n_target <= init_layer < n_target:
        raise ValueError(f"--init-layer: {init_layer} is not a layer of the {n_target}-layer target")

    class EagleHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            hidden = int(cfg.hidden_size)
            self.fc = nn.Linear(2 * hidden, hidden, bias=False)
            self.body = LlamaModel(cfg)
            self.body.embed_tokens = None  # inputs_embeds only; vLLM shares the target's embeddings
            self.body.norm = nn.Identity()
            self.body.layers[0].input_layernorm = nn.Identity()

        def forward(self, next_embeds: Any, hidden: Any, attention_mask: Any) -> Any:
            """next_embeds, hidden: [B, L, H] (embedding of x_{t+1}, target state h_t); returns f: [B, L, H]."""
            z = self.fc(torch.cat([next_embeds, hidden], dim=-1))
            return self.body(
                inputs_embeds=z, attention_mask=attention_mask, use_cache=False
            ).last_hidden_state

    head = EagleHead()
    source = target.model.layers[init_layer].state_dict()
    with torch.no_grad():
        for layer in head.body.layers:
            missing = layer.load_state_dict(source, strict=False).missing_keys
            assert not [k for k in missing if "input_layernorm" not in k], missing
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hidden = int(cfg.hidden_size)
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
    return head


def head_state_dict(head: Any) -> dict[str, Any]:
    """The head's weights under vLLM's EAGLE-1 names (`fc.weight`, `layers.<i>.<...>`), detached copies."""
    out = {"fc.weight": head.fc.weight}
    for i, layer in enumerate(head.body.layers):
        for key, value in layer.state_dict().items():
            out[f"layers.{i}.{key}"] = value
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def save_head(head: Any, target_dir: Path, out: Path, dtype: str) -> Path:
    """Write the head as a vLLM EAGLE folder (config.json + model.safetensors), atomically."""
    import torch
    from safetensors.torch import save_file

    from distill.utils.fs import atomic_dir

    target_config = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    cfg = head_config(target_config, len(head.body.layers))
    weights = {k: v.to(getattr(torch, dtype)) for k, v in head_state_dict(head).items()}
    with atomic_dir(out, replace=True) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        save_file(weights, str(tmp / "model.safetensors"))
    return out


# ---------------------------------------------------------------------------------------------------------
# Training


def pad_batch(rows: Sequence[dict[str, Any]], pad_id: int) -> tuple[Any, Any, Any]:
    """Right-padded input_ids [B, L] (long), loss_mask [B, L] (bool), attention_mask [B, L] (long)."""
    import torch

    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.bool)
    attn = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        mask[i, :n] = torch.tensor(r["loss_mask"], dtype=torch.bool)
        attn[i, :n] = 1
    return ids, mask, attn


def aligned(hidden: Any, embeds: Any, loss_mask: Any) -> tuple[Any, Any, Any, Any]:
    """EAGLE-1's alignment of one batch of length L.

    Head position t (t = 0 .. L-2) reads (embeds of x_{t+1}, h_t) and predicts x_{t+2}, i.e. what the target
    predicts from h_{t+1}. Returns (next_embeds [B, L-1, H], hidden_in [B, L-1, H], the target state to match
    at head positions 0 .. L-3: h_{t+1} [B, L-2, H], and the positions scored: x_{t+2} is a response token
    [B, L-2] bool). The head's last position has no next target state and is never scored.
    """
    return embeds[:, 1:], hidden[:, :-1], hidden[:, 1:-1], loss_mask[:, 2:]


def head_losses(target: Any, head: Any, batch: tuple[Any, Any, Any], autocast: bool) -> dict[str, Any]:
    """Forward KL(target || head), smooth-L1(f, h_next) and top-1 agreement over the scored positions."""
    import torch
    import torch.nn.functional as F

    ids, loss_mask, attn = batch
    with torch.no_grad():
        hidden = target.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
        embeds = target.model.embed_tokens(ids)
    next_embeds, hidden_in, hidden_next, scored = aligned(hidden, embeds, loss_mask)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        f = head(next_embeds, hidden_in, attn[:, 1:])
    f_scored, h_scored = f[:, :-1][scored], hidden_next[scored]
    lm_head = target.get_output_embeddings()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        head_logits = lm_head(f_scored).float()
        with torch.no_grad():
            target_logits = lm_head(h_scored).float()
    t_logp, h_logp = F.log_softmax(target_logits, -1), F.log_softmax(head_logits, -1)
    n = int(f_scored.shape[0])
    fkl = (t_logp.exp() * (t_logp - h_logp)).sum(-1).mean() if n else head_logits.sum() * 0
    reg = F.smooth_l1_loss(f_scored.float(), h_scored.float()) if n else fkl * 0
    agree = (head_logits.argmax(-1) == target_logits.argmax(-1)).float().sum()
    return {"fkl": fkl, "reg": reg, "agree": float(agree), "n": n}


def lr_at(step: int, steps: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up then cosine decay to `floor` x peak (the train stage's schedule)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def validate(target: Any, head: Any, val: Any, pad_id: int, batch_size: int, autocast: bool) -> float:
    """Top-1 agreement of head and target over the validation split's response positions."""
    import torch

    agree, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(val), batch_size):
            rows = [val[j] for j in range(i, min(len(val), i + batch_size))]
            out = head_losses(target, head, pad_batch(rows, pad_id), autocast)
            agree, count = agree + out["agree"], count + out["n"]
    return agree / count if count else float("nan")


def train_head(target: Any, train: Any, val: Any, args: argparse.Namespace, pad_id: int) -> tuple[Any, dict]:
    """Train an EAGLE-1 head; returns it and the history (validation top-1 at step 0, every --val-every
    steps and at the end; training loss per 10 steps; wall seconds)."""
    import torch

    torch.manual_seed(args.seed)
    head = build_head(target, args.layers, args.init_layer)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    order = list(range(len(train)))
    random.Random(args.seed).shuffle(order)
    autocast = args.dtype == "bfloat16"
    history: dict[str, Any] = {"val_top1": [], "train": []}

    def record_val(step: int) -> None:
        top1 = validate(target, head, val, pad_id, args.batch_size, autocast)
        history["val_top1"].append({"step": step, "top1": top1})
        log.info("step %d: validation top-1 %.4f", step, top1)

    record_val(0)
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, min(args.warmup, args.steps))
        rows = [train[order[(step * args.batch_size + j) % len(order)]] for j in range(args.batch_size)]
        out = head_losses(target, head, pad_batch(rows, pad_id), autocast)
        loss = out["fkl"] + args.reg_weight * out["reg"]
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            history["train"].append(
                {
                    "step": step,
                    "fkl": float(out["fkl"].detach()),
                    "reg": float(out["reg"].detach()),
                    "top1": out["agree"] / max(1, out["n"]),
                    "wall_s": round(time.perf_counter() - t0, 1),
                }
            )
            log.info("step %d %s", step, history["train"][-1])
        if (step + 1) % args.val_every == 0 and step + 1 < args.steps:
            record_val(step + 1)
    history["train_s"] = round(time.perf_counter() - t0, 1)
    record_val(args.steps)
    return head, history


# ---------------------------------------------------------------------------------------------------------
# vLLM


def speculate_job(
    target_dir: str, head_dir: str, prompts: list[list[int]], ks: Sequence[int], args: argparse.Namespace
) -> dict[str, Any]:
    """A "speculate" worker job: no speculation, then the EAGLE head at each k, temperature 0, batch 1."""
    base = {"temperature": 0.0, "draft_sample_method": None}
    configs = [{"name": "no_spec", "method": None, "draft": None, "k": 0, **base}]
    configs += [
        {
            "name": "eagle",
            "method": "eagle",
            "draft": head_dir,
            "k": int(k),
            **base,
            "draft_sample_method": "greedy",
        }
        for k in ks
    ]
    return {
        "kind": "speculate",
        "target": target_dir,
        "dtype": args.dtype,
        "trust_remote_code": False,
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "eos_token_id": args.eos_token_id,
        "max_model_len": max(map(len, prompts)) + args.max_tokens + 8,
        "configs": configs,
        "repeats": args.repeats,
        "seed": 0,
        "max_num_seqs": 1,
        "tensor_parallel_size": 1,
        "enforce_eager": bool(args.eager),
        "device": "cpu",
        "partial_path": str(args.out_dir / "logs" / f"{args.name}.partial.json"),
    }


def measure_vllm(
    target_dir: Path, head_dir: Path, prompts: list[list[int]], args: argparse.Namespace
) -> list:
    """Rows of `distill eval`'s report shape (tokens/s, speedup, acceptance) for no_spec and the head."""
    from distill.evaluate.report import build_rows
    from distill.utils.subproc import run_worker

    logs = args.out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    job = speculate_job(str(target_dir), str(head_dir), prompts, args.k, args)
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": str(args.kvcache_gib)}
    out = run_worker(job, log_path=logs / f"{args.name}.log", timeout_s=args.timeout_s, env=env, what="vLLM")
    return build_rows(out["results"], dtype=args.dtype)


# ---------------------------------------------------------------------------------------------------------
# Driver


def render_markdown(payload: dict[str, Any]) -> str:
    s = payload["settings"]
    lines = [
        f"EAGLE-1 head ({s['layers']} layer(s), init from target layer {s['init_layer']}), {s['steps']} steps "
        f"of batch {s['batch_size']}, lr {s['lr']}, reg weight {s['reg_weight']}, online teacher, "
        f"{s['train_rows']} training rows of `{s['run_dir']}`; training {fmt(payload['history']['train_s'], 0)} s "
        f"({fmt(payload['history']['train_s'] / max(1, s['steps']), 2)} s/step).",
        "",
        markdown_table(
            ["step", "validation top-1"],
            [[v["step"], fmt(v["top1"], 4)] for v in payload["history"]["val_top1"]],
        ),
    ]
    rows = payload.get("vllm")
    if rows:
        lines += [
            "",
            f"Inside vLLM: {s['prompts']} `test` prompts, {s['max_tokens']} new tokens, batch 1, "
            f"{'eager' if s['eager'] else 'compiled'}, {s['dtype']}, medians of {s['repeats']} passes.",
            "",
            markdown_table(
                ["config", "k", "tokens/s", "speedup", "first drafted token", "tokens per round", "error"],
                [
                    [
                        r["name"],
                        r["k"],
                        fmt(r.get("tokens_per_s"), 1),
                        fmt(r.get("speedup"), 2),
                        fmt((r.get("per_position_acceptance") or [None])[0], 3),
                        fmt(r.get("mean_acceptance_length"), 2),
                        r.get("error") or "",
                    ]
                    for r in rows
                ],
            ),
        ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--run-dir",
        type=Path,
        default=Path("checkpoints/smollm2-sharegpt"),
        help="a run folder whose data stage completed (its data/train and data/val are used)",
    )
    p.add_argument("--target", default=None, help="the target (default: the run folder's target.model)")
    p.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (200; --quick 4)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="rows per step (16; --quick 4)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--reg-weight", type=float, default=1.0, help="weight of the feature regression")
    p.add_argument("--layers", type=positive_int, default=1, help="decoder layers of the head")
    p.add_argument("--init-layer", type=int, default=-1, help="target layer the head's layers copy")
    p.add_argument("--val-every", type=positive_int, default=100)
    p.add_argument("--val-rows", type=positive_int, default=None, help="validation rows (all; --quick 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--k", type=positive_int, nargs="+", default=[1, 2], help="k measured in vLLM")
    p.add_argument("--prompts", type=positive_int, default=None, help="held-out test prompts in vLLM (32)")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="new tokens per prompt (128)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=256)
    p.add_argument("--repeats", type=positive_int, default=3, help="timed passes per configuration, ≥ 3")
    p.add_argument("--eager", action="store_true", help="eager vLLM decoding (default: compiled)")
    p.add_argument("--no-vllm", action="store_true", help="validation top-1 only")
    p.add_argument("--quick", action="store_true", help="4 steps, 2 prompts: a self-check in minutes")
    p.add_argument("--source", default="sharegpt", help="prompt source of the vLLM timing (`test` split)")
    p.add_argument("--kvcache-gib", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--name", default="eagle", help="output name: bench/out/NAME.json and NAME.md")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key in preset:
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    return args


def check_args(args: argparse.Namespace) -> None:
    from distill.errors import InputError

    if not args.lr > 0:
        raise InputError("--lr: must be > 0.")
    if args.reg_weight < 0 or args.warmup < 0:
        raise InputError("--reg-weight and --warmup: must be ≥ 0.")
    if not args.no_vllm and args.repeats < 3:
        raise InputError("--repeats: at least 3 timed passes (medians of ≥ 3 repeats).")
    if args.target is None:
        args.target = run_target(args.run_dir)
    for split in ("train", "val"):
        if not (args.run_dir / "data" / split / "dataset_info.json").is_file():
            raise InputError(
                f"--run-dir: {args.run_dir}/data/{split} is missing; run `distill data` for that run first "
                "(or point --run-dir at a run whose data stage completed)."
            )


def run_target(run_dir: Path) -> str:
    """The target model reference of a run folder (its config.yaml's target.model)."""
    from omegaconf import OmegaConf

    from distill.errors import InputError

    path = run_dir / "config.yaml"
    try:
        return str(OmegaConf.load(path).target.model)
    except (OSError, ValueError, AttributeError) as exc:
        raise InputError(
            f"--run-dir: cannot read target.model from {path} ({exc}); point --run-dir at a distill run "
            "folder or name the model with --target."
        ) from exc


def study(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import load_from_disk

    from distill.errors import InputError
    from distill.models.draft import load_causal_lm, load_tokenizer
    from distill.models.resolve import resolve_model
    from distill.utils.subproc import vllm_available

    check_args(args)
    if not args.no_vllm and not vllm_available():
        raise InputError("--no-vllm: vLLM is not installed here; install `distill[cpu]` or pass --no-vllm.")
    target_dir = resolve_model(args.target, key="--target")
    tok = load_tokenizer(target_dir)
    target = load_causal_lm(target_dir, dtype=args.dtype).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    train = load_from_disk(str(args.run_dir / "data" / "train"))
    val = load_from_disk(str(args.run_dir / "data" / "val"))
    if args.val_rows is not None:
        val = val.select(range(min(len(val), args.val_rows)))
    vocab = int(target.config.vocab_size)
    if max(max(r) for r in train[: min(len(train), 64)]["input_ids"]) >= vocab:
        raise InputError(f"--run-dir: its token ids do not fit the vocabulary of --target {args.target}.")
    pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    head, history = train_head(target, train, val, args, pad_id)
    head_dir = save_head(head, target_dir, args.out_dir / "work" / args.name / "head", args.dtype)
    del target
    rows = None
    if not args.no_vllm:
        from bench.bench_drafts import load_prompt_ids

        args.eos_token_id = int(tok.eos_token_id)
        prompts = load_prompt_ids(tok, args.prompts, args.max_prompt_tokens, args.source)
        rows = measure_vllm(target_dir, head_dir, prompts, args)
    settings = {
        key: (str(v) if isinstance(v, Path) else v)
        for key, v in vars(args).items()
        if key not in ("out_dir", "quick", "timeout_s", "kvcache_gib", "name")
    }
    settings["train_rows"] = len(train)
    settings["head_dir"] = str(head_dir)
    return {"settings": settings, "history": history, "vllm": rows}


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    payload, rc = run_study("bench.bench_eagle", study, render_markdown, args, argv, (FloatingPointError,))
    if payload is None:
        return rc
    failed = [r for r in payload["vllm"] or [] if r.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
