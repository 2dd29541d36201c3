"""Eval preflight checks of a draft folder that load no weights: safetensors present and readable, and an
embedding table the target's size.

Without them a broken draft fails minutes later inside the engine (exit 1, a raw SafetensorError or tensor-size
error, a partial report); here it is one InputError naming `eval.drafts[i].model`, before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distill.errors import InputError
from distill.models.resolve import weights_problem

# Tensors whose first dimension is the vocabulary: input embeddings and the LM head (Llama, Qwen, Mistral, ...).
VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def weight_files(folder: Path, *, key: str, name: str) -> list[Path]:
    """The draft's *.safetensors files (eval loads safetensors only, never pickles): all there (every shard its
    index names) and each readable."""
    problem = weights_problem(folder)
    if problem:
        raise InputError(
            f"{key}: draft '{name}' folder {folder} {problem}. Point it at a complete HF model folder, e.g. the "
            "draft/ that `distill train` writes, copy it again (an interrupted copy or download?), or re-save "
            "the model with save_pretrained(..., safe_serialization=True)."
        )
    return sorted(folder.glob("*.safetensors"))


def vocab_rows(files: list[Path], *, key: str, name: str) -> dict[str, int]:
    """Rows of each embedding / LM-head tensor, from the safetensors headers alone (no tensor is read).

    Opening a file also checks that its header covers the whole file, so a truncated copy fails here."""
    from safetensors import safe_open

    rows: dict[str, int] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for tensor in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if tensor.endswith(VOCAB_TENSORS):
                        rows[tensor] = int(st.get_slice(tensor).get_shape()[0])
        except Exception as exc:  # SafetensorError (truncated or corrupt), OSError: both mean "re-copy it"
            raise InputError(
                f"{key}: draft '{name}' weights {f} cannot be read ({type(exc).__name__}: {exc}); the file is "
                "truncated or corrupt (an interrupted copy or download?). Copy or re-save the draft again."
            ) from exc
    return rows


def text_config(config: Any) -> Any:
    """The language-model part of a config, where vLLM reads `vocab_size` (`hf_text_config`)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_vocab_rows(
    draft_config: Any,
    target_config: Any,
    rows: dict[str, int],
    vocab_len: int,
    *,
    key: str,
    name: str,
    target: str,
) -> None:
    """The draft's embedding table must have exactly the target's rows: vLLM's draft_model speculation refuses
    unequal vocab sizes, and the reference engine compares the two distributions position by position.
    `vocab_len` is the shared tokenizer's length, which no table may be smaller than."""
    from distill.models.draft import check_embedding_size

    got, want = int(text_config(draft_config).vocab_size), int(text_config(target_config).vocab_size)
    if got != want:
        raise InputError(
            f"{key}: draft '{name}' has an embedding table of {got} rows (vocab_size in its config.json) but the "
            f"target ({target}) has {want}; speculative decoding needs equal vocab sizes. Resize the draft's "
            f"embeddings to the target's (model.resize_token_embeddings({want}), then save_pretrained), or build "
            "the draft from the target (draft.init=truncate or draft.init=config)."
        )
    wrong = {tensor: n for tensor, n in rows.items() if n != got}
    if wrong:
        raise InputError(
            f"{key}: draft '{name}' says vocab_size {got} in its config.json but its weights hold {wrong} rows; "
            "the folder is inconsistent: re-save the draft with save_pretrained."
        )
    check_embedding_size(text_config(draft_config), vocab_len, name=f"draft '{name}'", key=key)
