"""Train-stage benchmarks: Lightning step vs a plain PyTorch loop, cached vs online teacher, peak memory,
and the acceptance reached by top-k cached vs full-logit training at equal steps.

    python bench/bench_train.py                                  # tiny target built in code (minutes)
    python bench/bench_train.py --target smollm2-135m-instruct --draft-layers 2 --seq-len 384 --steps 40
    python bench/bench_train.py --only speed                     # skip the acceptance comparison

Every configuration runs in its own process (so peak RSS is that configuration's), with one thread unless
--threads says otherwise. Results: a JSON file and a Markdown table (--out, default bench/results/train.*).
Nothing here is estimated: each figure is timed on this machine after --warmup steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# ---------------------------------------------------------------------------------------------------------
# Worker side: one configuration, one process


def _cfg(args: dict[str, Any], run_dir: Path, teacher: str) -> Any:
    from distill.config import load_config

    return load_config(
        REPO / "configs/tiny.yaml",
        [
            f"target.model={args['target']}",
            f"run.dir={run_dir}",
            f"draft.num_layers={args['draft_layers']}",
            f"train.batch_size={args['batch_size']}",
            f"train.max_seq_len={args['seq_len']}",
            f"train.teacher={teacher}",
            f"train.max_steps={args['steps'] + args['warmup']}",
            "train.warmup_steps=0",
            f"train.lr={args['lr']}",
            f"train.precision={args['precision']}",
            f"draft.parallel_tokens={args.get('parallel_tokens', 0)}",
        ],
    )


def _peak_memory() -> dict[str, float]:
    import torch

    out = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def _setup(args: dict[str, Any], teacher_mode: str) -> tuple[Any, Any, Any, Any, Any]:
    import torch

    from distill.models.draft import build_initial_draft, load_tokenizer
    from distill.models.resolve import resolve_model
    from distill.train.stage import build_datamodule, load_teacher, loss_spec

    run_dir = Path(args["run_dir"])
    cfg = _cfg(args, run_dir, teacher_mode)
    target_dir = resolve_model(cfg.target.model, key="target.model")
    tok = load_tokenizer(target_dir)
    torch.manual_seed(0)
    draft = build_initial_draft(cfg, target_dir)
    teacher = load_teacher(cfg, target_dir)
    dm = build_datamodule(cfg, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    dm.setup("fit")
    return cfg, tok, draft, teacher, (dm, loss_spec(cfg), target_dir)


def worker_plain(args: dict[str, Any]) -> dict[str, Any]:
    """The same work as the Lightning step (draft fwd/bwd, teacher fwd, loss, clip, AdamW, schedule)."""
    import torch

    from distill.losses import per_token_loss, select_labels
    from distill.train.module import micro_teacher, param_groups, response_logits

    cfg, tok, draft, teacher, (dm, spec, _) = _setup(args, args["teacher"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    draft.to(device).train()
    if teacher is not None:
        teacher.to(device)
    opt = torch.optim.AdamW(param_groups(draft, 0.0), lr=cfg.train.lr, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    vocab = len(tok)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16-mixed")
    times, tokens = [], []
    loader = dm.train_dataloader()
    step = 0
    while step < args["steps"] + args["warmup"]:
        for batch in loader:
            t0 = time.perf_counter()
            batch = [mb.to(device) for mb in batch]
            n = sum(mb.num_tokens for mb in batch)
            for mb in batch:
                with autocast:
                    s_logits = response_logits(draft, mb.input_ids, mb.attention_mask, mb.loss_mask, vocab)
                    t = micro_teacher(teacher, mb, vocab)
                    loss = (
                        per_token_loss(spec, s_logits, select_labels(mb.input_ids, mb.loss_mask), t).sum() / n
                    )
                loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.train.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            tokens.append(sum(int(mb.attention_mask.sum()) for mb in batch))
            step += 1
            if step >= args["steps"] + args["warmup"]:
                break
    w = args["warmup"]
    return {"tokens_per_s": sum(tokens[w:]) / sum(times[w:]), "steps": len(times) - w, **_peak_memory()}


def worker_lightning(args: dict[str, Any]) -> dict[str, Any]:
    import torch
    from lightning.pytorch.callbacks import Callback

    from bench.common import bare_trainer
    from distill.train.stage import build_module

    cfg, tok, draft, teacher, (dm, spec, _) = _setup(args, args["teacher"])
    module = build_module(cfg, draft, teacher, spec, len(tok))

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.tokens: list[int] = []
            self._t0 = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t0)
            self.tokens.append(sum(int(mb.attention_mask.sum()) for mb in batch))

    timer = Timer()
    trainer = bare_trainer(args["steps"] + args["warmup"], precision=args["precision"], callbacks=[timer])
    trainer.fit(module, datamodule=dm)
    w = args["warmup"]
    return {
        "tokens_per_s": sum(timer.tokens[w:]) / sum(timer.times[w:]),
        "steps": len(timer.times) - w,
        **_peak_memory(),
    }


def worker_acceptance(args: dict[str, Any]) -> dict[str, Any]:
    """Train `steps` steps (online = full logits, or cached top-k), then measure val acceptance against the
    full-logit teacher (the true figure, not the top-k upper bound)."""
    from bench.common import bare_trainer
    from distill.models.draft import load_causal_lm
    from distill.train.data import load_rows, val_loader
    from distill.train.module import evaluate_draft
    from distill.train.stage import build_module

    cfg, tok, draft, teacher, (dm, spec, target_dir) = _setup(args, args["teacher"])
    module = build_module(cfg, draft, teacher, spec, len(tok))
    trainer = bare_trainer(args["steps"])
    trainer.fit(module, datamodule=dm)
    full_teacher = load_causal_lm(target_dir)
    rows = load_rows(cfg.run_dir, "val", cached=False, max_seq_len=cfg.train.max_seq_len)
    fig = evaluate_draft(
        module.draft.cpu(),
        full_teacher,
        val_loader(rows, cfg.train.batch_size, tok.eos_token_id),
        spec,
        eval_temperature=1.0,
        vocab=len(tok),
        max_positions=4,
    )
    return {
        "expected_acceptance": fig["expected_acceptance"],
        "top1_agreement": fig["top1_agreement"],
        "val_loss_vs_full_teacher": fig["loss"],
        "steps": args["steps"],
    }


WORKERS = {"plain": worker_plain, "lightning": worker_lightning, "acceptance": worker_acceptance}


# ---------------------------------------------------------------------------------------------------------
# Driver side


def _run_worker(kind: str, args: dict[str, Any], threads: int) -> dict[str, Any]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [sys.executable, __file__, "--worker", kind, "--worker-args", json.dumps(args)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"worker {kind} {args.get('teacher')} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _prepare_data(
    target: str, run_dir: Path, n_train: int, n_val: int, max_new: int, top_ks: list[int]
) -> None:
    """One dataset; a top-k cache per k (copied into per-k run folders by the caller)."""
    import shutil

    from distill.models.resolve import resolve_model
    from distill.train.synthetic import build_run_data

    target_dir = resolve_model(target, key="target.model")
    build_run_data(
        run_dir,
        target_dir,
        n_train=n_train,
        n_val=n_val,
        max_new_tokens=max_new,
        top_k=max(top_ks) if top_ks else 0,
    )
    from distill.data.format import topk_dir

    for k in top_ks:
        kdir = run_dir.parent / f"k{k}"
        shutil.copytree(run_dir / "data" / "train", kdir / "data" / "train")
        shutil.copytree(run_dir / "data" / "val", kdir / "data" / "val")
        if k == max(top_ks):
            shutil.copytree(topk_dir(run_dir, "train").parent, kdir / "data" / "topk")
        else:
            _rebuild_topk(target_dir, kdir, k)


def _rebuild_topk(target_dir: Path, kdir: Path, k: int) -> None:
    from distill.data.format import load_split_dataset
    from distill.models.draft import load_causal_lm
    from distill.train.synthetic import write_topk

    model = load_causal_lm(target_dir)
    for split in ("train", "val"):
        rows = [dict(r) for r in load_split_dataset(kdir, split)]
        write_topk(kdir, split, model, rows, k)


def _table(results: dict[str, Any]) -> str:
    lines = ["| run | tokens/s | peak RSS MiB | steps |", "|---|---|---|---|"]
    for name, r in results["speed"].items():
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {r['peak_rss_mib']:.0f} | {r['steps']} |")
    if "lightning_over_plain" in results:
        lines.append(f"\nLightning / plain tokens/s (online): {results['lightning_over_plain']:.3f}")
    if results.get("acceptance"):
        lines += [
            "",
            "| training | val expected acceptance (T=1, vs full teacher) | top-1 | steps |",
            "|---|---|---|---|",
        ]
        for name, r in results["acceptance"].items():
            lines.append(
                f"| {name} | {r['expected_acceptance']:.4f} | {r['top1_agreement']:.4f} | {r['steps']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--target", default=None, help="target model reference (default: a tiny Llama built in code)"
    )
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="timed steps (speed) / training steps (acceptance)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument(
        "--repeats", type=int, default=2, help="speed runs per configuration (best kept, all listed)"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", default="32", choices=["32", "bf16-mixed"])
    p.add_argument(
        "--top-k", default="16,64", help="comma-separated cache sizes for the acceptance comparison"
    )
    p.add_argument("--n-train", type=int, default=96)
    p.add_argument("--n-val", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", choices=["speed", "acceptance"], default=None)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "train"))
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--worker-args", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(WORKERS[a.worker](json.loads(a.worker_args))))
        return

    top_ks = [int(k) for k in a.top_k.split(",") if k.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="bench_train."))
    target = a.target
    if target is None:
        from distill.models.tiny import save_tiny_model

        target = str(save_tiny_model(tmp / "tiny_target", seed=0))
    base = {
        "target": target,
        "draft_layers": a.draft_layers,
        "batch_size": a.batch_size,
        "seq_len": a.seq_len,
        "steps": a.steps,
        "warmup": a.warmup,
        "lr": a.lr,
        "precision": a.precision,
    }
    t0 = time.time()
    _prepare_data(target, tmp / "full", a.n_train, a.n_val, a.max_new_tokens, top_ks)
    results: dict[str, Any] = {
        "config": {
            **base,
            "top_k": top_ks,
            "threads": a.threads,
            "n_train": a.n_train,
            "max_new_tokens": a.max_new_tokens,
        },
        "data_seconds": round(time.time() - t0, 1),
        "speed": {},
        "acceptance": {},
    }
    if a.only in (None, "speed"):
        k_cached = max(top_ks) if top_ks else None
        plan = [
            ("plain_online", "plain", "online", tmp / "full"),
            ("lightning_online", "lightning", "online", tmp / "full"),
        ]
        if k_cached:
            plan += [
                (f"plain_cached_k{k_cached}", "plain", "cached", tmp / f"k{k_cached}"),
                (f"lightning_cached_k{k_cached}", "lightning", "cached", tmp / f"k{k_cached}"),
            ]
        for name, kind, teacher, run_dir in plan:
            runs = [
                _run_worker(kind, {**base, "teacher": teacher, "run_dir": str(run_dir)}, a.threads)
                for _ in range(a.repeats)
            ]
            best = max(runs, key=lambda r: r["tokens_per_s"])
            results["speed"][name] = {**best, "all_tokens_per_s": [round(r["tokens_per_s"], 1) for r in runs]}
            print(name, results["speed"][name], flush=True)
        results["lightning_over_plain"] = (
            results["speed"]["lightning_online"]["tokens_per_s"]
            / results["speed"]["plain_online"]["tokens_per_s"]
        )
    if a.only in (None, "acceptance"):
        acc_plan = [("full_logits", "online", tmp / "full")] + [
            (f"top{k}", "cached", tmp / f"k{k}") for k in top_ks
        ]
        for name, teacher, run_dir in acc_plan:
            results["acceptance"][name] = _run_worker(
                "acceptance", {**base, "teacher": teacher, "run_dir": str(run_dir)}, a.threads
            )
            print(name, results["acceptance"][name], flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(_table(results))
    print(_table(results))


if __name__ == "__main__":
    main()
