"""Trimmed-vocabulary drafts: keep the draft's embedding and output head for the tokens it will meet.

The output head is the largest matrix of a small draft: SmolLM2's 49152 x 576 is 57 MB of bf16 read at every
draft step, against 7 MB per decoder layer (BENCHMARKS.md, section 11, measures what it costs inside vLLM). A
draft that keeps only the V tokens the target actually writes reads V/49152 of it. vLLM serves such a draft with
`use_heterogeneous_vocab: true` (method `draft_model`, greedy drafting): it maps token ids between the two
tokenizers by their strings, feeds the draft its own ids, constrains the draft's logits to the shared tokens and
maps the proposals back, so verification, and therefore the output, stays exactly the target's.

A trimmed draft is the full draft with rows selected: `kept_ids` (sorted target ids) become draft ids
0..V-1 in the same order, the tokenizer keeps those tokens (and the merges among them), and config ids (bos,
eos, pad, unk, the parallel-drafting mask `pard_token`) are renumbered. Target tokens outside the set reach the
draft as its unk token and are never proposed, so the set should cover what the target writes: the tokens of
the training rows by frequency, then the lowest remaining ids (byte-level BPE numbers its merges in the order it
learned them, most frequent first), always with the special tokens and the 256 single-byte tokens.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# Config key recording the length of the target vocabulary a trimmed draft was cut from: it marks a folder as
# trimmed for `distill eval` and `distill publish`, and vLLM ignores it.
TRIMMED_FROM_KEY = "distill_trimmed_from_vocab"
# File in a trimmed draft's folder: {"trimmed_from_vocab": N, "kept_ids": [target id of draft id 0, 1, ...]}.
KEPT_IDS_FILE = "distill_vocab.json"
# Config keys holding token ids that must follow the renumbering.
CONFIG_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "pard_token")


def count_tokens(rows: Iterable[Sequence[int]]) -> Counter[int]:
    """Token id frequencies over token-id rows (prompts and responses alike: the draft reads both)."""
    counts: Counter[int] = Counter()
    for row in rows:
        counts.update(int(t) for t in row)
    return counts


def byte_token_ids(vocab: dict[str, int]) -> list[int]:
    """Ids of the 256 single-character tokens of a byte-level BPE (the alphabet every text falls back to)."""
    return sorted(i for tok, i in vocab.items() if len(tok) == 1)


def select_vocab(counts: Counter[int], size: int, vocab_len: int, always: Iterable[int]) -> list[int]:
    """The `size` target ids to keep, sorted: `always`, then by `counts` (ties: lower id), then lowest ids.

    Shapes: counts maps target id -> occurrences; returns a sorted list of `min(size, vocab_len)` ids, each in
    [0, vocab_len)."""
    size = min(size, vocab_len)
    kept: dict[int, None] = dict.fromkeys(i for i in always if 0 <= i < vocab_len)
    if len(kept) > size:
        raise ValueError(f"{len(kept)} tokens must always be kept, more than the {size} asked for")
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(kept) >= size:
            break
        if 0 <= token < vocab_len:
            kept.setdefault(token)
    next_id = 0
    while len(kept) < size:
        kept.setdefault(next_id)
        next_id += 1
    return sorted(kept)


def kept_for(counts: Counter[int], size: int, tokenizer: Any, config: Any) -> list[int]:
    """The ids a draft with `config` and `tokenizer` keeps at `size` tokens (`select_vocab` with the tokens it
    must keep); ids past the tokenizer (padding rows of the table) have no string for vLLM to map: never kept."""
    selectable = min(int(config.vocab_size), len(tokenizer))
    return select_vocab(counts, size, selectable, always_kept(tokenizer, config))


def trim_tokenizer_json(tokenizer: dict[str, Any], kept_ids: Sequence[int]) -> dict[str, Any]:
    """A byte-level BPE `tokenizer.json` reduced to `kept_ids`, renumbered 0..V-1 in the same order.

    Merges survive when both parts and their result are kept, so the reduced tokenizer still encodes any text
    (with the single-byte tokens as the last resort); vLLM only reads its vocabulary, to map ids by string."""
    model = tokenizer.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"only BPE tokenizers can be trimmed, not {model.get('type')!r}")
    new_id = {old: new for new, old in enumerate(kept_ids)}
    by_id = {i: tok for tok, i in model["vocab"].items()}
    added = {t["id"]: t for t in tokenizer.get("added_tokens", [])}
    vocab = {}
    for old in kept_ids:
        tok = by_id.get(old, added.get(old, {}).get("content"))
        if tok is None:
            raise ValueError(f"token id {old} is not in the tokenizer")
        vocab[tok] = new_id[old]
    merges = []
    for merge in model.get("merges", []):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(merge)
    out = json.loads(json.dumps(tokenizer))  # deep copy, JSON types only
    out["model"]["vocab"] = vocab
    out["model"]["merges"] = merges
    out["added_tokens"] = [
        dict(t, id=new_id[t["id"]]) for t in tokenizer.get("added_tokens", []) if t["id"] in new_id
    ]
    return out


def renumber_config_ids(config: dict[str, Any], kept_ids: Sequence[int]) -> dict[str, Any]:
    """`config` (config.json or generation_config.json as a dict) with its token ids mapped to draft ids.

    An id that is not kept raises: a draft must keep its own special tokens."""
    new_id = {old: new for new, old in enumerate(kept_ids)}
    out = dict(config)
    for key in CONFIG_TOKEN_KEYS:
        value = out.get(key)
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        missing = [i for i in ids if i not in new_id]
        if missing:
            raise ValueError(f"{key} {missing} is not among the kept tokens")
        mapped = [new_id[i] for i in ids]
        out[key] = mapped if isinstance(value, list) else mapped[0]
    return out


def trim_model(model: Any, kept_ids: Sequence[int]) -> Any:
    """Select the kept rows of a causal LM's input embedding and output head, in place; returns the model.

    Shapes: embedding [vocab, hidden] -> [V, hidden]; an untied head [vocab, hidden] -> [V, hidden] (a tied one
    follows the embedding). `config.vocab_size` becomes V."""
    import torch

    index = torch.as_tensor(list(kept_ids), dtype=torch.long)
    embed = model.get_input_embeddings()
    new_embed = torch.nn.Embedding(len(index), embed.weight.shape[1], dtype=embed.weight.dtype)
    new_embed.weight.data.copy_(embed.weight.data.index_select(0, index))
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.weight.data_ptr()
    model.set_input_embeddings(new_embed)
    if head is not None:
        if tied:
            head.weight = new_embed.weight
        else:
            new_head = torch.nn.Linear(head.weight.shape[1], len(index), bias=head.bias is not None)
            new_head = new_head.to(head.weight.dtype)
            new_head.weight.data.copy_(head.weight.data.index_select(0, index))
            if head.bias is not None:
                new_head.bias.data.copy_(head.bias.data.index_select(0, index))
            model.set_output_embeddings(new_head)
    model.config.vocab_size = len(index)
    return model


def is_trimmed(config: Any) -> bool:
    """Whether a model config (object or dict) marks a trimmed-vocabulary draft."""
    if isinstance(config, dict):
        return config.get(TRIMMED_FROM_KEY) is not None
    return getattr(config, TRIMMED_FROM_KEY, None) is not None


def read_kept_ids(folder: Path) -> tuple[list[int], int] | None:
    """(kept target ids, target vocabulary length) of a trimmed draft folder, or None for a full one."""
    path = Path(folder) / KEPT_IDS_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return [int(i) for i in data["kept_ids"]], int(data["trimmed_from_vocab"])


def write_kept_ids(folder: Path, kept_ids: Sequence[int], vocab_len: int) -> None:
    data = {"trimmed_from_vocab": int(vocab_len), "kept_ids": [int(i) for i in kept_ids]}
    (Path(folder) / KEPT_IDS_FILE).write_text(json.dumps(data), encoding="utf-8")


def check_subset_vocab(
    target_vocab: dict[str, int], draft_vocab: dict[str, int], kept_ids: Sequence[int]
) -> str:
    """Why a trimmed draft's tokenizer does not match the target's at `kept_ids` ("" when it does): draft id i
    must be the target's token `kept_ids[i]`, string for string, as vLLM maps them."""
    by_id = {i: tok for tok, i in target_vocab.items()}
    if len(draft_vocab) != len(kept_ids):
        return f"its tokenizer has {len(draft_vocab)} tokens but {KEPT_IDS_FILE} lists {len(kept_ids)}"
    for tok, i in draft_vocab.items():
        if not 0 <= i < len(kept_ids) or by_id.get(kept_ids[i]) != tok:
            return f"its token {tok!r} (id {i}) is not the target's token {kept_ids[i] if 0 <= i < len(kept_ids) else '?'}"
    return ""


def always_kept(tokenizer: Any, config: Any) -> list[int]:
    """Ids a trimmed draft must keep whatever the data says: the added (special) tokens, the single-byte
    tokens, and the ids its config names (bos, eos, pad, unk, the parallel-drafting mask)."""
    ids = set(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", {}) or {}))
    ids.update(byte_token_ids(tokenizer.get_vocab()))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(tokenizer, name, None) is not None:
            ids.add(int(getattr(tokenizer, name)))
    for key in CONFIG_TOKEN_KEYS:
        value = getattr(config, key, None)
        for i in value if isinstance(value, list) else [value]:
            if i is not None:
                ids.add(int(i))
    return sorted(ids)


def finish_trimmed_folder(folder: Path, kept_ids: Sequence[int], vocab_len: int) -> None:
    """Turn a saved HF folder (a model already trimmed with `trim_model`, the target's tokenizer) into a
    trimmed draft: tokenizer reduced to `kept_ids`, config and generation ids renumbered, the trimmed-from
    marker and `distill_vocab.json` written."""
    folder = Path(folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    trimmed = trim_tokenizer_json(tokenizer, kept_ids)
    (folder / "tokenizer.json").write_text(json.dumps(trimmed, ensure_ascii=False), encoding="utf-8")
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        data = renumber_config_ids(json.loads(path.read_text(encoding="utf-8")), kept_ids)
        if name == "config.json":
            data[TRIMMED_FROM_KEY] = int(vocab_len)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    write_kept_ids(folder, kept_ids, vocab_len)


def coverage(counts: Counter[int], kept_ids: Sequence[int]) -> float:
    """Share of the counted tokens that are kept (1.0 when nothing was counted)."""
    total = sum(counts.values())
    kept = set(kept_ids)
    return sum(c for t, c in counts.items() if t in kept) / total if total else 1.0


def trimmed_wrapper_class() -> Any:
    """`TrimmedVocabLM`, defined on first use so importing this module does not import torch."""
    import torch

    class TrimmedVocabLM(torch.nn.Module):
        """A trimmed draft seen through the target's vocabulary, as vLLM's heterogeneous-vocab drafting sees it.

        Input ids (target ids) are mapped to draft ids, target tokens outside the kept set to the draft's unk;
        logits [..., V] are scattered into [..., target vocab] with -inf elsewhere, so the draft never proposes
        a token it dropped and every consumer written for full-vocabulary drafts (the reference engine, the
        analytic estimates) works unchanged."""

        kept: torch.Tensor
        to_draft: torch.Tensor

        def __init__(self, model: Any, kept_ids: Sequence[int], vocab_len: int, unk_id: int) -> None:
            super().__init__()
            self.model = model
            kept = torch.as_tensor(list(kept_ids), dtype=torch.long)
            to_draft = torch.full((vocab_len,), int(unk_id), dtype=torch.long)
            to_draft[kept] = torch.arange(len(kept))
            self.register_buffer("kept", kept, persistent=False)
            self.register_buffer("to_draft", to_draft, persistent=False)
            self.vocab_len = vocab_len
            self.target_config = _config_in_target_ids(model.config, kept_ids, vocab_len)

        @property
        def config(self) -> Any:
            """The draft's config with its token ids (mask included) and vocab_size in the target's terms."""
            return self.target_config

        @property
        def device(self) -> Any:
            return self.model.device

        @property
        def dtype(self) -> Any:
            return self.model.dtype

        def draft_ids(self, input_ids: Any) -> Any:
            return None if input_ids is None else self.to_draft[input_ids]

        def full_logits(self, logits: Any) -> Any:
            """[..., V] draft logits -> [..., target vocab], -inf at the tokens the draft dropped."""
            full = logits.new_full((*logits.shape[:-1], self.vocab_len), float("-inf"))
            full[..., self.kept] = logits
            return full

        def forward(self, input_ids: Any = None, **kwargs: Any) -> Any:
            out = self.model(input_ids=self.draft_ids(input_ids), **kwargs)
            out.logits = self.full_logits(out.logits)
            return out

        def get_decoder(self) -> Any:
            """The decoder, taking target ids (callers that run decoder and head apart, e.g. the parallel
            acceptance estimate)."""
            decoder = self.model.get_decoder()
            return lambda input_ids=None, **kw: decoder(input_ids=self.draft_ids(input_ids), **kw)

        def get_output_embeddings(self) -> Any:
            """The head, returning logits over the target's vocabulary."""
            head = self.model.get_output_embeddings()
            return lambda hidden: self.full_logits(head(hidden))

    return TrimmedVocabLM


def _config_in_target_ids(config: Any, kept_ids: Sequence[int], vocab_len: int) -> Any:
    import copy

    out = copy.copy(config)
    for key in CONFIG_TOKEN_KEYS:
        value = getattr(config, key, None)
        if value is not None:
            setattr(out, key, [kept_ids[i] for i in value] if isinstance(value, list) else kept_ids[value])
    out.vocab_size = vocab_len
    return out


def expand_trimmed(model: Any, folder: Path) -> Any:
    """`model` as a full-vocabulary model when `folder` holds a trimmed draft, else `model` itself."""
    found = read_kept_ids(folder)
    if found is None:
        return model
    kept_ids, vocab_len = found
    from transformers import AutoTokenizer

    return trimmed_wrapper_class()(
        model, kept_ids, vocab_len, unk_id(AutoTokenizer.from_pretrained(str(folder)))
    )


def unk_id(draft_tokenizer: Any) -> int:
    """The draft id vLLM feeds for a target token the draft dropped: its unk token, else its eos token."""
    for token_id in (draft_tokenizer.unk_token_id, draft_tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    raise ValueError("the draft's tokenizer has neither an unk nor an eos token")
