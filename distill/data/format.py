"""On-disk format of the data stage's output, and its readers (the train stage codes against this module).

Layout under `run_dir/data/`:

    train/, val/            `datasets.save_to_disk` folders with columns
                            input_ids: list[int]  prompt (chat template applied) + response (+ EOS when the
                                                  target stopped by itself)
                            loss_mask: list[int]  1 exactly on response tokens (incl. the final EOS), 0 on prompt
                            prompt_id: str, response_index: int
    topk/train/, topk/val/  optional teacher top-k cache, one entry per dataset row, same order (see below)
    manifest.json           counts (source: records read / dropped; per split: in split, loaded, skipped, used),
                            token totals, hashes, engine, timings (wall_s_total sums every invocation of every
                            shard job, resumes included; wall_s_last_invocation), cache bytes/token

Top-k cache (compact). For each row, for each position t with loss_mask[t] == 1 (R of them), the target's
log-softmax at temperature 1 computed from the logits at position t-1 (the distribution that predicts token t):
the k most likely token ids, their log-probs, and the log of the mass outside the top k. Stored per row as one
compressed blob:

- ids in value order, each coded as a back-reference when it appears among the top-k lists of the previous
  WINDOW = 8 positions (about half of them do at k=128), else as WINDOW*k + id; stored in the smallest unsigned
  int type that holds the symbols (uint16 for a 49152 vocab at k <= 2048);
- log-probs at fp16 precision: the fp16 bit patterns of -logprob (monotone in the value) delta-coded along k,
  so the sorted tail gives small non-negative deltas;
- rest log-mass as float32, computed exactly from the logits (logsumexp of the non-top-k logits), not from the
  rounded log-probs;
- the arrays split into byte planes (high bytes are mostly zero) and compressed (`data.logits.codec`, lzma by
  default; zlib is faster and ~8% larger).

Measured on SmolLM2-135M-Instruct / ShareGPT (bench/bench_data.py): see the manifest's `cache.bytes_per_token`.

`index.npy` holds int64 byte offsets [n_rows + 1] and `rows.npy` R per row; `blobs.bin` the concatenated blobs;
`meta.json` k, vocab size, codec, window, format version.
"""

from __future__ import annotations

import json
import lzma
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

WINDOW = 8  # id back-references reach this many earlier positions of the same sequence
DEFAULT_CODEC = "lzma"
FORMAT_VERSION = 2


# ---------------------------------------------------------------------------------------------------------
# Paths and the dataset


def data_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "data"


def split_dir(run_dir: Path, split: str) -> Path:
    """`run_dir/data/<split>`: a `datasets.save_to_disk` folder."""
    return data_dir(run_dir) / split


def topk_dir(run_dir: Path, split: str) -> Path:
    return data_dir(run_dir) / "topk" / split


def manifest_path(run_dir: Path) -> Path:
    return data_dir(run_dir) / "manifest.json"


def load_split_dataset(run_dir: Path, split: str) -> Any:
    """The `datasets.Dataset` of one split (columns input_ids, loss_mask, prompt_id, response_index)."""
    import datasets

    path = split_dir(run_dir, split)
    if not (path / "dataset_info.json").is_file() and not (path / "state.json").is_file():
        from distill.errors import InputError

        raise InputError(
            f"{path}: no `{split}` data here. Run `distill data -c CONFIG` with the same run.dir first."
        )
    return datasets.load_from_disk(str(path))


# ---------------------------------------------------------------------------------------------------------
# Top-k extraction (pure)


def topk_from_logits(
    logits: torch.Tensor, loss_mask: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k teacher distribution at every response position.

    Args:
        logits: [T, V] logits of one sequence (any float dtype; softmax is done in float32).
        loss_mask: [T] 0/1; row j of the output is for the j-th index t with loss_mask[t] == 1 and uses
            logits[t - 1] (the distribution that predicts token t). loss_mask[0] must be 0.
        k: number of tokens kept (clamped to V).

    Returns:
        ids int64 [R, k'], logprobs float32 [R, k'] (descending), rest_logmass float32 [R] with
        k' = min(k, V) and rest_logmass = log(1 - sum(exp(logprobs))) computed exactly from the logits
        (-inf when k' == V).
    """
    if logits.dim() != 2 or loss_mask.dim() != 1 or loss_mask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"expected logits [T, V] and loss_mask [T], got {tuple(logits.shape)}, {tuple(loss_mask.shape)}"
        )
    positions = torch.nonzero(loss_mask.to(torch.bool), as_tuple=False).flatten()
    if positions.numel() and int(positions[0]) == 0:
        raise ValueError("loss_mask[0] == 1: the first token has no preceding logits")
    vocab = logits.shape[1]
    kk = min(int(k), vocab)
    rows = logits.index_select(0, positions - 1).float() if positions.numel() else logits[:0].float()
    logprobs_all = torch.log_softmax(rows, dim=-1)
    values, ids = torch.topk(logprobs_all, kk, dim=-1, largest=True, sorted=True)
    if kk == vocab:
        rest = torch.full((rows.shape[0],), float("-inf"))
    else:
        # log of the mass outside the top k, exactly: logsumexp over the other tokens (no 1 - sum cancellation).
        masked = logprobs_all.scatter(-1, ids, float("-inf"))
        rest = torch.logsumexp(masked, dim=-1)
    return ids.to(torch.int64), values.float(), rest.float()


# ---------------------------------------------------------------------------------------------------------
# Encoding of one row


def id_dtype(vocab_size: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


def _planes(a: np.ndarray) -> bytes:
    """Byte-plane split: all first bytes, then all second bytes... (compresses far better for small ints)."""
    if a.dtype.itemsize == 1:
        return a.tobytes()
    b = np.ascontiguousarray(a).view(np.uint8).reshape(-1, a.dtype.itemsize)
    return np.ascontiguousarray(b.T).tobytes()


def _unplanes(buf: bytes, dtype: np.dtype, count: int) -> np.ndarray:
    if dtype.itemsize == 1:
        return np.frombuffer(buf, dtype=dtype, count=count).copy()
    b = np.frombuffer(buf, dtype=np.uint8, count=count * dtype.itemsize).reshape(dtype.itemsize, count)
    return np.ascontiguousarray(b.T).view(dtype).reshape(count)


def _compress(data: bytes, codec: str) -> bytes:
    if codec == "zlib":
        return zlib.compress(data, 6)
    if codec == "lzma":
        return lzma.compress(data, preset=6)
    if codec == "none":
        return data
    raise ValueError(f"unknown codec {codec!r}")


def _decompress(data: bytes, codec: str) -> bytes:
    if codec == "zlib":
        return zlib.decompress(data)
    if codec == "lzma":
        return lzma.decompress(data)
    if codec == "none":
        return data
    raise ValueError(f"unknown codec {codec!r}")


def encode_logprobs(logprobs: np.ndarray) -> np.ndarray:
    """float [R, k] (descending per row) -> uint16 [R, k]: deltas of the fp16 bit patterns of -logprob.

    For non-negative halves the bit pattern grows with the value, so sorted log-probs give non-negative deltas,
    small in the tail (where fp16's spacing is coarse) and compressible. Precision is exactly fp16's.
    """
    neg = np.clip(0.0 - logprobs.astype(np.float32), 0.0, None)  # 0.0 - x: never a -0.0 (sign bit set)
    bits = neg.astype(np.float16).view(np.uint16).astype(np.int64)
    bits = np.maximum.accumulate(bits, axis=1) if bits.size else bits  # guard: exact ties out of order
    return np.diff(bits, axis=1, prepend=0).astype(np.uint16)


def decode_logprobs(deltas: np.ndarray) -> np.ndarray:
    bits = np.cumsum(deltas.astype(np.int64), axis=1).astype(np.uint16)
    return -(bits.view(np.float16).astype(np.float32))


def _symbol_dtype(vocab_size: int, k: int) -> np.dtype:
    return id_dtype(vocab_size + WINDOW * k)


def encode_ids(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """ids [R, k] -> symbols [R, k]: an id found among the previous WINDOW positions' lists (half of them at
    k=128) becomes its index there (most recent first, < WINDOW * k); any other id is WINDOW * k + id."""
    rows, k = ids.shape
    base = WINDOW * k
    out = ids.astype(np.int64) + base
    for t in range(1, rows):
        cand = ids[max(0, t - WINDOW) : t][::-1].ravel().astype(np.int64)
        order = np.argsort(cand, kind="stable")  # stable: the first (most recent) occurrence sorts first
        srt = cand[order]
        pos = np.minimum(np.searchsorted(srt, ids[t]), len(srt) - 1)
        hit = srt[pos] == ids[t]
        out[t] = np.where(hit, order[pos], out[t])
    return out.astype(_symbol_dtype(vocab_size, k))


def decode_ids(symbols: np.ndarray) -> np.ndarray:
    rows, k = symbols.shape
    base = WINDOW * k
    sym = symbols.astype(np.int64)
    ids = np.empty_like(sym)
    for t in range(rows):
        s = sym[t]
        ids[t] = s - base
        ref = s < base
        if ref.any():
            cand = ids[max(0, t - WINDOW) : t][::-1].ravel()
            ids[t, ref] = cand[s[ref]]
    return ids


def encode_row(
    ids: np.ndarray, logprobs: np.ndarray, rest: np.ndarray, *, vocab_size: int, codec: str = DEFAULT_CODEC
) -> bytes:
    """One sequence's cache entry: ids [R, k], logprobs [R, k], rest [R] -> compressed bytes."""
    payload = (
        _planes(encode_ids(ids, vocab_size).ravel())
        + _planes(encode_logprobs(logprobs).ravel())
        + _planes(rest.astype(np.float32).ravel())
    )
    return _compress(payload, codec)


def decode_row(
    blob: bytes, rows: int, k: int, *, vocab_size: int, codec: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dt = _symbol_dtype(vocab_size, k)
    raw = _decompress(blob, codec)
    n = rows * k
    ids_end = n * dt.itemsize
    lp_end = ids_end + n * 2
    ids = decode_ids(_unplanes(raw[:ids_end], dt, n).reshape(rows, k))
    deltas = _unplanes(raw[ids_end:lp_end], np.dtype(np.uint16), n).reshape(rows, k)
    rest = _unplanes(raw[lp_end : lp_end + rows * 4], np.dtype(np.float32), rows)
    return torch.from_numpy(ids), torch.from_numpy(decode_logprobs(deltas)), torch.from_numpy(rest.copy())


# ---------------------------------------------------------------------------------------------------------
# A cache folder: writer (one shard or a merged split) and reader


@dataclass
class CacheMeta:
    k: int
    vocab_size: int
    codec: str = DEFAULT_CODEC
    window: int = WINDOW
    version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "vocab_size": self.vocab_size,
            "codec": self.codec,
            "window": self.window,
            "values": "fp16-bit-deltas",
            "id_dtype": id_dtype(self.vocab_size).name,
            "version": self.version,
        }


def write_cache_folder(folder: Path, meta: CacheMeta, blobs: list[bytes], rows: list[int]) -> int:
    """Write blobs + index + meta into `folder` (which the caller makes atomic). Returns bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    if blobs:
        offsets[1:] = np.cumsum([len(b) for b in blobs])
    with open(folder / "blobs.bin", "wb") as f:
        for b in blobs:
            f.write(b)
    np.save(folder / "index.npy", offsets)
    np.save(folder / "rows.npy", np.asarray(rows, dtype=np.int64))
    (folder / "meta.json").write_text(json.dumps(meta.to_json(), indent=2) + "\n")
    return int(offsets[-1]) + len(blobs) * 16


def read_cache_meta(folder: Path) -> CacheMeta:
    m = json.loads((folder / "meta.json").read_text())
    if m.get("version") != FORMAT_VERSION:
        raise ValueError(f"{folder}: top-k cache format version {m.get('version')} != {FORMAT_VERSION}")
    return CacheMeta(
        k=int(m["k"]),
        vocab_size=int(m["vocab_size"]),
        codec=str(m["codec"]),
        window=int(m["window"]),
    )


class TopKCache:
    """Random access to one split's top-k cache: `get(i)` -> (ids [R, k], logprobs [R, k], rest [R])."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.meta = read_cache_meta(self.folder)
        self.k = self.meta.k
        self._offsets = np.load(self.folder / "index.npy")
        self._rows = np.load(self.folder / "rows.npy")
        self._blob_path = self.folder / "blobs.bin"
        self._file: Any = None

    def __len__(self) -> int:
        return int(self._rows.shape[0])

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers pickle the dataset: reopen the file lazily in each process.
        state = dict(self.__dict__)
        state["_file"] = None
        return state

    def num_positions(self, i: int) -> int:
        return int(self._rows[i])

    def raw_bytes(self, i: int) -> bytes:
        if self._file is None:
            self._file = open(self._blob_path, "rb")  # noqa: SIM115 - kept open for fast random access
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        self._file.seek(start)
        return self._file.read(end - start)

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"top-k cache row {i} out of range [0, {len(self)})")
        return decode_row(
            self.raw_bytes(i),
            int(self._rows[i]),
            self.k,
            vocab_size=self.meta.vocab_size,
            codec=self.meta.codec,
        )

    def blob_bytes(self) -> int:
        """Size `blobs.bin` must have (the index's last offset): a shorter file was cut off."""
        return int(self._offsets[-1]) if self._offsets.size else 0

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.iterdir() if p.is_file())

    def bytes_per_token(self) -> float:
        tokens = int(self._rows.sum())
        return self.total_bytes() / tokens if tokens else math.nan


def open_topk_cache(run_dir: Path, split: str) -> TopKCache | None:
    """The split's top-k cache, or None when the data stage ran with `data.logits.top_k: 0`."""
    folder = topk_dir(run_dir, split)
    if not (folder / "meta.json").is_file():
        return None
    return TopKCache(folder)
