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


def tensor_shapes(files: list[Path], *, key: str, name: str) -> dict[str, list[int]]:
    """Name -> shape of every tensor, from the safetensors headers alone (no tensor is read).

    Opening a file also checks that its header covers the whole file, so a truncated copy fails here."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for tensor in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                    shapes[tensor] = [int(d) for d in st.get_slice(tensor).get_shape()]
        except Exception as exc:  # SafetensorError (truncated or corrupt), OSError: both mean "re-copy it"
            raise InputError(
                f"{key}: draft '{name}' weights {f} cannot be read ({type(exc).__name__}: {exc}); the file is "
                "truncated or corrupt (an interrupted copy or download?). Copy or re-save the draft again."
            ) from exc
    return shapes


def vocab_rows(files: list[Path], *, key: str, name: str) -> dict[str, int]:
    """Rows of each embedding / LM-head tensor, from the safetensors headers alone."""
    return embedding_rows(tensor_shapes(files, key=key, name=name))


def embedding_rows(shapes: dict[str, list[int]]) -> dict[str, int]:
    return {tensor: shape[0] for tensor, shape in shapes.items() if tensor.endswith(VOCAB_TENSORS)}


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
    from distill.models.vocab import TRIMMED_FROM_KEY, is_trimmed

    got, want = int(text_config(draft_config).vocab_size), int(text_config(target_config).vocab_size)
    if is_trimmed(text_config(draft_config)):
        # A trimmed draft has one row per kept token (vLLM maps ids by string), cut from the target's table.
        cut_from = int(getattr(text_config(draft_config), TRIMMED_FROM_KEY))
        if cut_from != want:
            raise InputError(
                f"{key}: draft '{name}' was trimmed from a table of {cut_from} rows ({TRIMMED_FROM_KEY} in its "
                f"config.json) but the target ({target}) has {want}: it was cut from another model's draft."
            )
        want = vocab_len
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


# ---------------------------------------------------------------------------------------------------------
# EAGLE-1 heads (`eval.drafts[i].method: eagle`)

# The fc layer that mixes the next token's embedding with the target's hidden state: what makes a folder an
# EAGLE-1 head for vLLM's EagleLlamaForCausalLM (a standalone causal LM never has it).
EAGLE_FC = "fc.weight"
# Each decoder layer's tensors under vLLM's EAGLE-1 names; layer 0 has no input norm (EAGLE reads the fc
# output directly), the others do.
EAGLE_LAYER_TENSORS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
)


def is_eagle_head(shapes: dict[str, list[int]]) -> bool:
    return EAGLE_FC in shapes


def check_eagle_head(
    draft_config: Any,
    target_config: Any,
    shapes: dict[str, list[int]],
    *,
    key: str,
    name: str,
    target: str,
) -> None:
    """An EAGLE-1 head vLLM can run on this target: fc.weight of [H, 2H] for the target's hidden size H, and
    every tensor of each of its config's decoder layers. vLLM's EAGLE loader does not report missing weights
    (they would run as uninitialised memory), so a folder that is not a complete head stops here."""
    hidden = int(text_config(target_config).hidden_size)
    fc = shapes.get(EAGLE_FC)
    if fc is None:
        raise InputError(
            f"{key}: draft '{name}' has no {EAGLE_FC} tensor, so it is not an EAGLE-1 head (method: eagle). "
            "A standalone draft such as distill's draft/ is measured with method: draft_model (the default)."
        )
    if fc != [hidden, 2 * hidden]:
        raise InputError(
            f"{key}: draft '{name}' has {EAGLE_FC} of shape {fc}, but an EAGLE-1 head for {target} (hidden size "
            f"{hidden}) needs [{hidden}, {2 * hidden}]: it was trained for another target."
        )
    head_hidden = int(getattr(text_config(draft_config), "hidden_size", hidden))
    if head_hidden != hidden:
        raise InputError(
            f"{key}: draft '{name}' says hidden_size {head_hidden} in its config.json, the target {target} has "
            f"{hidden}; an EAGLE-1 head works at the target's width. Fix the head's config.json."
        )
    layers = int(getattr(text_config(draft_config), "num_hidden_layers", 0) or 0)
    missing = [
        f"layers.{i}.{tensor}"
        for i in range(layers)
        for tensor in EAGLE_LAYER_TENSORS + (("input_layernorm.weight",) if i else ())
        if f"layers.{i}.{tensor}" not in shapes
    ]
    if layers < 1 or missing:
        what = f"lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}" if missing else "has no layers"
        raise InputError(
            f"{key}: draft '{name}' is an incomplete EAGLE-1 head: its config.json says num_hidden_layers "
            f"{layers} and its weights {what} (vLLM names: fc.weight, layers.<i>.<...>). Export the whole head."
        )
