"""Data-stage benchmark on the embedded default (SmolLM2-135M-Instruct target, ShareGPT prompts).

1. Generation speed: the same prompts through `distill data` with `data.engine=vllm` and `data.engine=hf`
   (greedy, float32); tokens/s of each (from the manifests) and the ratio vLLM / hf.
2. Teacher cache size: bytes per cached token at k = 16, 64, 128 for each codec, next to the naive layout
   (uint16 ids + fp16 log-probs + fp32 rest = 4k + 4 bytes) and DistillKit's ~300 B/token at k=128.

    .venv/bin/python -m bench.bench_data --prompts 64 --out bench/results/data.json
    .venv/bin/python -m bench.bench_data --skip-vllm --prompts 16 --max-new-tokens 64   # quick

Slow: vLLM start-up alone is 1-2 minutes on a busy 2-core CPU. Every figure printed is measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "smollm2-sharegpt.yaml")


def run_stage(
    run_dir: Path, engine: str, args: argparse.Namespace, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    from distill.cli import main

    overrides = [
        f"run.dir={run_dir}",
        f"data.engine={engine}",
        f"data.max_train_prompts={args.prompts}",
        "data.max_val_prompts=1",
        f"data.max_new_tokens={args.max_new_tokens}",
        f"data.batch_size={args.batch_size}",
        "data.temperature=0",
        f"target.dtype={args.dtype}",
        "data.logits.top_k=0",  # generation speed alone; the cache is measured separately below
        *extra,
    ]
    t0 = time.perf_counter()
    rc = main(["data", "-c", CONFIG, *overrides])
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"distill data with engine={engine} failed (exit {rc})")
    manifest = json.loads((run_dir / "data" / "manifest.json").read_text())
    tr = manifest["splits"]["train"]
    return {
        "engine": engine,
        "engine_version": manifest["engine_version"],
        "prompts": tr["prompts_used"],
        "response_tokens": tr["response_tokens"] + manifest["splits"]["val"]["response_tokens"],
        "generation_s": manifest["generation_s"],
        "tokens_per_s": manifest["generation_tokens_per_s"],
        "wall_s_including_startup": round(wall, 2),
    }


def eager_study(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM generation eager vs compiled (`data.vllm_enforce_eager`), alternated `--repeats` times, fresh run
    folders each time so every pass generates all prompts; medians and min-max of tokens/s and start-up."""
    import statistics

    passes: dict[str, list[dict[str, Any]]] = {"eager": [], "compiled": []}
    for r in range(args.repeats):
        for mode, flag in (("eager", "true"), ("compiled", "false")):
            res = run_stage(work / f"{mode}-{r}", "vllm", args, (f"data.vllm_enforce_eager={flag}",))
            res["startup_s"] = round(res["wall_s_including_startup"] - res["generation_s"], 1)
            passes[mode].append(res)
            print(
                f"{mode} pass {r}: {res['tokens_per_s']} tokens/s, start-up {res['startup_s']} s", flush=True
            )
    summary: dict[str, Any] = {"passes": passes}
    for mode, rows in passes.items():
        tps = [float(x["tokens_per_s"]) for x in rows]
        summary[mode] = {
            "tokens_per_s_median": round(statistics.median(tps), 1),
            "tokens_per_s_min": round(min(tps), 1),
            "tokens_per_s_max": round(max(tps), 1),
            "startup_s_median": round(statistics.median(float(x["startup_s"]) for x in rows), 1),
            "wall_s_median": round(statistics.median(float(x["wall_s_including_startup"]) for x in rows), 1),
        }
    summary["compiled_over_eager"] = round(
        summary["compiled"]["tokens_per_s_median"] / summary["eager"]["tokens_per_s_median"], 3
    )
    summary["identical_responses"] = round(agreement(work / "compiled-0", work / "eager-0"), 3)
    return summary


def agreement(a: Path, b: Path) -> float:
    from distill.data.format import load_split_dataset

    x, y = load_split_dataset(a, "train"), load_split_dataset(b, "train")
    same = sum(p == q for p, q in zip(x["input_ids"], y["input_ids"], strict=True))
    return same / max(len(x), 1)


def cache_sizes(run_dir: Path, ks: list[int], codecs: list[str], max_rows: int) -> list[dict[str, Any]]:
    import torch

    from distill.data.cache import encode_rows, topk_rows
    from distill.data.format import load_split_dataset
    from distill.models.draft import load_causal_lm
    from distill.models.resolve import resolve_model

    target = resolve_model("smollm2-135m-instruct", key="target.model")
    model = load_causal_lm(target).eval()
    ds = load_split_dataset(run_dir, "train").select(
        range(min(max_rows, len(load_split_dataset(run_dir, "train"))))
    )
    seqs, masks = list(ds["input_ids"]), list(ds["loss_mask"])
    vocab = int(model.config.vocab_size)
    out = []
    for k in ks:
        t0 = time.perf_counter()
        with torch.no_grad():
            rows = topk_rows(
                model, seqs, masks, k=k, batch_size=4, pad_id=int(model.config.eos_token_id or 0)
            )
        forward_s = time.perf_counter() - t0
        tokens = sum(int(r[0].shape[0]) for r in rows)
        for codec in codecs:
            t1 = time.perf_counter()
            blobs, _ = encode_rows(rows, vocab_size=vocab, codec=codec)
            enc_s = time.perf_counter() - t1
            size = sum(len(b) for b in blobs)
            out.append(
                {
                    "k": k,
                    "codec": codec,
                    "tokens": tokens,
                    "bytes": size,
                    "bytes_per_token": round(size / tokens, 1),
                    "naive_bytes_per_token": 4 * k + 4,
                    "encode_s": round(enc_s, 3),
                    "forward_s": round(forward_s, 2),
                }
            )
            print(
                f"k={k:4d} {codec:5s}: {size / tokens:7.1f} B/token (naive {4 * k + 4}), "
                f"encode {enc_s:.2f} s",
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=52, help="train prompts that fit (the 52 of the first 64)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--ks", default="16,64,128")
    p.add_argument("--codecs", default="zlib,lzma")
    p.add_argument("--cache-rows", type=int, default=32, help="sequences used for the cache-size measurement")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument(
        "--eager-study",
        action="store_true",
        help="only compare vLLM generation eager vs compiled (data.vllm_enforce_eager), --repeats times each",
    )
    p.add_argument("--repeats", type=int, default=2, help="passes per mode in --eager-study")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--workdir", type=Path, default=None, help="keep run folders here (default: a temp dir)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = args.workdir or Path(tmp)
        results: dict[str, Any] = {
            "config": CONFIG,
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "dtype": args.dtype,
            "host_cpus": os.cpu_count(),
        }
        if args.eager_study:
            results["eager_study"] = eager_study(work, args)
            return write_results(results, args.out)
        hf = run_stage(work / "hf", "hf", args)
        results["hf"] = hf
        print(f"hf:   {hf['tokens_per_s']} tokens/s ({hf['response_tokens']} tokens)", flush=True)
        if not args.skip_vllm:
            vl = run_stage(work / "vllm", "vllm", args)
            results["vllm"] = vl
            results["vllm_over_hf"] = round(vl["tokens_per_s"] / hf["tokens_per_s"], 2)
            results["greedy_agreement"] = round(agreement(work / "vllm", work / "hf"), 3)
            print(
                f"vllm: {vl['tokens_per_s']} tokens/s -> ratio {results['vllm_over_hf']}x; "
                f"identical responses {results['greedy_agreement']:.0%}",
                flush=True,
            )
        ks = [int(k) for k in args.ks.split(",")]
        results["cache"] = cache_sizes(work / "hf", ks, args.codecs.split(","), args.cache_rows)
        results["distillkit_reference_bytes_per_token_k128"] = 300
    return write_results(results, args.out)


def write_results(results: dict[str, Any], out: Path | None) -> int:
    text = json.dumps(results, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
