"""Data-stage benchmark on the embedded default (SmolLM2-135M-Instruct target, ShareGPT prompts).

1. Generation speed: the same prompts through `distill data` with `data.engine=vllm` and `data.engine=hf`
   (greedy, float32), `--repeats` passes of each, the engines alternating (hf, vllm, then vllm, hf, ...) and
   every pass in a fresh run folder; tokens/s of each (from the manifests: median, min–max) and the ratio
   vLLM / hf taken per repeat.
2. Teacher cache size: bytes per cached token at k = 16, 64, 128 for each codec, next to the naive layout
   (uint16 ids + fp16 log-probs + fp32 rest = 4k + 4 bytes) and DistillKit's ~300 B/token at k=128.

    .venv/bin/python -m bench.bench_data --prompts 64                  # bench/out/data.{json,md}
    .venv/bin/python -m bench.bench_data --skip-vllm --prompts 16 --max-new-tokens 64 --repeats 1   # quick

`--eager-study` compares vLLM generation compiled vs eager; `--batch-sizes 64,128,256` compares vLLM generation
at those `data.batch_size` values with the shipped config's teacher cache (top-k log-probs from vLLM) included,
as the demo's data stage runs, the ratios taken against the first size; `--stream-study` compares one generate
call per batch with requests streamed across batches (`data.vllm_stream`), the teacher cache included too.

Slow: vLLM start-up alone is 1-2 minutes on a busy 2-core CPU, and each of the --repeats (default 3) passes
starts it again. Every figure printed is measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, get_args, get_type_hints

from bench.common import (
    OUT_DIR,
    command_line,
    fmt,
    int_list,
    machine_info,
    markdown_table,
    median,
    order_for_repeat,
    positive_int,
    spread,
    write_fragment,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "smollm2-sharegpt.yaml")
DTYPES = ("float32", "bfloat16", "float16")
DISTILLKIT_BYTES_PER_TOKEN_K128 = 300


class StageFailed(Exception):
    """`distill data` exited non-zero: the bench exits with the same status (2 = an input error)."""

    def __init__(self, engine: str, rc: int) -> None:
        super().__init__(f"distill data with engine={engine} failed (exit {rc})")
        self.rc = rc


def codecs() -> tuple[str, ...]:
    """The cache codecs `data.logits.codec` accepts (the config schema is the one list)."""
    from distill.data.config import LogitsConfig

    return get_args(get_type_hints(LogitsConfig)["codec"])


def codec_list(text: str) -> list[str]:
    """argparse `type=` for `--codecs zlib,lzma`: unknown names are an input error up front."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    known = codecs()
    bad = [n for n in names if n not in known]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of {', '.join(known)}")
    return names


def run_stage(
    run_dir: Path, engine: str, args: argparse.Namespace, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    from distill.cli import main

    # Generation speed alone, unless a study asks for the shipped config's teacher cache (the cache's size is
    # measured separately, by cache_sizes).
    shipped_cache = getattr(args, "batch_sizes", None) or getattr(args, "stream_study", False)
    no_cache = () if shipped_cache else ("data.logits.top_k=0",)
    overrides = [
        f"run.dir={run_dir}",
        f"data.engine={engine}",
        f"data.max_train_prompts={args.prompts}",
        "data.max_val_prompts=1",
        f"data.max_new_tokens={args.max_new_tokens}",
        f"data.batch_size={args.batch_size}",
        "data.temperature=0",
        f"target.dtype={args.dtype}",
        *no_cache,
        *extra,
    ]
    t0 = time.perf_counter()
    rc = main(["data", "-c", CONFIG, *overrides])
    wall = time.perf_counter() - t0
    if rc != 0:
        raise StageFailed(engine, rc)
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
        "startup_s": round(wall - manifest["generation_s"], 1),
    }


def run_passes(
    work: Path, args: argparse.Namespace, modes: dict[str, tuple[str, tuple[str, ...]]]
) -> dict[str, list[dict[str, Any]]]:
    """`args.repeats` passes of each mode (name -> (engine, overrides)), each in a fresh run folder
    `work/<name>-<repeat>`; the order reverses every repeat (A B, B A, ...) so a drifting machine favours
    neither side."""
    passes: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
    names = list(modes)
    for r in range(args.repeats):
        for name in order_for_repeat(names, r):
            engine, extra = modes[name]
            res = run_stage(work / f"{name}-{r}", engine, args, extra)
            passes[name].append(res)
            print(
                f"{name} pass {r}: {res['tokens_per_s']} tokens/s, start-up {res['startup_s']} s", flush=True
            )
    return passes


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and min–max of one mode's passes."""
    tps = spread([float(x["tokens_per_s"]) for x in rows])
    return {
        "tokens_per_s_median": round(tps["median"], 1),
        "tokens_per_s_min": round(tps["min"], 1),
        "tokens_per_s_max": round(tps["max"], 1),
        "n": tps["n"],
        "response_tokens": [int(x["response_tokens"]) for x in rows],
        "generation_s_median": round(median([float(x["generation_s"]) for x in rows]), 1),
        "startup_s_median": round(median([float(x["startup_s"]) for x in rows]), 1),
        "wall_s_median": round(median([float(x["wall_s_including_startup"]) for x in rows]), 1),
    }


def ratio_per_repeat(num: list[dict[str, Any]], den: list[dict[str, Any]]) -> dict[str, Any]:
    """tokens/s of `num` over `den`, repeat by repeat (the two passes of a repeat ran back to back)."""
    ratios = [float(a["tokens_per_s"]) / float(b["tokens_per_s"]) for a, b in zip(num, den, strict=True)]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in spread(ratios).items()}


def two_mode_study(
    work: Path, args: argparse.Namespace, key: str, base: tuple[str, str], new: tuple[str, str]
) -> dict[str, Any]:
    """vLLM generation in two modes of the config key `key`, each (name, value), `--repeats` passes each
    (run_passes, `base` first); medians and min-max of tokens/s and start-up, the ratio new / base per repeat
    (`<new>_over_<base>`, names with `_` for `-`) and the share of identical responses in repeat 0."""
    passes = run_passes(work, args, {name: ("vllm", (f"{key}={value}",)) for name, value in (base, new)})
    summary: dict[str, Any] = {"passes": passes}
    for mode, rows in passes.items():
        summary[mode] = summarize(rows)
    ratio = ratio_per_repeat(passes[new[0]], passes[base[0]])
    label = f"{new[0]}_over_{base[0]}".replace("-", "_")
    summary[label] = ratio["median"]
    summary[f"{label}_per_repeat"] = ratio
    summary["identical_responses"] = round(agreement(work / f"{new[0]}-0", work / f"{base[0]}-0"), 3)
    return summary


def eager_study(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM generation eager vs compiled (`data.vllm_enforce_eager`); the ratio compiled / eager."""
    return two_mode_study(work, args, "data.vllm_enforce_eager", ("eager", "true"), ("compiled", "false"))


def batch_name(size: int) -> str:
    return f"batch-{size}"


def batch_study(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM generation at each of `args.batch_sizes` (`data.batch_size`: the prompts one `LLM.generate` call
    holds), `--repeats` passes each (run_passes); the ratio of each size's tokens/s to the first size's, per
    repeat."""
    names = {batch_name(b): b for b in args.batch_sizes}
    passes = run_passes(work, args, {n: ("vllm", (f"data.batch_size={b}",)) for n, b in names.items()})
    summary: dict[str, Any] = {"passes": passes, "sizes": list(args.batch_sizes)}
    first = batch_name(args.batch_sizes[0])
    for name, rows in passes.items():
        summary[name] = summarize(rows)
        if name != first:
            summary[name]["over_first_per_repeat"] = ratio_per_repeat(rows, passes[first])
    return summary


def stream_study(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM generation with one generate call per batch (`per-batch`) vs requests streamed across batches
    (`streamed`, `data.vllm_stream`); the ratio streamed / per-batch."""
    return two_mode_study(work, args, "data.vllm_stream", ("per-batch", "false"), ("streamed", "true"))


def engine_study(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """hf (and, unless --skip-vllm, vLLM) generation, `--repeats` alternating passes (run_passes)."""
    modes: dict[str, tuple[str, tuple[str, ...]]] = {"hf": ("hf", ())}
    if not args.skip_vllm:
        modes["vllm"] = ("vllm", ())
    passes = run_passes(work, args, modes)
    out: dict[str, Any] = {"passes": passes, **{name: summarize(rows) for name, rows in passes.items()}}
    if "vllm" in passes:
        ratio = ratio_per_repeat(passes["vllm"], passes["hf"])
        out["vllm_over_hf"] = ratio["median"]
        out["vllm_over_hf_per_repeat"] = ratio
        out["greedy_agreement"] = round(agreement(work / "vllm-0", work / "hf-0"), 3)
    return out


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


# ---------------------------------------------------------------------------------------------------------
# Markdown


def _speed_rows(results: dict[str, Any], names: list[str]) -> list[list[str]]:
    rows = []
    for name in names:
        s = results[name]
        rows.append(
            [
                name,
                ", ".join(str(t) for t in dict.fromkeys(s["response_tokens"])),
                f"{fmt(s['tokens_per_s_median'], 1)} ({fmt(s['tokens_per_s_min'], 1)}–"
                f"{fmt(s['tokens_per_s_max'], 1)}, n={s['n']})",
                fmt(s["generation_s_median"], 1),
                fmt(s["startup_s_median"], 1),
            ]
        )
    return rows


SPEED_HEADER = [
    "engine",
    "tokens",
    "tokens/s (median, min–max)",
    "generation s (median)",
    "start-up s (median)",
]


def _ratio_line(label: str, ratio: dict[str, Any]) -> str:
    return (
        f"{label} tokens/s, per repeat: **{ratio['median']:.2f}x** ({ratio['min']:.2f}–{ratio['max']:.2f}, "
        f"n={ratio['n']})"
    )


def render_markdown(results: dict[str, Any]) -> str:
    setup = (
        f"{results['prompts']} train prompts (at most), {results['max_new_tokens']} new tokens, greedy, "
        f"{results['dtype']}, batch {results['batch_size']}; {results['repeats']} pass(es) per mode, the modes "
        "alternating in order, each pass a fresh run folder and engine."
    )
    if "batch_study" in results:
        b = results["batch_study"]
        names = [batch_name(x) for x in b["sizes"]]
        setup = setup.replace(f"batch {results['batch_size']}", "the shipped config's top-k cache from vLLM")
        return "\n\n".join(
            [
                "### Data stage: vLLM generation by batch size (`data.batch_size`)",
                markdown_table(SPEED_HEADER, _speed_rows(b, names)),
                "; ".join(_ratio_line(f"{n} / {names[0]}", b[n]["over_first_per_repeat"]) for n in names[1:]),
                setup,
            ]
        )
    if "stream_study" in results:
        st = results["stream_study"]
        setup = setup.replace(
            f"batch {results['batch_size']}",
            f"batch {results['batch_size']}, the shipped config's top-k cache",
        )
        return "\n\n".join(
            [
                "### Data stage: one vLLM generate call per batch vs requests streamed across batches "
                "(`data.vllm_stream`)",
                markdown_table(SPEED_HEADER, _speed_rows(st, ["per-batch", "streamed"])),
                _ratio_line("streamed / per-batch", st["streamed_over_per_batch_per_repeat"])
                + f"; identical greedy responses (repeat 0): {st['identical_responses']:.0%}.",
                setup,
            ]
        )
    if "eager_study" in results:
        e = results["eager_study"]
        return "\n\n".join(
            [
                "### Data stage: vLLM generation eager vs compiled (`data.vllm_enforce_eager`)",
                markdown_table(SPEED_HEADER, _speed_rows(e, ["eager", "compiled"])),
                _ratio_line("compiled / eager", e["compiled_over_eager_per_repeat"])
                + f"; identical greedy responses (repeat 0): {e['identical_responses']:.0%}.",
                setup,
            ]
        )
    g = results["generation"]
    parts = [
        "### Data stage: generation speed and teacher-cache size",
        markdown_table(SPEED_HEADER, _speed_rows(g, [n for n in ("hf", "vllm") if n in g])),
    ]
    if "vllm_over_hf_per_repeat" in g:
        parts.append(
            _ratio_line("vLLM / hf", g["vllm_over_hf_per_repeat"])
            + f"; identical greedy responses (repeat 0): {g['greedy_agreement']:.0%}."
        )
    parts.append(setup)
    cache = results.get("cache") or []
    if cache:
        names = list(dict.fromkeys(c["codec"] for c in cache))
        by_k: dict[int, dict[str, Any]] = {}
        for c in cache:
            row = by_k.setdefault(c["k"], {"naive": c["naive_bytes_per_token"]})
            row[c["codec"]] = c
        rows = [
            [str(k), *(fmt(v[n]["bytes_per_token"], 1) for n in names), str(v["naive"])]
            for k, v in by_k.items()
        ]
        parts += [
            f"Top-k teacher cache, {cache[0]['tokens']} response tokens (naive = uint16 ids + fp16 log-probs "
            f"+ fp32 rest mass; DistillKit: ~{DISTILLKIT_BYTES_PER_TOKEN_K128} B/token at k=128):",
            markdown_table(["k", *(f"{n} B/token" for n in names), "naive B/token"], rows),
        ]
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------------------
# Driver


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--prompts", type=positive_int, default=52, help="train prompts that fit (the 52 of the first 64)"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--ks", type=int_list, default=[16, 64, 128], help="cache sizes, e.g. 16,64,128")
    p.add_argument("--codecs", type=codec_list, default=["zlib", "lzma"], help="e.g. zlib,lzma")
    p.add_argument(
        "--cache-rows", type=positive_int, default=32, help="sequences used for the cache-size measurement"
    )
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument(
        "--eager-study",
        action="store_true",
        help="only compare vLLM generation eager vs compiled (data.vllm_enforce_eager), --repeats times each",
    )
    p.add_argument(
        "--batch-sizes",
        type=int_list,
        default=None,
        help="only compare vLLM generation at these data.batch_size values (e.g. 64,128,256), the shipped "
        "config's teacher cache included; --repeats passes each",
    )
    p.add_argument(
        "--stream-study",
        action="store_true",
        help="only compare one vLLM generate call per batch with requests streamed across batches "
        "(data.vllm_stream), the shipped config's teacher cache included; --repeats passes each",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="passes per engine (or per mode in --eager-study), alternating; medians and per-repeat ratios",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON (its .md beside it); default bench/out/data.json (data-eager-study.json, "
        "data-batch-study.json, data-stream-study.json)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep run folders here, a new or empty one (default: a temp dir)",
    )
    args = p.parse_args(argv)
    if args.batch_sizes is not None and (
        len(set(args.batch_sizes)) != len(args.batch_sizes) or len(args.batch_sizes) < 2
    ):
        p.error(f"--batch-sizes: {args.batch_sizes}: give two or more different sizes, e.g. 64,128")
    studies = [
        n
        for n, on in (
            ("--batch-sizes", args.batch_sizes),
            ("--eager-study", args.eager_study),
            ("--stream-study", args.stream_study),
        )
        if on
    ]
    if len(studies) > 1:
        p.error(f"{' and '.join(studies)}: give one study at a time")
    if args.out is None:
        stem = (
            "data-batch-study"
            if args.batch_sizes
            else "data-eager-study"
            if args.eager_study
            else "data-stream-study"
            if args.stream_study
            else "data"
        )
        args.out = OUT_DIR / f"{stem}.json"
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        # A finished build there makes `distill data` report "already complete" and the bench would report
        # that old manifest's tokens/s as new.
        p.error(f"--workdir: {args.workdir} is not empty; give a new or empty folder")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    machine = machine_info()
    results: dict[str, Any] = {
        "config": CONFIG,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "dtype": args.dtype,
        "repeats": args.repeats,
    }
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = args.workdir or Path(tmp)
        try:
            if args.batch_sizes:
                results["batch_study"] = batch_study(work, args)
            elif args.eager_study:
                results["eager_study"] = eager_study(work, args)
            elif args.stream_study:
                results["stream_study"] = stream_study(work, args)
            else:
                results["generation"] = engine_study(work, args)
                results["cache"] = cache_sizes(work / "hf-0", args.ks, args.codecs, args.cache_rows)
                results["distillkit_reference_bytes_per_token_k128"] = DISTILLKIT_BYTES_PER_TOKEN_K128
        except StageFailed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.rc
    md = render_markdown(results)
    out: Path = args.out
    write_fragment(
        out.stem,
        results,
        md,
        command=command_line("bench.bench_data", argv),
        machine=machine,
        out_dir=out.parent,
        show=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
