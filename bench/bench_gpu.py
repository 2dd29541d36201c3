"""GPU figures for the draft the embedded default ships: training throughput (bf16-mixed vs fp32, Lightning vs a
plain loop) and the draft/target cost ratio c, on a target with SmolLM2-135M-Instruct's exact architecture.

    python -m bench.bench_gpu --assets DIR --out-dir OUT     # DIR: the target's config.json + tokenizer files

`bench/gpu.sh` prepares DIR from the cached SmolLM2 folder and runs this on a lent GPU machine. Such a machine
has no network and cannot take the 540 MB of real weights, so the target's weights are random (seeded): every
figure here is a speed figure, which depends on shapes, never on weights. Acceptance is measured on the CPU
(BENCHMARKS.md). vLLM is not installed on that machine (its CUDA wheel is far over what can be carried), so the
vLLM speculative-decoding figures are CPU-only too; c is measured with the PyTorch KV-cached decode step.

Writes OUT/gpu.json and OUT/gpu.md (with the command, the machine and the date). Each training figure is tokens/s
over `--steps` timed steps after `--warmup`, each configuration in its own process (bench_train's workers),
every configuration once per repeat with the order reversing from repeat to repeat; reported are the median and
min–max of each and the ratios (bf16 / fp32, Lightning / plain) taken per repeat.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.bench_train import ratio_per_repeat, run_alternating, summarize_speed
from bench.common import (
    command_line,
    int_list,
    machine_info,
    markdown_table,
    non_negative_int,
    positive_int,
    write_fragment,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def build_random_target(assets: Path, out: Path, seed: int = 0) -> Path:
    """An HF folder with the assets' architecture and tokenizer, weights drawn at random (seeded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(assets)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (assets / name).is_file():
            shutil.copy2(assets / name, out / name)
    return out


def write_random_rows(
    run_dir: Path, vocab: int, *, n_train: int, n_val: int, seq_len: int, prompt_len: int
) -> None:
    """Token rows in the data stage's format: random prompt + random response, the response counted.

    Throughput depends on lengths and masks, not on which tokens: random rows of exactly `seq_len` tokens give
    every step the same work.
    """
    import torch

    from distill.train.synthetic import write_split

    g = torch.Generator().manual_seed(0)
    for split, n in (("train", n_train), ("val", n_val)):
        rows = []
        for i in range(n):
            ids = torch.randint(3, vocab, (seq_len,), generator=g).tolist()
            rows.append(
                {
                    "input_ids": ids,
                    "loss_mask": [0] * prompt_len + [1] * (seq_len - prompt_len),
                    "prompt_id": f"{split}{i:05d}",
                    "response_index": 0,
                }
            )
        write_split(run_dir, split, rows)


RATIOS = {  # key: (numerator, denominator, label) over the plan's names, taken per repeat
    "bf16_over_fp32": ("lightning_bf16-mixed", "lightning_32", "bf16-mixed / fp32 (Lightning)"),
    "lightning_over_plain_bf16": (
        "lightning_bf16-mixed",
        "plain_bf16-mixed",
        "Lightning / plain loop (bf16-mixed)",
    ),
    "lightning_over_plain_fp32": ("lightning_32", "plain_32", "Lightning / plain loop (fp32)"),
}


def train_plan(target: Path, run_dir: Path, a: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, bench_train worker, its arguments) per configuration: precision × loop, and a parallel draft."""
    base = {
        "target": str(target),
        "draft_layers": a.draft_layers,
        "batch_size": a.batch_size,
        "seq_len": a.seq_len,
        "steps": a.steps,
        "warmup": a.warmup,
        "lr": 1e-4,
        "teacher": "online",
        "run_dir": str(run_dir),
    }
    plan = [
        (f"{kind}_{precision}", kind, {**base, "precision": precision, "parallel_tokens": 0})
        for precision in ("bf16-mixed", "32")
        for kind in ("lightning", "plain")
    ]
    if a.parallel_tokens:
        plan.append(
            (
                f"lightning_bf16-mixed_parallel{a.parallel_tokens}",
                "lightning",
                {**base, "precision": "bf16-mixed", "parallel_tokens": a.parallel_tokens},
            )
        )
    return plan


def ratios(runs: list[dict[str, Any]], parallel_tokens: int) -> dict[str, dict[str, Any]]:
    """Each ratio of RATIOS (and the parallel draft's tokens/s over the next-token draft's) per repeat."""
    pairs = {key: (num, den) for key, (num, den, _) in RATIOS.items()}
    if parallel_tokens:
        pairs["parallel_over_next_token"] = (
            f"lightning_bf16-mixed_parallel{parallel_tokens}",
            "lightning_bf16-mixed",
        )
    out = {}
    for key, (num, den) in pairs.items():
        ratio = ratio_per_repeat(runs, num, den)
        if ratio is not None:
            out[key] = ratio
    return out


def train_speed(target: Path, run_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    """tokens/s of the KD step (draft fwd/bwd + online teacher fwd + AdamW) per precision × loop: every
    configuration once per repeat (bench_train.run_alternating), medians, min–max and ratios per repeat."""
    runs = run_alternating(train_plan(target, run_dir, a), a.repeats, a.threads)
    return {"summary": summarize_speed(runs), "ratios": ratios(runs, a.parallel_tokens), "runs": runs}


def cost_ratios(target: Path, layers: list[int], dtype: str, device: str) -> dict[str, Any]:
    """c = draft / target KV-cached decode step time at batch 1, for the first-N-layer drafts."""
    import copy

    from distill.evaluate.analytic import measure_decode_step_s
    from distill.models.draft import load_causal_lm

    full = load_causal_lm(target, dtype=dtype).eval().to(device)
    t_step = measure_decode_step_s(full, steps=32, repeats=7)
    out: dict[str, Any] = {"target_step_ms": 1e3 * t_step, "drafts": {}}
    for n in layers:
        draft = copy.deepcopy(full)
        draft.model.layers = draft.model.layers[:n]
        draft.config.num_hidden_layers = n
        d_step = measure_decode_step_s(draft, steps=32, repeats=7)
        out["drafts"][f"truncate-{n}"] = {"step_ms": 1e3 * d_step, "c": d_step / t_step}
        del draft
    return out


def _ratio(r: dict[str, Any] | None) -> str:
    return "—" if r is None else f"**{r['median']:.2f}x** ({r['min']:.2f}–{r['max']:.2f}, n={r['n']})"


def render(results: dict[str, Any], machine: dict[str, Any]) -> str:
    cfg, train = results["config"], results["train"]
    rows = [
        [
            name,
            f"{r['tokens_per_s']:.0f} ({r['tokens_per_s_min']:.0f}–{r['tokens_per_s_max']:.0f}, n={r['n']})",
            f"{r.get('peak_cuda_mib', 0):.0f}",
            str(r["steps"]),
        ]
        for name, r in train["summary"].items()
    ]
    speed = markdown_table(
        ["KD step (online teacher)", "tokens/s (median, min–max)", "peak GPU MiB (median)", "timed steps"],
        rows,
    )
    labels = {key: label for key, (_, _, label) in RATIOS.items()}
    labels["parallel_over_next_token"] = (
        f"parallel draft ({cfg['parallel_tokens']} tokens) / next-token draft"
    )
    ratio_rows = [[labels[key], _ratio(r)] for key, r in train["ratios"].items()]
    c = results["cost"]
    c_rows = [[name, f"{d['step_ms']:.2f}", f"{d['c']:.3f}"] for name, d in c["drafts"].items()]
    cost = markdown_table(["draft", "decode step (ms)", "c = draft / target"], c_rows)
    return "\n\n".join(
        [
            f"### GPU: {results['gpu']} ({machine.get('torch', '?')}, {machine['date']})",
            f"Target: SmolLM2-135M-Instruct's architecture with random weights; draft = its first "
            f"{cfg['draft_layers']} layers; batch {cfg['batch_size']} × {cfg['seq_len']} tokens "
            f"({cfg['seq_len'] - cfg['prompt_len']} counted per row), over {cfg['steps']} timed steps after "
            f"{cfg['warmup']} warm-up; {cfg['repeats']} repeat(s), every configuration once per repeat in its "
            "own process, the order reversing from repeat to repeat.",
            speed,
            markdown_table(["tokens/s ratio, per repeat", "median (min–max)"], ratio_rows),
            f"Batch-1 KV-cached decode step in {cfg['dtype']} (PyTorch eager, no CUDA graphs): target "
            f"{c['target_step_ms']:.2f} ms.",
            cost,
        ]
    )


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip() or "unknown GPU"
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"


def target_layers(assets: Path) -> int | None:
    """The target's depth from the assets' config.json (None when it cannot be read: checked later)."""
    try:
        return int(json.loads((assets / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--assets", type=Path, required=True, help="folder with the target's config + tokenizer")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/distill-gpu"))
    p.add_argument("--draft-layers", type=positive_int, default=2)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--seq-len", type=positive_int, default=512)
    p.add_argument("--prompt-len", type=positive_int, default=64)
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--warmup", type=non_negative_int, default=5)
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="runs per training configuration, alternating (median, min–max; ratios per repeat)",
    )
    p.add_argument("--threads", type=positive_int, default=8)
    p.add_argument("--layers", type=int_list, default=[1, 2, 4, 6], help="draft depths for c, e.g. 1,2,4,6")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--parallel-tokens",
        type=non_negative_int,
        default=4,
        help="also time a parallel draft's step (0: not)",
    )
    p.add_argument("--allow-cpu", action="store_true", help="dry run of the script on a CPU (tiny sizes)")
    a = p.parse_args(argv)
    if a.prompt_len >= a.seq_len:
        p.error(f"--prompt-len: {a.prompt_len} leaves no response tokens in --seq-len {a.seq_len}")
    n = target_layers(a.assets)
    if n is None:
        p.error(f"--assets: no readable config.json with num_hidden_layers in {a.assets}")
    for opt, depths in (("--layers", a.layers), ("--draft-layers", [a.draft_layers])):
        if max(depths) > n:
            p.error(f"{opt}: {max(depths)} is more than the target's {n} layers")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not a.allow_cpu:
        print("bench_gpu: no CUDA device here; run it through bench/gpu.sh on a GPU machine", file=sys.stderr)
        return 2
    machine = {**machine_info(), "torch": torch.__version__}
    target = build_random_target(a.assets, a.workdir / "target")
    run_dir = a.workdir / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    n_train = a.batch_size * (a.steps + a.warmup + 2)
    write_random_rows(
        run_dir, vocab, n_train=n_train, n_val=a.batch_size, seq_len=a.seq_len, prompt_len=a.prompt_len
    )
    results: dict[str, Any] = {
        "gpu": gpu_name(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "train": train_speed(target, run_dir, a),
        "cost": cost_ratios(target, a.layers, a.dtype, "cuda" if torch.cuda.is_available() else "cpu"),
    }
    md = render(results, machine)
    write_fragment(
        "gpu", results, md, command=command_line("bench.bench_gpu", argv), machine=machine, out_dir=a.out_dir
    )
    print(md)
    print("median c:", statistics.median(d["c"] for d in results["cost"]["drafts"].values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
