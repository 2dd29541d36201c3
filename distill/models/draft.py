"""Draft construction (`draft.init`) and the draft/target vocabulary check.

The check runs on tokenizers and configs only, before any weights load: speculative decoding compares token
ids, so the draft must speak exactly the target's vocabulary. Embedding matrices padded to different sizes
(151936 vs 152064) are fine as long as the tokenizers agree: we work on the shared tokenizer length.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from distill.config import Config
from distill.errors import InputError
from distill.models.resolve import resolve_model
from distill.utils.fs import atomic_dir

log = logging.getLogger("distill.models")


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def load_model_config(path: str | Path, *, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def load_causal_lm(
    path: str | Path,
    *,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> Any:
    """Load safetensors weights only (`use_safetensors=True`: no pickle). `attn_implementation`: transformers'
    choice when None; "eager" for a model whose attention weights are read (`output_attentions`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from distill.models.vocab import expand_trimmed

    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=getattr(torch, dtype),
        trust_remote_code=trust_remote_code,
        use_safetensors=True,
        attn_implementation=attn_implementation,
    )
    # A trimmed-vocabulary draft reads and writes target ids, as vLLM runs it.
    return expand_trimmed(model, Path(path))


@contextlib.contextmanager
def remote_code_refused(section: str, folder: str | Path) -> Iterator[None]:
    """transformers' "pass trust_remote_code=True" ValueError (a folder whose config.json has an `auto_map`) as
    an InputError naming `<section>.trust_remote_code`: the fix is a config key, not a code change."""
    try:
        yield
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise InputError(
            f"{section}.trust_remote_code: {folder} holds custom model code (an auto_map in its config.json), "
            f"which transformers runs only when allowed. Set {section}.trust_remote_code=true only if you trust "
            "this code, or use a model transformers supports natively."
        ) from exc


def check_same_vocab(
    target_tok: Any, draft_tok: Any, *, target_name: str, draft_name: str, key: str = "draft.model"
) -> int:
    """Return the shared vocabulary length, or raise `InputError` naming both tokenizers."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = len(set(tv) - set(dv))
        only_d = len(set(dv) - set(tv))
        moved = sum(1 for t, i in tv.items() if t in dv and dv[t] != i)
        raise InputError(
            f"{key}: the draft's tokenizer ({draft_name}, {len(dv)} tokens) is not the target's ({target_name}, "
            f"{len(tv)} tokens): {only_t} tokens only in the target, {only_d} only in the draft, {moved} with "
            "different ids. Speculative decoding needs the same vocabulary: pick a draft from the target's "
            "family, or use draft.init=truncate / draft.init=config (built on the target's tokenizer)."
        )
    if target_tok.eos_token_id != draft_tok.eos_token_id:
        raise InputError(
            f"{key}: the draft ({draft_name}) ends sequences with token {draft_tok.eos_token_id}, the target "
            f"({target_name}) with {target_tok.eos_token_id}; give the draft the target's tokenizer."
        )
    return len(tv)


def check_embedding_size(config: Any, vocab_len: int, *, name: str, key: str) -> None:
    if int(config.vocab_size) < vocab_len:
        raise InputError(
            f"{key}: {name} has an embedding table of {config.vocab_size} rows but its tokenizer has {vocab_len} "
            "tokens; the model folder is inconsistent."
        )


def preflight_draft(cfg: Config, target_dir: Path) -> Path | None:
    """Validate the configured draft against the target without loading weights. Returns the draft folder
    for `init: pretrained`, else None."""
    with remote_code_refused("target", target_dir):
        target_cfg = load_model_config(target_dir, trust_remote_code=cfg.target.trust_remote_code)
    d = cfg.draft
    if d.init == "truncate":
        n_target = int(target_cfg.num_hidden_layers)
        if d.num_layers > n_target:
            raise InputError(f"draft.num_layers: {d.num_layers} exceeds the target's {n_target} layers.")
        kept_layers(d.layers, d.num_layers, n_target)
        return None
    if d.init == "config":
        return None
    assert d.model is not None
    draft_dir = resolve_model(d.model, key="draft.model")
    with remote_code_refused("target", target_dir):
        target_tok = load_tokenizer(target_dir, trust_remote_code=cfg.target.trust_remote_code)
    try:
        with remote_code_refused("draft", draft_dir):
            draft_tok = load_tokenizer(draft_dir, trust_remote_code=d.trust_remote_code)
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"draft.model: cannot load a tokenizer from {draft_dir} ({exc}).") from exc
    vocab = check_same_vocab(
        target_tok, draft_tok, target_name=str(cfg.target.model), draft_name=str(d.model)
    )
    with remote_code_refused("draft", draft_dir):
        draft_cfg = load_model_config(draft_dir, trust_remote_code=d.trust_remote_code)
    check_embedding_size(draft_cfg, vocab, name=str(d.model), key="draft.model")
    return draft_dir


def kept_layers(layers: list[int] | None, num_layers: int, n_target: int) -> list[int]:
    """The target layer indices a `truncate` draft keeps: `draft.layers` with negatives counted from the end,
    checked against the target's depth; the first `num_layers` when it is null."""
    if layers is None:
        return list(range(num_layers))
    resolved = [i + n_target if i < 0 else i for i in layers]
    if any(not 0 <= i < n_target for i in resolved):
        raise InputError(
            f"draft.layers: {layers} names layers outside the target's {n_target} (valid: 0..{n_target - 1}, "
            f"or -{n_target}..-1 from the end)."
        )
    if any(b <= a for a, b in itertools.pairwise(resolved)):
        raise InputError(
            f"draft.layers: {layers} resolves to {resolved}; list each target layer once, in increasing order."
        )
    return resolved


def _truncated_config(target_cfg: Any, layers: list[int]) -> Any:
    cfg = target_cfg.__class__.from_dict(target_cfg.to_dict())
    cfg.num_hidden_layers = len(layers)
    # Hybrid-attention models list a type per layer; keep the kept layers' types so the config stays consistent.
    layer_types = getattr(cfg, "layer_types", None)
    if isinstance(layer_types, list):
        cfg.layer_types = [layer_types[i] for i in layers]
    return cfg


_LAYER_KEY = re.compile(r"^(.*\.layers\.)(\d+)(\..*)$")


def target_key(draft_key: str, layers: list[int]) -> str:
    """The target's state-dict key for a truncated draft's key: draft layer i is target layer layers[i]."""
    m = _LAYER_KEY.match(draft_key)
    return draft_key if m is None else f"{m.group(1)}{layers[int(m.group(2))]}{m.group(3)}"


def choose_mask_token(tokenizer: Any) -> int:
    """The parallel-drafting mask id when `draft.mask_token_id` is null: a special token the data never holds.

    The highest added (special) token that is not BOS/EOS/PAD/UNK and does not occur in a rendered chat, else
    the last vocabulary id (a rare merge).
    """
    reserved = {
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.unk_token_id,
    }
    in_chat: set[int] = set()
    if getattr(tokenizer, "chat_template", None):
        chat = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
        with contextlib.suppress(Exception):  # a template that refuses a system turn or this shape
            in_chat = set(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
    added = sorted(getattr(tokenizer, "added_tokens_decoder", {}) or {}, reverse=True)
    for token_id in added:
        if token_id not in reserved and token_id not in in_chat and token_id < len(tokenizer):
            return int(token_id)
    return len(tokenizer) - 1


def mask_token_id(cfg: Config, tokenizer: Any) -> int:
    d = cfg.draft
    if d.mask_token_id is None:
        return choose_mask_token(tokenizer)
    if d.mask_token_id >= len(tokenizer):
        raise InputError(
            f"draft.mask_token_id: {d.mask_token_id} is outside the tokenizer's {len(tokenizer)} ids; pick an "
            "unused special token id (or null to choose one)."
        )
    return d.mask_token_id


def mark_parallel(model: Any, tokens: int, mask_id: int) -> None:
    """Record parallel drafting in the model config, where vLLM looks for the mask (`pard_token`)."""
    model.config.pard_token = int(mask_id)
    model.config.distill_parallel_tokens = int(tokens)


def parallel_tokens_of(config: Any) -> int:
    """Proposals per round a draft was trained for (0 = ordinary autoregressive draft), from its config."""
    if getattr(config, "pard_token", None) is None:
        return 0
    return int(getattr(config, "distill_parallel_tokens", 0) or 0)


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    before, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)
        if bars:
            hf_logging.enable_progress_bar()


def build_initial_draft(cfg: Config, target_dir: Path) -> Any:
    """The undistilled starting draft (float32, train mode off) as `draft.init` says; a parallel draft carries
    its mask token in its config (`mark_parallel`)."""
    model = _build_draft_model(cfg, target_dir)
    if cfg.draft.parallel_tokens:
        tokenizer = load_tokenizer(target_dir, trust_remote_code=cfg.target.trust_remote_code)
        mark_parallel(model, cfg.draft.parallel_tokens, mask_token_id(cfg, tokenizer))
    return model


def _build_draft_model(cfg: Config, target_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    d = cfg.draft
    tc = cfg.target.trust_remote_code
    if d.init == "pretrained":
        draft_dir = preflight_draft(cfg, target_dir)
        assert draft_dir is not None
        return load_causal_lm(draft_dir, trust_remote_code=d.trust_remote_code)
    target_cfg = load_model_config(target_dir, trust_remote_code=tc)
    if d.init == "truncate":
        layers = kept_layers(d.layers, d.num_layers, int(target_cfg.num_hidden_layers))
        return _truncated_draft(target_dir, _truncated_config(target_cfg, layers), layers, tc)
    # init == "config": a fresh small Llama speaking the target's tokenizer.
    tie = target_cfg.tie_word_embeddings if d.tie_word_embeddings is None else d.tie_word_embeddings
    rope = getattr(target_cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    config = LlamaConfig(
        vocab_size=target_cfg.vocab_size,
        hidden_size=d.hidden_size,
        intermediate_size=d.intermediate_size,
        num_hidden_layers=d.num_layers,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.hidden_size // d.num_attention_heads,
        max_position_embeddings=target_cfg.max_position_embeddings,
        rms_norm_eps=getattr(target_cfg, "rms_norm_eps", 1e-5),
        rope_parameters=rope,
        tie_word_embeddings=tie,
        bos_token_id=target_cfg.bos_token_id,
        eos_token_id=target_cfg.eos_token_id,
        pad_token_id=getattr(target_cfg, "pad_token_id", None),
    )
    torch.manual_seed(cfg.run.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model


def _truncated_draft(target_dir: Path, config: Any, layers: list[int], trust_remote_code: bool) -> Any:
    """A draft of the target's `layers` (+ embeddings, final norm, head), weights copied from the target."""
    import torch
    from transformers import AutoModelForCausalLM

    if layers == list(range(len(layers))):
        # The first N layers: load only them. The deeper ones are left out on purpose, so transformers'
        # report listing them as "UNEXPECTED" is noise (missing keys, the real fault, are checked below).
        with _transformers_quiet():
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                str(target_dir),
                config=config,
                dtype=torch.float32,
                trust_remote_code=trust_remote_code,
                use_safetensors=True,
                output_loading_info=True,
            )
        model, info = loaded
        if info.get("missing_keys"):
            raise RuntimeError(f"truncate init left weights uninitialised: {info['missing_keys'][:5]}")
    else:
        # Any other subset: renumber the kept layers' weights from the whole target.
        with _transformers_quiet():
            target = AutoModelForCausalLM.from_pretrained(
                str(target_dir),
                dtype=torch.float32,
                trust_remote_code=trust_remote_code,
                use_safetensors=True,
            )
        source = target.state_dict()
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
        model.load_state_dict({k: source[target_key(k, layers)] for k in model.state_dict()}, strict=True)
        del target, source
    model.eval()
    return model


def save_hf_folder(
    model: Any,
    tokenizer: Any,
    out_dir: str | Path,
    *,
    generation_source: str | Path | None = None,
    replace: bool = True,
    trimmed: tuple[list[int], int] | None = None,
) -> Path:
    """Atomically write `model` (safetensors) + tokenizer + generation config as an HF folder.

    The tokenizer is the target's, so vLLM and transformers load the draft with the same vocabulary; for a
    model trimmed with `vocab.trim_model`, `trimmed` = (kept target ids, target vocabulary length) reduces
    it to the kept tokens (`vocab.finish_trimmed_folder`).
    """
    from transformers import GenerationConfig

    out = Path(out_dir)
    with atomic_dir(out, replace=replace) as tmp:
        if generation_source is not None:
            try:
                model.generation_config = GenerationConfig.from_pretrained(str(generation_source))
            except OSError:
                pass
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if trimmed is not None:
            from distill.models.vocab import finish_trimmed_folder

            finish_trimmed_folder(tmp, *trimmed)
    return out
