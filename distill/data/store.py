"""Work folders of the data stage: resumable chunks, shard bookkeeping, and the final merge.

    data/work/                 (num_shards == 1)   or   data/shards/<i>/   (one per parallel job)
        job.json               config hash + plan of this job
        gen/<split>-<c>.json   generated responses of chunk c (written by the engine as soon as produced)
        chunks/<split>-<c>/    records.json, meta.json, topk/ (one atomic folder per chunk: complete or absent)
        done.json              all chunks of this job are in

A chunk is `data.batch_size` consecutive prompts of this job's contiguous block of each split, so the plan is a
pure function of the config: a rerun skips what exists and continues. The merge concatenates shards 0..S-1 and
their chunks in order (= the prompts' order), writes `data/<split>`, `data/topk/<split>` and `manifest.json`,
then removes the work folders.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from distill.data.format import CacheMeta, data_dir, manifest_path, split_dir, topk_dir, write_cache_folder
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
