"""bfloat16 against float32 on this machine's CPU: why `target.dtype: auto` and `train.precision: auto` pick
float32 where the CPU has no bfloat16 arithmetic.

    python -m bench.bench_precision             # the embedded default's head product and decode step, 3 repeats
    python -m bench.bench_precision --quick     # tiny shapes and the tiny built-in model, 1 repeat

Times, in PyTorch on the CPU, with torch's threads at --threads: the target's output head (as nn.Linear runs
it) for one decode step (1 x 576 x 49152) and for 64 rows, one decode step of the whole target (transformers,
a 64-token context in its KV cache), and a five-layer draft's training step (forward, loss, backward on 1 x 128
tokens, small because an emulated bfloat16 step takes seconds; bfloat16 under CPU autocast, as
`train.precision=bf16-mixed`). vLLM is not timed here: its CPU
kernels take other paths (BENCHMARKS.md has the demo's generation rate in each dtype on such a host). Each repeat runs both
dtypes, the order alternating from repeat to repeat so that a drifting machine favours neither; every
measurement is the median of its calls, a call repeated until --min-seconds have passed (at least 2 calls).
Reported per operation: the median time per dtype and bfloat16 / float32 per repeat (median, min-max). Also
the CPU's bfloat16 feature flags and what `auto` resolves to here. Written to `bench/out/precision.{json,md}`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from copy import deepcopy
from pathlib import Path
from typing import Any

from bench.common import (
    OUT_DIR,
    fmt,
    markdown_table,
    median,
    order_for_repeat,
    positive_int,
    run_study,
    spread,
)

DTYPES = ("float32", "bfloat16")


def time_calls(call: Callable[[], Any], min_seconds: float) -> float:
    """Median seconds of `call` over at least 2 calls and `min_seconds`, after one untimed call."""
    call()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 2 or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return median(times)


def head_ops(hidden: int, vocab: int) -> dict[str, Callable[[Any], Callable[[], Any]]]:
    """name -> (dtype -> a call of the output head on some rows in that dtype), as nn.Linear runs it
    (F.linear with a vocab x hidden weight: oneDNN's path; `x @ w` with a hidden x vocab weight takes
    another, far slower one in bfloat16 on an AVX2 CPU)."""
    import torch
    import torch.nn.functional as F

    def product(rows: int) -> Callable[[Any], Callable[[], Any]]:
        def build(dtype: Any) -> Callable[[], Any]:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(rows, hidden, generator=gen).to(dtype)
            w = torch.randn(vocab, hidden, generator=gen).to(dtype)
            return lambda: F.linear(x, w)

        return build

    return {
        f"head, decode (1 x {hidden} x {vocab})": product(1),
        f"head, 64 rows (64 x {hidden} x {vocab})": product(64),
    }


def train_step_op(
    model_ref: str, layers: int, rows: int, seq_len: int
) -> tuple[str, Callable[[Any], Callable[[], Any]]]:
    """A draft's training step: forward, loss and backward of a `layers`-layer model of the target's shape on
    rows x seq_len tokens, float32 weights, the float32 step plain and the bfloat16 one under CPU autocast (what
    `train.precision` 32 and bf16-mixed run)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from distill.models.resolve import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(model_ref, key="--model"))
    config.num_hidden_layers = min(layers, config.num_hidden_layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(0))

    def build(dtype: Any) -> Callable[[], Any]:
        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = model(ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)

        return step

    name = f"draft train step ({config.num_hidden_layers} layers, {rows} x {seq_len} tokens, fwd + bwd)"
    return name, build


def decode_step_op(model_ref: str, context: int) -> tuple[str, Callable[[Any], Callable[[], Any]]]:
    """The target's decode step: one new token after a `context`-token prompt already in the KV cache."""
    import torch

    from distill.models.draft import load_causal_lm
    from distill.models.resolve import resolve_model

    folder = resolve_model(model_ref, key="--model")
    model32 = load_causal_lm(folder, dtype="float32").eval()

    def build(dtype: Any) -> Callable[[], Any]:
        model = deepcopy(model32).to(dtype)  # .to() converts in place: keep the float32 original
        ids = torch.randint(
            0, model.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0)
        )
        with torch.inference_mode():
            past = model(ids[:, :context], use_cache=True).past_key_values

        def step() -> Any:
            cache = deepcopy(past)  # each call decodes the same token after the same context
            with torch.inference_mode():
                return model(ids[:, context:], past_key_values=cache, use_cache=True).logits

        return step

    layers = model32.config.num_hidden_layers
    return f"target decode step ({layers} layers, {context}-token context)", build


def study(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from distill import precision

    torch.set_num_threads(args.threads)
    ops = head_ops(args.hidden, args.vocab)
    for name, build in (
        decode_step_op(args.model, args.context),
        train_step_op(args.model, args.train_layers, args.train_rows, args.train_seq_len),
    ):
        ops[name] = build
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for op, make in ops.items():
            for dtype in order_for_repeat(DTYPES, repeat):
                seconds = time_calls(make(dtypes[dtype]), args.min_seconds)
                runs.append({"op": op, "dtype": dtype, "repeat": repeat, "seconds": seconds})
    native, why = precision.native_bf16(use_gpu=False)
    features = precision.cpu_features(precision._read_cpuinfo())
    return {
        "runs": runs,
        "summary": summarize(runs),
        "native_bf16": native,
        "why": why,
        "bf16_flags": sorted(features & (precision.X86_BF16_FLAGS | {precision.ARM_BF16_FEATURE})),
        "avx512f": "avx512f" in features,
        "auto": {
            "target.dtype": "bfloat16" if native else "float32",
            "train.precision": "bf16-mixed" if native else "32",
        },
        "threads": args.threads,
        "repeats": args.repeats,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """op -> median seconds per dtype over the repeats, and bfloat16 / float32 taken within each repeat."""
    out: dict[str, dict[str, Any]] = {}
    for op in dict.fromkeys(r["op"] for r in runs):
        mine = [r for r in runs if r["op"] == op]
        by_repeat: dict[int, dict[str, float]] = {}
        for r in mine:
            by_repeat.setdefault(r["repeat"], {})[r["dtype"]] = r["seconds"]
        ratios = [
            d["bfloat16"] / d["float32"] for d in by_repeat.values() if len(d) == 2 and d["float32"] > 0
        ]
        out[op] = {
            **{f"{dt}_s": median([r["seconds"] for r in mine if r["dtype"] == dt]) for dt in DTYPES},
            "bf16_over_fp32": spread(ratios),
        }
    return out


def render(payload: dict[str, Any]) -> str:
    rows = []
    for op, s in payload["summary"].items():
        ratio = s["bf16_over_fp32"]
        rows.append(
            [
                op,
                fmt(s["float32_s"] * 1e3, 2),
                fmt(s["bfloat16_s"] * 1e3, 2),
                f"{fmt(ratio['median'], 2)} ({fmt(ratio['min'], 2)}–{fmt(ratio['max'], 2)}, n={ratio['n']})",
            ]
        )
    flags = ", ".join(payload["bf16_flags"]) or "none"
    head = (
        f"bfloat16 feature flags: {flags} (avx512f: {'yes' if payload['avx512f'] else 'no'}); `auto` here: "
        f"target.dtype={payload['auto']['target.dtype']}, train.precision={payload['auto']['train.precision']} "
        f"({payload['why']}). torch threads: {payload['threads']}; {payload['repeats']} repeats, dtypes alternated."
    )
    table = markdown_table(
        ["operation", "float32 ms", "bfloat16 ms", "bfloat16 / float32 (per repeat)"], rows
    )
    return f"{head}\n\n{table}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="target whose decode step is timed")
    p.add_argument("--hidden", type=positive_int, default=576, help="head product: hidden size")
    p.add_argument("--vocab", type=positive_int, default=49152, help="head product: vocabulary size")
    p.add_argument(
        "--context", type=positive_int, default=64, help="decode step: tokens already in the cache"
    )
    p.add_argument("--train-layers", type=positive_int, default=5, help="train step: the draft's layers")
    p.add_argument("--train-rows", type=positive_int, default=1, help="train step: rows per step")
    p.add_argument("--train-seq-len", type=positive_int, default=128, help="train step: tokens per row")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--min-seconds", type=float, default=2.0, help="time each measurement at least this long")
    p.add_argument("--quick", action="store_true", help="tiny shapes and model, 1 repeat (a self-check)")
    p.add_argument("--name", default="precision")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.hidden, args.vocab, args.context = "tiny-llama", 64, 512, 8
        args.train_layers, args.train_rows, args.train_seq_len = 2, 2, 16
        args.repeats, args.min_seconds = 1, 0.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _, rc = run_study("bench.bench_precision", study, render, args, argv)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
