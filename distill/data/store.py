"""Work folders of the data stage: resumable chunks, shard bookkeeping, and the final merge.

    data/work/                 (num_shards == 1)   or   data/shards/<i>/   (one per parallel job)
        job.json               config hash + plan of this job
        gen/<split>-<c>.json   generated responses of chunk c (written by the engine as soon as produced)
        chunks/<split>-<c>/    records.json, meta.json, topk/ (one atomic folder per chunk: complete or absent)
        wall.json              this job's wall time summed over its invocations (resumes included)
        done.json              all chunks of this job are in

A chunk is `data.batch_size` consecutive prompts of this job's contiguous block of each split, so the plan is a
pure function of the config: a rerun skips what exists and continues. The merge concatenates shards 0..S-1 and
their chunks in order (= the prompts' order), writes `data/<split>`, `data/topk/<split>` and `manifest.json`,
then removes the work folders. The merge runs under `data/merge.lock` (`distill.data.lock`); a merge killed
mid-write leaves `.train.*.tmp`-style folders that the next merge removes (`remove_stale_output_temporaries`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from distill.data.format import (
    CacheMeta,
    TopKCache,
    data_dir,
    manifest_path,
    split_dir,
    topk_dir,
    write_cache_folder,
)
from distill.data.prepare import SPLITS
from distill.utils.fs import atomic_dir, atomic_write_json, read_json

FEATURES_SPEC = {"input_ids": "int32", "loss_mask": "int8", "prompt_id": "string", "response_index": "int32"}


def work_dir(run_dir: Path, shard_index: int, num_shards: int) -> Path:
    if num_shards == 1:
        return data_dir(run_dir) / "work"
    return data_dir(run_dir) / "shards" / str(shard_index)


def chunk_name(split: str, c: int) -> str:
    return f"{split}-{c:05d}"


def gen_path(base: Path, split: str, c: int) -> Path:
    return base / "gen" / f"{chunk_name(split, c)}.json"


def chunk_path(base: Path, split: str, c: int) -> Path:
    return base / "chunks" / chunk_name(split, c)


def read_gen(base: Path, split: str, c: int) -> dict[str, Any]:
    obj = read_json(gen_path(base, split, c))
    assert isinstance(obj, dict)
    return obj


def write_chunk(
    base: Path,
    split: str,
    c: int,
    records: list[dict[str, Any]],
    meta: dict[str, Any],
    cache: tuple[CacheMeta, list[bytes], list[int]] | None,
) -> None:
    """All of a chunk or nothing: the folder appears in one rename (disk full -> RuntimeFailure, no trace)."""
    with atomic_dir(chunk_path(base, split, c), replace=True) as tmp:
        with open(tmp / "records.json", "w", encoding="utf-8") as f:
            json.dump(records, f)
        if cache is not None:
            cmeta, blobs, rows = cache
            meta["cache_bytes"] = write_cache_folder(tmp / "topk", cmeta, blobs, rows)
        with open(tmp / "meta.json", "w", encoding="utf-8") as f:
            json.dump(meta, f)


def read_chunk(base: Path, split: str, c: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    folder = chunk_path(base, split, c)
    records = json.loads((folder / "records.json").read_text(encoding="utf-8"))
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    return records, meta


def to_columns(records: list[dict[str, Any]]) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "prompt_id": [], "response_index": []}
    for r in records:
        n_prompt = int(r["prompt_len"])
        cols["input_ids"].append(r["input_ids"])
        cols["loss_mask"].append([0] * n_prompt + [1] * (len(r["input_ids"]) - n_prompt))
        cols["prompt_id"].append(r["prompt_id"])
        cols["response_index"].append(int(r["response_index"]))
    return cols


def _features() -> Any:
    import datasets

    return datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
            "prompt_id": datasets.Value("string"),
            "response_index": datasets.Value("int32"),
        }
    )


def save_split(run_dir: Path, split: str, records: list[dict[str, Any]]) -> None:
    import datasets

    ds = datasets.Dataset.from_dict(to_columns(records), features=_features())
    with atomic_dir(split_dir(run_dir, split), replace=True) as tmp:
        # num_shards=1: datasets writes 0 shards for an empty split, which load_from_disk cannot read back.
        ds.save_to_disk(str(tmp), num_shards=1 if len(ds) == 0 else None)


def merge_cache(run_dir: Path, split: str, chunk_dirs: list[Path], empty_meta: CacheMeta) -> tuple[int, int]:
    """Concatenate the chunks' caches into `data/topk/<split>`. Returns (bytes, cached positions)."""
    metas = [json.loads((d / "topk" / "meta.json").read_text()) for d in chunk_dirs]
    with atomic_dir(topk_dir(run_dir, split), replace=True) as tmp:
        offsets, rows = [np.zeros(1, dtype=np.int64)], []
        pos = 0
        with open(tmp / "blobs.bin", "wb") as out:
            for d in chunk_dirs:
                idx = np.load(d / "topk" / "index.npy")
                with open(d / "topk" / "blobs.bin", "rb") as f:
                    shutil.copyfileobj(f, out)
                offsets.append(idx[1:] + pos)
                pos += int(idx[-1])
                rows.append(np.load(d / "topk" / "rows.npy"))
        np.save(tmp / "index.npy", np.concatenate(offsets))
        all_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        np.save(tmp / "rows.npy", all_rows)
        meta = metas[0] if metas else empty_meta.to_json()  # an empty split still opens
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        size = sum(p.stat().st_size for p in tmp.iterdir())
    return size, int(all_rows.sum())


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    atomic_write_json(manifest_path(run_dir), manifest)


def read_manifest(run_dir: Path) -> dict[str, Any] | None:
    p = manifest_path(run_dir)
    if not p.is_file():
        return None
    try:
        obj = read_json(p)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def remove_work(run_dir: Path) -> None:
    for p in (data_dir(run_dir) / "work", data_dir(run_dir) / "shards"):
        if p.exists():
            shutil.rmtree(p, ignore_errors=True)


def check_outputs(run_dir: Path, manifest: dict[str, Any]) -> str | None:
    """Why the outputs `manifest` describes are not all there (and readable, with its row counts); None if they
    are. Cheap: the datasets are memory-mapped, the cache's index read."""
    import datasets

    for split, info in manifest.get("splits", {}).items():
        want = int(info.get("records", -1))
        folder = split_dir(run_dir, split)
        try:
            n = len(datasets.load_from_disk(str(folder)))
        except Exception as exc:  # missing folder, deleted arrow file, bad json: all mean "not usable"
            return f"{folder} is missing or unreadable ({type(exc).__name__}: {exc})"
        if n != want:
            return f"{folder} holds {n} rows where the manifest says {want}"
        if manifest.get("cache"):
            cdir = topk_dir(run_dir, split)
            try:
                cache = TopKCache(cdir)
                blobs = (cdir / "blobs.bin").stat().st_size
            except Exception as exc:
                return f"the top-k cache {cdir} is missing or unreadable ({type(exc).__name__}: {exc})"
            if len(cache) != want or blobs != cache.blob_bytes():
                return f"the top-k cache {cdir} does not match {folder} (cut off, or from another build)"
    return None


_OUTPUT_TEMPORARIES = {
    "": (*(f".{s}." for s in SPLITS), ".manifest.json.", ".merge.lock."),
    "topk": tuple(f".{s}." for s in SPLITS),
}


def remove_stale_output_temporaries(run_dir: Path) -> int:
    """Delete what a merge killed mid-write leaves in `data/` and `data/topk/`: the temporaries and swapped-out
    copies of this stage's atomic writes (`.train.*.tmp`, `.val.old-<pid>`, `.manifest.json.*.tmp`, a stale
    lock's `.merge.lock.*.stale`), nothing else. Call it holding the merge lock (no other merge is writing)."""
    removed = 0
    for sub, prefixes in _OUTPUT_TEMPORARIES.items():
        folder = data_dir(run_dir) / sub if sub else data_dir(run_dir)
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if not p.name.startswith(prefixes):
                continue
            if not (p.name.endswith((".tmp", ".stale")) or ".old-" in p.name):
                continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
            removed += 1
    return removed


def read_wall(base: Path) -> float:
    try:
        return float(read_json(base / "wall.json")["wall_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


class WallClock:
    """One job's wall time summed over its invocations, kept in `<work>/wall.json` (`base` None: this invocation
    only). Saved at most every `every_s` seconds while running, so a kill -9 loses at most that much."""

    def __init__(self, base: Path | None, t0: float, every_s: float = 5.0):
        self.base = base
        self.before = read_wall(base) if base is not None else 0.0
        self.t0 = t0
        self.every_s = every_s
        self._saved = t0

    def total(self) -> float:
        return self.before + time.perf_counter() - self.t0

    def save(self, *, force: bool = False) -> None:
        now = time.perf_counter()
        if self.base is None or (not force and now - self._saved < self.every_s):
            return
        atomic_write_json(self.base / "wall.json", {"wall_s": round(self.total(), 3)})
        self._saved = now
