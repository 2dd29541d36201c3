"""Train-stage benchmarks: Lightning step vs a plain PyTorch loop, cached vs online teacher, peak memory,
and the acceptance reached by top-k cached vs full-logit training at equal steps.

    python -m bench.bench_train                                  # tiny target built in code (minutes)
    python -m bench.bench_train --target smollm2-135m-instruct --draft-layers 2 --seq-len 384 --steps 40
    python -m bench.bench_train --only speed                     # skip the acceptance comparison

Every configuration runs in its own process (so peak RSS is that configuration's), with one thread unless
--threads says otherwise. Speed: every configuration runs once per repeat, the order reversing from repeat to
repeat so that a drifting machine favours none; reported are the median and min–max tokens/s of each and the
ratios (Lightning / plain, cached / online) taken per repeat. Results: `--out` (default bench/out/train) .json
and .md, with the command, the machine and the date. Nothing here is estimated: each figure is timed on this
machine after --warmup steps.
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
sys.path.insert(0, str(REPO))  # the workers run this file as a script

from bench.common import (  # noqa: E402
    OUT_DIR,
    command_line,
    fmt,
    int_list,
    machine_info,
    markdown_table,
    median,
    non_negative_int,
    order_for_repeat,
    positive_int,
    spread,
    write_fragment,
)

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
    trainer = bare_trainer(args["steps"], precision=args["precision"])
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
        "precision": args["precision"],
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


def run_alternating(
    plan: list[tuple[str, str, dict[str, Any]]], repeats: int, threads: int
) -> list[dict[str, Any]]:
    """Every configuration of `plan` ((name, worker kind, worker args)) once per repeat, each in its own process,
    the order reversing from repeat to repeat; one row per run: {"name", "repeat", "wall_s", **its result}."""
    runs = []
    for rep in range(repeats):
        for name, kind, args in order_for_repeat(plan, rep):
            t0 = time.perf_counter()
            result = _run_worker(kind, args, threads)
            runs.append({"name": name, "repeat": rep, "wall_s": round(time.perf_counter() - t0, 1), **result})
            print(f"repeat {rep} {name}: {result['tokens_per_s']:.1f} tokens/s", flush=True)
    return runs


def summarize_speed(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration: tokens/s median (`tokens_per_s`) and min–max over the repeats, median peak memory."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["name"] for r in runs):
        mine = [r for r in runs if r["name"] == name]
        tps = spread([float(r["tokens_per_s"]) for r in mine])
        row = {
            "tokens_per_s": tps["median"],
            "tokens_per_s_min": tps["min"],
            "tokens_per_s_max": tps["max"],
            "n": tps["n"],
            "all_tokens_per_s": [round(float(r["tokens_per_s"]), 1) for r in mine],
            "steps": mine[0]["steps"],
            "peak_rss_mib": median([float(r["peak_rss_mib"]) for r in mine]),
        }
        if all("peak_cuda_mib" in r for r in mine):
            row["peak_cuda_mib"] = median([float(r["peak_cuda_mib"]) for r in mine])
        out[name] = row
    return out


def ratio_per_repeat(runs: list[dict[str, Any]], num: str, den: str) -> dict[str, Any] | None:
    """tokens/s of configuration `num` over `den` within each repeat (they ran side by side), as a spread;
    None when no repeat has both."""
    ratios = []
    for rep in dict.fromkeys(r["repeat"] for r in runs):
        tps = {r["name"]: float(r["tokens_per_s"]) for r in runs if r["repeat"] == rep}
        if num in tps and den in tps:
            ratios.append(tps[num] / tps[den])
    return spread(ratios) if ratios else None


def ratio_text(ratio: dict[str, Any] | None) -> str:
    if ratio is None:
        return "—"
    return f"**{ratio['median']:.3f}** ({ratio['min']:.3f}–{ratio['max']:.3f}, n={ratio['n']})"


SPEED_RATIOS = {  # results key: (numerator, denominator, label) over the speed plan's names
    "lightning_over_plain": ("lightning_online", "plain_online", "Lightning / plain (online teacher)"),
    "lightning_over_plain_cached": ("lightning_cached", "plain_cached", "Lightning / plain (cached teacher)"),
    "cached_over_online": ("lightning_cached", "lightning_online", "cached / online teacher (Lightning)"),
}


def speed_plan(
    base: dict[str, Any], tmp: Path, k_cached: int | None
) -> list[tuple[str, str, dict[str, Any]]]:
    plan = [
        ("plain_online", "plain", {**base, "teacher": "online", "run_dir": str(tmp / "full")}),
        ("lightning_online", "lightning", {**base, "teacher": "online", "run_dir": str(tmp / "full")}),
    ]
    if k_cached:
        cached = {**base, "teacher": "cached", "run_dir": str(tmp / f"k{k_cached}")}
        plan += [("plain_cached", "plain", cached), ("lightning_cached", "lightning", cached)]
    return plan


def speed_results(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The speed part of the results: per configuration, and each ratio per repeat (its median as a number)."""
    out: dict[str, Any] = {"speed": summarize_speed(runs), "speed_runs": runs}
    for key, (num, den, _) in SPEED_RATIOS.items():
        ratio = ratio_per_repeat(runs, num, den)
        if ratio is not None:
            out[key] = ratio["median"]
            out[f"{key}_per_repeat"] = ratio
    return out


def _table(results: dict[str, Any]) -> str:
    cfg = results["config"]
    titles = [
        title
        for key, title in (
            ("speed", "Lightning step vs a plain loop, cached vs online teacher"),
            ("acceptance", "acceptance after top-k cached vs full-logit training"),
        )
        if results.get(key)
    ]
    parts = ["### Train stage: " + "; ".join(titles)]
    if results.get("speed"):
        rows = [
            [
                name,
                f"{fmt(r['tokens_per_s'], 0)} ({fmt(r['tokens_per_s_min'], 0)}–{fmt(r['tokens_per_s_max'], 0)}, "
                f"n={r['n']})",
                fmt(r["peak_rss_mib"], 0),
                str(r["steps"]),
            ]
            for name, r in results["speed"].items()
        ]
        parts.append(
            markdown_table(
                ["run", "tokens/s (median, min–max)", "peak RSS MiB (median)", "timed steps"], rows
            )
        )
        ratios = [
            [label, ratio_text(results.get(f"{key}_per_repeat"))]
            for key, (_, _, label) in SPEED_RATIOS.items()
            if f"{key}_per_repeat" in results
        ]
        parts.append(markdown_table(["tokens/s ratio, per repeat", "median (min–max)"], ratios))
        parts.append(
            f"Target `{cfg['target_ref']}`, {cfg['draft_layers']}-layer draft, batch {cfg['batch_size']} × ≤ "
            f"{cfg['seq_len']} tokens, precision {cfg['precision']}, {cfg['threads']} thread(s); cached = the top-{max(cfg['top_k'])} "
            f"cache; {cfg['steps']} timed steps after {cfg['warmup']} untimed; {cfg['repeats']} repeat(s), every configuration once per repeat in "
            "its own process, the order reversing from repeat to repeat."
        )
    if results.get("acceptance"):
        rows = [
            [name, f"{r['expected_acceptance']:.4f}", f"{r['top1_agreement']:.4f}", str(r["steps"])]
            for name, r in results["acceptance"].items()
        ]
        parts.append(
            markdown_table(
                ["training", "val expected acceptance (T=1, vs full teacher)", "top-1", "steps"], rows
            )
        )
        parts.append(f"Acceptance: {cfg['steps']} training steps at {cfg['precision']}, one run each.")
    return "\n\n".join(parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--target", default=None, help="target model reference (default: a tiny Llama built in code)"
    )
    p.add_argument("--draft-layers", type=positive_int, default=1)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument(
        "--steps", type=positive_int, default=20, help="timed steps (speed) / training steps (acceptance)"
    )
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps first")
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="speed runs per configuration, alternating (median and min–max; ratios per repeat)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", default="32", choices=["32", "bf16-mixed"], help="speed and acceptance")
    p.add_argument(
        "--top-k",
        type=int_list,
        default=[16, 64],
        help="comma-separated cache sizes for the acceptance comparison (the largest: the cached speed runs)",
    )
    p.add_argument("--n-train", type=positive_int, default=96)
    p.add_argument("--n-val", type=positive_int, default=16)
    p.add_argument("--max-new-tokens", type=positive_int, default=48)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--only", choices=["speed", "acceptance"], default=None)
    p.add_argument(
        "--out",
        type=Path,
        default=OUT_DIR / "train",
        help="OUT.json and OUT.md (default bench/out/train; a .json suffix is taken off)",
    )
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--worker-args", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        print(json.dumps(WORKERS[a.worker](json.loads(a.worker_args))))
        return 0
    machine = machine_info()
    top_ks: list[int] = a.top_k
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
            "target_ref": a.target or "a tiny Llama built in code",
            "top_k": top_ks,
            "threads": a.threads,
            "repeats": a.repeats,
            "n_train": a.n_train,
            "n_val": a.n_val,
            "max_new_tokens": a.max_new_tokens,
        },
        "data_seconds": round(time.time() - t0, 1),
        "speed": {},
        "acceptance": {},
    }
    if a.only in (None, "speed"):
        plan = speed_plan(base, tmp, max(top_ks))
        results.update(speed_results(run_alternating(plan, a.repeats, a.threads)))
    if a.only in (None, "acceptance"):
        acc_plan = [("full_logits", "online", tmp / "full")] + [
            (f"top{k}", "cached", tmp / f"k{k}") for k in top_ks
        ]
        for name, teacher, run_dir in acc_plan:
            results["acceptance"][name] = _run_worker(
                "acceptance", {**base, "teacher": teacher, "run_dir": str(run_dir)}, a.threads
            )
            print(name, results["acceptance"][name], flush=True)
    out = a.out.with_suffix("") if a.out.suffix == ".json" else a.out
    md = _table(results)
    write_fragment(
        out.name,
        results,
        md,
        command=command_line("bench.bench_train", argv),
        machine=machine,
        out_dir=out.parent,
        show=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
