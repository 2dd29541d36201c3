"""GPU figures for the draft the embedded default ships: training throughput (bf16-mixed vs fp32, Lightning vs a
plain loop) and the draft/target cost ratio c, on a target with SmolLM2-135M-Instruct's exact architecture.

    python -m bench.bench_gpu --assets DIR --out-dir OUT     # DIR: the target's config.json + tokenizer files

`bench/gpu.sh` prepares DIR from the cached SmolLM2 folder and runs this on a lent GPU machine. Such a machine
has no network and cannot take the 540 MB of real weights, so the target's weights are random (seeded): every
figure here is a speed figure, which depends on shapes, never on weights. Acceptance is measured on the CPU
(BENCHMARKS.md). vLLM is not installed on that machine (its CUDA wheel is far over what can be carried), so the
vLLM speculative-decoding figures are CPU-only too; c is measured with the PyTorch KV-cached decode step.

Writes OUT/gpu.json and OUT/gpu.md. Each training figure is tokens/s over `--steps` timed steps after
`--warmup`, each configuration in its own process (bench_train's workers), side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import command_line, machine_info, markdown_table

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


def train_speed(target: Path, run_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    """tokens/s of the KD step (draft fwd/bwd + online teacher fwd + AdamW) per precision × loop."""
    from bench.bench_train import _run_worker

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
    out: dict[str, Any] = {}
    plan = [(kind, precision, 0) for precision in ("bf16-mixed", "32") for kind in ("lightning", "plain")]
    plan.append(("lightning", "bf16-mixed", a.parallel_tokens))
    for kind, precision, parallel in plan:
        name = f"{kind}_{precision}" + (f"_parallel{parallel}" if parallel else "")
        t0 = time.perf_counter()
        r = _run_worker(kind, {**base, "precision": precision, "parallel_tokens": parallel}, a.threads)
        out[name] = {**r, "wall_s": round(time.perf_counter() - t0, 1)}
        print(name, out[name], flush=True)
    return out


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


def render(results: dict[str, Any]) -> str:
    cfg = results["config"]
    rows = [
        [name, f"{r['tokens_per_s']:.0f}", f"{r.get('peak_cuda_mib', 0):.0f}", str(r["steps"])]
        for name, r in results["train"].items()
    ]
    speed = markdown_table(["KD step (online teacher)", "tokens/s", "peak GPU MiB", "timed steps"], rows)
    c = results["cost"]
    c_rows = [[name, f"{d['step_ms']:.2f}", f"{d['c']:.3f}"] for name, d in c["drafts"].items()]
    cost = markdown_table(["draft", "decode step (ms)", "c = draft / target"], c_rows)
    m = results["machine"]
    bf16 = results["train"]["lightning_bf16-mixed"]["tokens_per_s"]
    fp32 = results["train"]["lightning_32"]["tokens_per_s"]
    plain = results["train"]["plain_bf16-mixed"]["tokens_per_s"]
    return "\n\n".join(
        [
            f"### GPU: {results['gpu']} ({m.get('torch', '?')}, {m['date']})",
            f"Command: `{results['command']}`. Target: SmolLM2-135M-Instruct's architecture with random "
            f"weights; draft = its first {cfg['draft_layers']} layers; batch {cfg['batch_size']} × "
            f"{cfg['seq_len']} tokens ({cfg['seq_len'] - cfg['prompt_len']} counted per row), over "
            f"{cfg['steps']} timed steps after {cfg['warmup']} warm-up.",
            speed,
            f"bf16-mixed / fp32 (Lightning): {bf16 / fp32:.2f}x; Lightning / plain loop (bf16-mixed): "
            f"{bf16 / plain:.2f}.",
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


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--assets", type=Path, required=True, help="folder with the target's config + tokenizer")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/distill-gpu"))
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--layers", default="1,2,4,6", help="draft depths for c")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--parallel-tokens", type=int, default=4, help="also time a parallel draft's step")
    p.add_argument("--allow-cpu", action="store_true", help="dry run of the script on a CPU (tiny sizes)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available() and not a.allow_cpu:
        print("bench_gpu: no CUDA device here; run it through bench/gpu.sh on a GPU machine", file=sys.stderr)
        return 2
    a.out_dir.mkdir(parents=True, exist_ok=True)
    target = build_random_target(a.assets, a.workdir / "target")
    run_dir = a.workdir / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    n_train = a.batch_size * (a.steps + a.warmup + 2)
    write_random_rows(
        run_dir, vocab, n_train=n_train, n_val=a.batch_size, seq_len=a.seq_len, prompt_len=a.prompt_len
    )
    results: dict[str, Any] = {
        "command": command_line("bench.bench_gpu", argv),
        "machine": machine_info(),
        "gpu": gpu_name(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "train": train_speed(target, run_dir, a),
        "cost": cost_ratios(
            target,
            [int(x) for x in a.layers.split(",")],
            a.dtype,
            "cuda" if torch.cuda.is_available() else "cpu",
        ),
    }
    results["machine"]["torch"] = torch.__version__
    (a.out_dir / "gpu.json").write_text(json.dumps(results, indent=2) + "\n")
    md = render(results)
    (a.out_dir / "gpu.md").write_text(md + "\n")
    print(md)
    print("median c:", statistics.median(d["c"] for d in results["cost"]["drafts"].values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
