"""`distill data`: prompts -> target-written responses (vLLM or transformers) -> `run_dir/data/{train,val}`.

Load and validate (nothing written on bad input) -> plan chunks of this job's shard -> generate missing chunks
-> assemble records (+ top-k teacher cache) per chunk, each written atomically -> when every shard is in, merge
into `datasets` folders + `manifest.json`. A killed run resumes at the first missing chunk; a finished run with
the same config does nothing. Sharded builds (`data.num_shards` = S): run S jobs with `data.shard_index` =
0..S-1 (same run.dir, e.g. on a shared disk); the job that finishes last merges, or run the merge by hand
with `distill data -c CONFIG data.num_shards=S data.merge=true`. The merge holds `data/merge.lock`
(`distill.data.lock`): a lock left by a killed merge does not block the next one.
"""

from __future__ import annotations

import datetime as _dt
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distill.config import Config, config_hash, output_view, to_dict
from distill.data import lock, store
from distill.data.config import DataConfig
from distill.data.engines import (
    dataset_responses,
    eos_ids,
    from_vllm,
    hf_generate,
    logits_from_vllm,
    vllm_env,
    vllm_job,
)
from distill.data.format import CacheMeta, data_dir, manifest_path
from distill.data.prepare import (
    SPLITS,
    Prompt,
    SourceCounts,
    SplitPrompts,
    chunks_of,
    load_splits,
    prompts_fingerprint,
    require_chat_template,
    shard_slice,
    tokenizer_hash,
)
from distill.errors import InputError, RuntimeFailure
from distill.utils.fs import atomic_write_json, read_json, remove_stale_temporaries
from distill.utils.progress import progress

log = logging.getLogger("distill.data")


@dataclass
class Context:
    cfg: Config
    target_dir: Path
    tok: Any
    engine: str  # "vllm" | "hf" | "dataset"
    data_hash: str
    prompts_hash: str
    base: Path
    clock: store.WallClock
    model: Any = None  # the target in transformers, loaded on first need

    @property
    def d(self) -> DataConfig:
        return self.cfg.data


# ---------------------------------------------------------------------------------------------------------
# Validation


def output_config(cfg: Config) -> dict[str, Any]:
    """The config that decides this stage's output (the schema's `run_only` keys left out)."""
    data = output_view(cfg.data)
    if not cfg.data.logits.top_k:
        data["logits"].pop("source", None)  # no cache: where it would come from cannot change the output
    return {"seed": cfg.run.seed, "target": to_dict(cfg.target), "data": data}


def data_hash(cfg: Config) -> str:
    return config_hash(output_config(cfg))


def choose_engine(d: DataConfig) -> str:
    from distill.utils.subproc import require_vllm, vllm_available

    if d.responses == "dataset":
        return "dataset"
    if d.engine == "vllm":
        require_vllm("data.engine")
        engine = "vllm"
    elif d.engine == "auto":
        engine = "vllm" if vllm_available() else "hf"
    else:
        engine = "hf"
    if engine == "vllm" and not d.vllm_enforce_eager and not _on_gpu():
        from distill.utils.subproc import require_cpp_compiler

        require_cpp_compiler("data.vllm_enforce_eager")
    return engine


def check_lengths(cfg: Config, target_dir: Path) -> None:
    from distill.models.draft import load_model_config

    mc = load_model_config(target_dir, trust_remote_code=cfg.target.trust_remote_code)
    limit = getattr(mc, "max_position_embeddings", None)
    need = cfg.data.max_prompt_tokens + cfg.data.max_new_tokens
    if limit and need > int(limit):
        raise InputError(
            f"data.max_prompt_tokens: max_prompt_tokens + max_new_tokens = {need} exceeds the target's context "
            f"of {limit} tokens; lower data.max_prompt_tokens or data.max_new_tokens."
        )


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            out += _diff(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else k)
        return out
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def existing_state(cfg: Config, dhash: str, prompts_hash: str | None = None) -> str:
    """'none', 'partial' (same config), 'complete' (same config, finished, outputs intact), 'damaged' (the
    manifest says complete but a split or cache folder is missing or broken) or 'stale' (another config, or
    other prompts under the same config, and data.overwrite); raises on those without data.overwrite.
    `prompts_hash` (`prompts_fingerprint`; None = not checked) is compared where the build recorded one."""
    run_dir = cfg.run_dir
    manifest = store.read_manifest(run_dir)
    previous: dict[str, Any] | None = None
    state = "none"
    if manifest is not None:
        if manifest.get("config_hash") == dhash:
            if _other_prompts(manifest, prompts_hash, partial=False):
                return _prompts_changed(cfg, manifest_path(run_dir).parent)
            problem = store.check_outputs(run_dir, manifest)
            if problem is None:
                return "complete"
            log.warning(
                "data: %s says the build is complete, but %s; discarding the manifest and rebuilding.",
                manifest_path(run_dir),
                problem,
            )
            return "damaged"
        previous = manifest.get("config")
    else:
        own = store.work_dir(run_dir, cfg.data.shard_index, cfg.data.num_shards)
        for job in sorted(data_dir(run_dir).glob("*/job.json")) + sorted(
            data_dir(run_dir).glob("shards/*/job.json")
        ):
            rec = read_json(job)
            if job.parent == own and not _has_work(own):
                continue  # this job's own earlier attempt failed before its first chunk: nothing to protect
            if rec.get("config_hash") != dhash:
                previous = rec.get("config")  # (another shard's job may still be running: never skipped)
                break
            if _other_prompts(rec, prompts_hash, partial=_has_work(job.parent)):
                return _prompts_changed(cfg, job.parent)
            state = "partial"
    if previous is None:
        return state
    if cfg.data.overwrite:
        return "stale"
    changes = "; ".join(_diff(previous, output_config(cfg))[:6]) or "unknown differences"
    raise InputError(
        f"data.overwrite: {data_dir(run_dir)} holds data built with a different config ({changes}). Refusing to "
        "mix them: set data.overwrite=true to discard the old data, or use another run.dir."
    )


def _other_prompts(record: dict[str, Any], prompts_hash: str | None, *, partial: bool) -> bool:
    """Whether `record` (a manifest or job.json) was built for other prompts than `prompts_hash`. Builds before
    2026-12-06 recorded none: a finished one is consistent in itself (its rows hold their prompts), but the
    chunks of a partial one are matched to prompts by position, and which prompts a config selects changed
    that day, so an unrecorded partial build counts as other prompts."""
    if prompts_hash is None:
        return False
    recorded = record.get("prompts_sha256")
    return partial if recorded is None else recorded != prompts_hash


def _prompts_changed(cfg: Config, where: Path) -> str:
    if cfg.data.overwrite:
        return "stale"
    raise InputError(
        f"data.source: the prompts of '{cfg.data.source}' (after the split, limits and chat template) are not "
        f"known to be the ones {where} was built from, though the config is the same: its responses may "
        "answer other prompts. Restore the source, set data.overwrite=true to discard that data and rebuild, "
        "or use another run.dir."
    )


def _has_work(base: Path) -> bool:
    """Whether a job folder holds generated or assembled chunks (its job.json alone is only a plan)."""
    chunks = base / "chunks"
    return any((base / "gen").glob("*.json")) or (chunks.is_dir() and any(chunks.iterdir()))


# ---------------------------------------------------------------------------------------------------------
# Plan


def plan(ctx: Context, splits: dict[str, SplitPrompts]) -> dict[str, list[list[Prompt]]]:
    d = ctx.d
    out = {}
    for split in SPLITS:
        ps = splits[split].prompts
        lo, hi = shard_slice(len(ps), d.shard_index, d.num_shards)
        out[split] = chunks_of(ps[lo:hi], d.batch_size)
    return out


def write_job(
    ctx: Context,
    splits: dict[str, SplitPrompts],
    source: SourceCounts,
    chunks: dict[str, list[list[Prompt]]],
) -> None:
    atomic_write_json(
        ctx.base / "job.json",
        {
            "config_hash": ctx.data_hash,
            "config": output_config(ctx.cfg),
            "prompts_sha256": ctx.prompts_hash,
            "shard_index": ctx.d.shard_index,
            "num_shards": ctx.d.num_shards,
            "source": source.to_json(),
            "splits": {
                s: {
                    "prompts_in_split": splits[s].in_split,
                    "prompts_loaded": splits[s].loaded,
                    "prompts_usable": len(splits[s].prompts),
                    "skipped": splits[s].skipped,
                    "chunks": len(chunks[s]),
                    "prompts_this_shard": sum(len(c) for c in chunks[s]),
                }
                for s in SPLITS
            },
        },
    )


# ---------------------------------------------------------------------------------------------------------
# Phase 1: generation


def _load_target(ctx: Context) -> Any:
    if ctx.model is None:
        from distill.models.draft import load_causal_lm

        ctx.model = load_causal_lm(
            ctx.target_dir, dtype=ctx.cfg.target.dtype, trust_remote_code=ctx.cfg.target.trust_remote_code
        ).eval()
    return ctx.model


def _pending_gen(ctx: Context, chunks: dict[str, list[list[Prompt]]]) -> list[tuple[str, int, list[Prompt]]]:
    return [
        (s, c, ps)
        for s in SPLITS
        for c, ps in enumerate(chunks[s])
        if not store.chunk_path(ctx.base, s, c).is_dir() and not store.gen_path(ctx.base, s, c).is_file()
    ]


def generate_hf(ctx: Context, pending: list[tuple[str, int, list[Prompt]]]) -> None:
    model = _load_target(ctx)
    eos = eos_ids(ctx.tok, ctx.target_dir)
    n_prompts = sum(len(ps) for _, _, ps in pending)
    tokens, gen_total = 0, 0.0
    with progress() as bar:
        task = bar.add_task("generate (hf)", total=n_prompts, rate="")
        for split, c, ps in pending:
            t0 = time.perf_counter()
            responses = hf_generate(model, ctx.tok, ps, ctx.d, ctx.cfg.run.seed, eos)
            gen_s = time.perf_counter() - t0
            tokens += sum(len(r["token_ids"]) for rs in responses for r in rs)
            gen_total += gen_s
            atomic_write_json(
                store.gen_path(ctx.base, split, c),
                {"responses": responses, "gen_s": gen_s, "engine": "hf", "engine_version": _tf()},
            )
            bar.update(task, advance=len(ps), rate=f"{tokens / max(gen_total, 1e-9):.0f} tok/s")
            ctx.clock.save()


def _tf() -> str:
    import transformers

    return str(transformers.__version__)


def _on_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def generate_vllm(ctx: Context, pending: list[tuple[str, int, list[Prompt]]]) -> None:
    from distill.utils.subproc import run_worker

    on_gpu = _on_gpu()
    job = vllm_job(
        model_dir=ctx.target_dir,
        dtype=ctx.cfg.target.dtype,
        trust_remote_code=ctx.cfg.target.trust_remote_code,
        cfg=ctx.d,
        run_seed=ctx.cfg.run.seed,
        chunks=[(store.gen_path(ctx.base, s, c), ps) for s, c, ps in pending],
        on_gpu=on_gpu,
    )
    log_path = ctx.cfg.run_dir / "logs" / "data-vllm-worker.log"
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_vllm, args=(pending, ctx.base, stop, ctx.clock), daemon=True)
    watcher.start()
    try:
        result = run_worker(
            job,
            log_path=log_path,
            timeout_s=ctx.d.worker_timeout_s,
            env=vllm_env(ctx.d, on_gpu),
            what="vLLM generation worker",
        )
    finally:
        stop.set()
        watcher.join(timeout=5)
    log.info("vLLM worker: %s", result)
    missing = [store.chunk_name(s, c) for s, c, _ in pending if not store.gen_path(ctx.base, s, c).is_file()]
    if missing:
        raise RuntimeFailure(
            f"the vLLM worker exited without generating chunks {missing[:5]} (log: {log_path}); rerun to resume."
        )


def _watch_vllm(
    pending: list[tuple[str, int, list[Prompt]]], base: Path, stop: threading.Event, clock: store.WallClock
) -> None:
    """Progress of the worker subprocess, read from the chunk files it writes (engine start-up shows as 0)."""
    total = sum(len(ps) for _, _, ps in pending)
    with progress() as bar:
        task = bar.add_task("generate (vllm)", total=total, rate="starting engine")
        seen: set[tuple[str, int]] = set()
        tokens, gen_s = 0, 0.0
        while not stop.is_set() or len(seen) < len(pending):
            for split, c, ps in pending:
                p = store.gen_path(base, split, c)
                if (split, c) in seen or not p.is_file():
                    continue
                seen.add((split, c))
                try:
                    g = read_json(p)
                    tokens += sum(len(r["token_ids"]) for rs in g["responses"] for r in rs)
                    gen_s += float(g["gen_s"])
                except (OSError, ValueError, KeyError):
                    pass
                bar.update(task, advance=len(ps), rate=f"{tokens / max(gen_s, 1e-9):.0f} tok/s")
            clock.save()
            if stop.wait(0.5) and (len(seen) >= len(pending) or not _any_new(pending, base, seen)):
                break


def _any_new(pending: list[tuple[str, int, list[Prompt]]], base: Path, seen: set[tuple[str, int]]) -> bool:
    return any(store.gen_path(base, s, c).is_file() for s, c, _ in pending if (s, c) not in seen)


# ---------------------------------------------------------------------------------------------------------
# Phase 2: records (+ cache) per chunk


def _responses(
    ctx: Context, split: str, c: int, ps: list[Prompt], eos: set[int]
) -> tuple[list[list[dict[str, Any]]], dict[str, Any]]:
    eos_id = int(ctx.tok.eos_token_id)
    if ctx.engine == "dataset":
        return dataset_responses(ctx.tok, ps, ctx.d, eos_id), {
            "gen_s": 0.0,
            "engine": "dataset",
            "engine_version": "",
        }
    g = store.read_gen(ctx.base, split, c)
    raw = g["responses"]
    # The hf engine already cut at EOS (engines.hf_generate); vLLM's output needs its finish reasons read.
    responses = from_vllm(raw, eos, eos_id) if g.get("engine") == "vllm" else raw
    if len(responses) != len(ps):
        raise RuntimeFailure(
            f"{store.gen_path(ctx.base, split, c)}: {len(responses)} results for {len(ps)} "
            "prompts; delete that file and rerun."
        )
    return responses, {
        "gen_s": float(g.get("gen_s", 0.0)),
        "engine": g.get("engine"),
        "engine_version": g.get("engine_version"),
    }


def build_records(ps: list[Prompt], responses: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    records = []
    for p, rs in zip(ps, responses, strict=True):
        for j, r in enumerate(rs):
            records.append(
                {
                    "prompt_id": p.prompt_id,
                    "response_index": j,
                    "prompt_len": len(p.token_ids),
                    "input_ids": [*p.token_ids, *r["token_ids"]],
                    "finished": bool(r["finished"]),
                }
            )
    return records


def assemble_chunk(ctx: Context, split: str, c: int, ps: list[Prompt], eos: set[int]) -> dict[str, Any]:
    responses, meta = _responses(ctx, split, c, ps, eos)
    records = build_records(ps, responses)
    meta.update(
        records=len(records),
        prompts=len(ps),
        prompt_tokens=sum(r["prompt_len"] for r in records),
        response_tokens=sum(len(r["input_ids"]) - r["prompt_len"] for r in records),
        truncated=sum(1 for r in records if not r["finished"]),
    )
    cache = None
    if ctx.d.logits.top_k:
        t0 = time.perf_counter()
        cache = _chunk_cache(ctx, records, responses, eos, meta)
        meta["cache_s"] = time.perf_counter() - t0
    store.write_chunk(ctx.base, split, c, records, meta, cache)
    return meta


def _chunk_cache(
    ctx: Context,
    records: list[dict[str, Any]],
    responses: list[list[dict[str, Any]]],
    eos: set[int],
    meta: dict[str, Any],
) -> tuple[CacheMeta, list[bytes], list[int]]:
    """The chunk's top-k rows, from vLLM's generation log-probs where it returned them, else a forward pass."""
    from distill.data.cache import encode_rows, rows_from_vllm, topk_rows
    from distill.models.draft import load_model_config

    k = ctx.d.logits.top_k
    vocab = int(
        load_model_config(ctx.target_dir, trust_remote_code=ctx.cfg.target.trust_remote_code).vocab_size
    )
    flat = [r for rs in responses for r in rs]
    rows: list[Any] = [None] * len(records)
    if logits_from_vllm(ctx.d, ctx.engine):
        for i, (rec, resp) in enumerate(zip(records, flat, strict=True)):
            rows[i] = rows_from_vllm(
                resp, len(rec["input_ids"]) - rec["prompt_len"], k=min(k, vocab), vocab_size=vocab
            )
    todo = [i for i, r in enumerate(rows) if r is None]
    meta["cache_rows_from_vllm"] = len(records) - len(todo)
    if todo:
        # Responses vLLM returned no log-probs for (or that gained an EOS it did not generate): forward pass.
        model = _load_target(ctx)
        pad = ctx.tok.pad_token_id if ctx.tok.pad_token_id is not None else min(eos)
        seqs = [records[i]["input_ids"] for i in todo]
        masks = [
            [0] * records[i]["prompt_len"] + [1] * (len(records[i]["input_ids"]) - records[i]["prompt_len"])
            for i in todo
        ]
        fresh = topk_rows(model, seqs, masks, k=k, batch_size=ctx.d.logits.batch_size, pad_id=pad)
        for i, r in zip(todo, fresh, strict=True):
            rows[i] = r
    blobs, counts = encode_rows(rows, vocab_size=vocab, codec=ctx.d.logits.codec)
    return CacheMeta(k=min(k, vocab), vocab_size=vocab, codec=ctx.d.logits.codec), blobs, counts


def assemble(ctx: Context, chunks: dict[str, list[list[Prompt]]]) -> None:
    todo = [
        (s, c, ps)
        for s in SPLITS
        for c, ps in enumerate(chunks[s])
        if not store.chunk_path(ctx.base, s, c).is_dir()
    ]
    if not todo:
        return
    eos = eos_ids(ctx.tok, ctx.target_dir)
    what = "records + top-k cache" if ctx.d.logits.top_k else "records"
    with progress() as bar:
        task = bar.add_task(what, total=sum(len(ps) for _, _, ps in todo), rate="")
        tokens, spent = 0, 0.0
        for split, c, ps in todo:
            t0 = time.perf_counter()
            meta = assemble_chunk(ctx, split, c, ps, eos)
            spent += time.perf_counter() - t0
            tokens += int(meta["response_tokens"])
            bar.update(task, advance=len(ps), rate=f"{tokens / max(spent, 1e-9):.0f} tok/s")
            ctx.clock.save()


# ---------------------------------------------------------------------------------------------------------
# Merge + manifest


def _shard_bases(run_dir: Path, num_shards: int) -> list[Path]:
    return [store.work_dir(run_dir, i, num_shards) for i in range(num_shards)]


def missing_shards(cfg: Config, dhash: str) -> list[int]:
    out = []
    for i, base in enumerate(_shard_bases(cfg.run_dir, cfg.data.num_shards)):
        done = base / "done.json"
        if not done.is_file() or read_json(done).get("config_hash") != dhash:
            out.append(i)
    return out


def _cache_meta(cfg: Config) -> CacheMeta:
    from distill.models.draft import load_model_config
    from distill.models.resolve import resolve_model

    target_dir = resolve_model(cfg.target.model, key="target.model", revision=cfg.target.revision)
    vocab = int(load_model_config(target_dir, trust_remote_code=cfg.target.trust_remote_code).vocab_size)
    return CacheMeta(k=min(cfg.data.logits.top_k, vocab), vocab_size=vocab, codec=cfg.data.logits.codec)


def merge(cfg: Config, dhash: str, *, engine: str, tok_hash: str) -> dict[str, Any]:
    """Join every shard's chunks into `data/<split>` (+ `data/topk/<split>`); returns the manifest, which
    `_finish` writes. Run it holding the merge lock."""
    run_dir = cfg.run_dir
    removed = store.remove_stale_output_temporaries(run_dir)
    if removed:
        log.info(
            "data: removed %d temporaries left by an interrupted merge in %s", removed, data_dir(run_dir)
        )
    bases = _shard_bases(run_dir, cfg.data.num_shards)
    jobs = [read_json(b / "job.json") for b in bases]
    splits_out: dict[str, Any] = {}
    cache_bytes, cache_tokens = 0, 0
    totals = {"gen_s": 0.0, "cache_s": 0.0, "response_tokens": 0}
    versions: set[str] = set()
    for split in SPLITS:
        records: list[dict[str, Any]] = []
        chunk_dirs: list[Path] = []
        agg = {"records": 0, "prompt_tokens": 0, "response_tokens": 0, "truncated": 0}
        for base, job in zip(bases, jobs, strict=True):
            for c in range(int(job["splits"][split]["chunks"])):
                recs, meta = store.read_chunk(base, split, c)
                records += recs
                chunk_dirs.append(store.chunk_path(base, split, c))
                for key in agg:
                    agg[key] += int(meta[key])
                totals["gen_s"] += float(meta.get("gen_s", 0.0))
                totals["cache_s"] += float(meta.get("cache_s", 0.0))
                if meta.get("engine_version"):
                    lib = {"hf": "transformers"}.get(str(meta["engine"]), str(meta["engine"]))
                    versions.add(f"{lib} {meta['engine_version']}")
        totals["response_tokens"] += agg["response_tokens"]
        store.save_split(run_dir, split, records)
        info = jobs[0]["splits"][split]
        splits_out[split] = {
            "prompts_in_split": info.get("prompts_in_split"),
            "prompts_loaded": info["prompts_loaded"],
            "skipped": info["skipped"],
            "prompts_used": info["prompts_usable"],
            "records": agg["records"],
            "prompt_tokens": agg["prompt_tokens"],
            "response_tokens": agg["response_tokens"],
            "truncated_responses": agg["truncated"],
        }
        if cfg.data.logits.top_k:
            b, t = store.merge_cache(run_dir, split, chunk_dirs, _cache_meta(cfg))
            cache_bytes += b
            cache_tokens += t
    return {
        "config_hash": dhash,
        "config": output_config(cfg),
        "prompts_sha256": jobs[0].get("prompts_sha256"),
        "target": cfg.target.model,
        "tokenizer_hash": tok_hash,
        "engine": engine,
        "engine_version": ", ".join(sorted(versions)) or None,
        "num_shards": cfg.data.num_shards,
        "source": jobs[0].get("source"),
        "splits": splits_out,
        "generation_s": round(totals["gen_s"], 3),
        "generation_tokens_per_s": (
            round(totals["response_tokens"] / totals["gen_s"], 2) if totals["gen_s"] > 0 else None
        ),
        "wall_s_last_invocation": None,  # set by _finish
        "wall_s_total": None,
        "cache": (
            {
                "top_k": cfg.data.logits.top_k,
                "codec": cfg.data.logits.codec,
                "bytes": cache_bytes,
                "tokens": cache_tokens,
                "bytes_per_token": round(cache_bytes / max(cache_tokens, 1), 2),
                "build_s": round(totals["cache_s"], 3),
            }
            if cfg.data.logits.top_k
            else None
        ),
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def print_summary(manifest: dict[str, Any], run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"distill data -> {data_dir(run_dir)}")
    for col in ("split", "prompts", "skipped", "records", "prompt tok", "response tok", "no EOS"):
        table.add_column(col, justify="right" if col != "split" else "left")
    for split, s in manifest["splits"].items():
        skipped = ", ".join(f"{v} {k}" for k, v in s["skipped"].items()) or "0"
        table.add_row(
            split,
            str(s["prompts_used"]),
            skipped,
            str(s["records"]),
            str(s["prompt_tokens"]),
            str(s["response_tokens"]),
            str(s["truncated_responses"]),
        )
    console = Console()
    src = manifest.get("source")
    if src:
        dropped = "".join(f", {n} {why.replace('_', ' ')}" for why, n in src["dropped"].items())
        console.print(
            f"source {src['source']}: {src['records_read']} records read{dropped} -> {src['unique_prompts']} "
            "prompts (before limits: " + ", ".join(f"{s} {n}" for s, n in src["by_split"].items()) + ")"
        )
    console.print(table)
    rate = manifest["generation_tokens_per_s"]
    console.print(
        f"engine: {manifest['engine']} ({manifest['engine_version']}); generation "
        f"{manifest['generation_s']:.1f} s"
        + (f", {rate:.1f} tokens/s" if rate else "")
        + f"; wall time {manifest['wall_s_total']:.1f} s over all invocations"
    )
    if manifest.get("cache"):
        c = manifest["cache"]
        console.print(
            f"top-k cache: k={c['top_k']}, {c['bytes'] / 1e6:.2f} MB, {c['bytes_per_token']} bytes/token"
        )


# ---------------------------------------------------------------------------------------------------------
# Entry point


def _validate(cfg: Config) -> tuple[Path, Any, str]:
    from distill.models.draft import load_tokenizer, remote_code_refused
    from distill.models.resolve import require_weights, resolve_model

    target_dir = resolve_model(cfg.target.model, key="target.model", revision=cfg.target.revision)
    if cfg.data.responses == "generate" or cfg.data.logits.top_k:  # the target's weights will be loaded
        require_weights(target_dir, key="target.model")
    with remote_code_refused("target", target_dir):
        tok = load_tokenizer(target_dir, trust_remote_code=cfg.target.trust_remote_code)
        check_lengths(cfg, target_dir)
    require_chat_template(tok, cfg.target.model)
    if tok.eos_token_id is None:
        raise InputError(
            f"target.model: the tokenizer of {cfg.target.model} has no EOS token; the data stage "
            "needs one to end responses. Set `eos_token` in its tokenizer_config.json."
        )
    engine = choose_engine(cfg.data)
    if cfg.data.logits.top_k and cfg.data.logits.source == "vllm" and engine != "vllm":
        raise InputError(
            f"data.logits.source: `vllm` takes the top-k from vLLM's generation, but responses come from "
            f"`{engine}` here; set data.logits.source=forward (or auto), or data.engine=vllm."
        )
    return target_dir, tok, engine


def _finish(cfg: Config, manifest: dict[str, Any], t0: float, clock: store.WallClock | None) -> int:
    """Write the manifest (wall times summed over every invocation of every shard job), drop the work folders,
    record completion, print the summary. Runs under the merge lock, so no other job merges meanwhile."""
    from distill.rundir import mark_complete

    own = clock.base if clock is not None else None
    others = sum(store.read_wall(b) for b in _shard_bases(cfg.run_dir, cfg.data.num_shards) if b != own)
    manifest["wall_s_last_invocation"] = round(time.perf_counter() - t0, 3)
    manifest["wall_s_total"] = round(others + (clock.total() if clock else time.perf_counter() - t0), 3)
    store.write_manifest(cfg.run_dir, manifest)
    store.remove_work(cfg.run_dir)
    mark_complete(
        cfg,
        "data",
        {
            "manifest": str(manifest_path(cfg.run_dir)),
            "records": {s: v["records"] for s, v in manifest["splits"].items()},
        },
    )
    print_summary(manifest, cfg.run_dir)
    return 0


def _already_complete(cfg: Config) -> None:
    """Tidy a finished build: work folders and temporaries left by a kill after the manifest, a missing
    completion record."""
    from distill.rundir import is_complete, mark_complete

    with lock.held(_lock_path(cfg)) as (got, _):
        if got:  # no merge running: nothing of the stage's is being written
            store.remove_work(cfg.run_dir)
            store.remove_stale_output_temporaries(cfg.run_dir)
    if not is_complete(cfg, "data"):
        mark_complete(cfg, "data", {"manifest": str(manifest_path(cfg.run_dir))})


def _discard_damaged(cfg: Config, dhash: str, prompts_hash: str | None = None) -> str:
    """A manifest whose outputs are gone or broken: drop it (and the completion record) so the build runs
    again; returns the state that leaves ('partial' when work folders survived, else 'none')."""
    from distill.rundir import clear_complete

    manifest_path(cfg.run_dir).unlink(missing_ok=True)
    clear_complete(cfg, "data")
    return existing_state(cfg, dhash, prompts_hash)


def _lock_path(cfg: Config) -> Path:
    return data_dir(cfg.run_dir) / "merge.lock"


def _busy(cfg: Config, holder: lock.Holder | None) -> str:
    who = holder.describe() if holder else "a job that is still writing the lock"
    return f"{_lock_path(cfg)} is held by {who}"


def _merge_and_finish(
    cfg: Config, dhash: str, target_dir: Path, tok: Any, engine: str, t0: float, clock: store.WallClock | None
) -> int:
    """Merge under the lock (already held). A job that merged just before we got the lock leaves nothing to do."""
    if existing_state(cfg, dhash) == "complete":
        print(f"data: {data_dir(cfg.run_dir)} was merged by another job meanwhile; nothing to do.")
        return 0
    manifest = merge(cfg, dhash, engine=engine, tok_hash=tokenizer_hash(target_dir, tok))
    return _finish(cfg, manifest, t0, clock)


def run_merge_only(cfg: Config, dhash: str, target_dir: Path, tok: Any, engine: str, t0: float) -> int:
    from distill.rundir import start_stage

    state = existing_state(cfg, dhash)
    if state == "complete":
        _already_complete(cfg)
        print(f"data: {data_dir(cfg.run_dir)} is already complete for this config; nothing to do.")
        return 0
    if state == "damaged":
        _discard_damaged(cfg, dhash)
    missing = missing_shards(cfg, dhash)
    if missing:
        raise InputError(
            f"data.merge: shards {missing} of {cfg.data.num_shards} are not finished (or were built "
            "with another config); run `distill data ... data.shard_index=I` for each first."
        )
    start_stage(cfg, "data")
    # force: also takes a lock whose holder cannot be checked from here (another host), never a live one here.
    with lock.held(_lock_path(cfg), force=True) as (got, holder):
        if not got:
            raise RuntimeFailure(
                f"data.merge: {_busy(cfg, holder)}, which is still running here; wait for it to finish."
            )
        return _merge_and_finish(cfg, dhash, target_dir, tok, engine, t0, None)


def _merge_busy(cfg: Config, holder: lock.Holder | None) -> int:
    if cfg.data.num_shards == 1:
        # Only this build can merge its one shard: returning 0 here would leave the stage without a manifest.
        raise RuntimeFailure(
            f"data: cannot merge: {_busy(cfg, holder)}. If that job is still running, let it finish (it writes "
            "the manifest); if it is gone, rerun with data.merge=true to take the lock over."
        )
    print(
        f"data: another job is merging the shards ({_busy(cfg, holder)}); nothing left to do here. If that job "
        "was killed, run the merge with data.merge=true."
    )
    return 0


def run(cfg: Config) -> int:
    """Build (or resume, or merge) the distillation dataset of `cfg.run.dir`."""
    from distill.rundir import start_stage

    t0 = time.perf_counter()
    target_dir, tok, engine = _validate(cfg)
    dhash = data_hash(cfg)
    if cfg.data.merge:
        return run_merge_only(cfg, dhash, target_dir, tok, engine, t0)
    # The prompts are read even when the build looks complete: an edited prompt file must not pass for it.
    splits, source = load_splits(cfg.data, tok)
    phash = prompts_fingerprint(splits)
    state = existing_state(cfg, dhash, phash)
    if state == "complete":
        _already_complete(cfg)
        print(
            f"data: {data_dir(cfg.run_dir)} is already complete for this config and these prompts; nothing to "
            f"do (delete {data_dir(cfg.run_dir)} to rebuild it)."
        )
        return 0
    start_stage(cfg, "data")
    if state == "damaged":
        state = _discard_damaged(cfg, dhash, phash)
    if state == "stale":
        log.warning("data.overwrite=true: removing %s built with another config", data_dir(cfg.run_dir))
        shutil.rmtree(data_dir(cfg.run_dir), ignore_errors=True)
    base = store.work_dir(cfg.run_dir, cfg.data.shard_index, cfg.data.num_shards)
    ctx = Context(cfg, target_dir, tok, engine, dhash, phash, base, store.WallClock(base, t0))
    for sub in (base, base / "gen", base / "chunks"):
        remove_stale_temporaries(sub)
    chunks = plan(ctx, splits)
    write_job(ctx, splits, source, chunks)
    if state == "partial":
        log.info("data: resuming in %s", base)
    try:
        pending = _pending_gen(ctx, chunks) if engine in ("hf", "vllm") else []
        if pending:
            (generate_vllm if engine == "vllm" else generate_hf)(ctx, pending)
        assemble(ctx, chunks)
    finally:
        ctx.clock.save(force=True)  # also on failure / interrupt; a kill -9 loses at most `every_s`
    atomic_write_json(base / "done.json", {"config_hash": dhash})
    missing = missing_shards(cfg, dhash)
    if missing:
        print(
            f"data: shard {cfg.data.shard_index} of {cfg.data.num_shards} done; waiting for shards {missing}. "
            "The last job to finish merges (or run with data.merge=true)."
        )
        return 0
    with lock.held(_lock_path(cfg)) as (got, holder):
        if not got:
            return _merge_busy(cfg, holder)
        return _merge_and_finish(cfg, dhash, target_dir, tok, engine, t0, ctx.clock)
