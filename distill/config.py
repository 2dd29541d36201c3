"""The config schema (typed dataclasses, one per section) and its loader.

Loading = YAML file + dotlist overrides, checked against the schema *before* anything runs: unknown keys get a
did-you-mean, wrong types and out-of-range values name the key and what is allowed, and all problems are
reported together (`ConfigError`, exit 2). Stages receive a typed `Config` object, never raw dicts.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from distill.data.config import DataConfig
from distill.errors import ConfigError, InputError
from distill.evaluate.config import EvalConfig
from distill.publish.config import PublishConfig
from distill.schema import opt, section
from distill.train.config import TrainConfig

SECTIONS = ("run", "target", "draft", "data", "train", "eval", "publish")


@dataclass
class RunConfig:
    name: str = opt("distill", "Run name; names the run folder and the published draft.")
    dir: str = opt("checkpoints/${run.name}", "Run folder (relative to the working directory).")
    seed: int = opt(0, "Global random seed (data split order, sampling, init, training).", ge=0)
    threads: int = opt(0, "torch intra-op threads in this process; 0 = leave torch's default.", ge=0)
    log_level: Literal["debug", "info", "warning"] = opt("info", "Console log level (the log file is debug).")


@dataclass
class TargetConfig:
    model: str = opt(
        "smollm2-135m-instruct",
        "The target LLM: a local HF folder, a hub id (online machines only) or a built-in alias "
        "(smollm2-135m-instruct, tiny-llama).",
    )
    revision: str | None = opt(None, "Hub revision (branch, tag or commit) when `model` is a hub id.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "float32",
        "Precision the target is run in (teacher forward passes, generation, eval). `auto`: bfloat16 where the "
        "machine computes it natively (a GPU of compute capability >= 8.0; a CPU with AVX512-BF16, AMX or Arm "
        "BF16), else float32 (where it is emulated, vLLM generated 35 tokens/s in bfloat16 against ~230 in "
        "float32, on an AVX2-only 2-core EPYC). Resolved when the config is loaded (logged; the run folder's "
        "config.yaml and the config hash carry the result, so a run resumed on another kind of machine may find "
        "its folder foreign).",
    )
    trust_remote_code: bool = opt(
        False, "Allow model code from the model folder/hub. Off: only built-in archs."
    )


@dataclass
class DraftConfig:
    init: Literal["truncate", "pretrained", "config"] = opt(
        "truncate",
        "How the starting draft is built: `truncate` = the target's first `num_layers` layers + embeddings, "
        "final norm and head; `pretrained` = the model at `draft.model`; `config` = a fresh Llama with the "
        "sizes below on the target's tokenizer.",
    )
    model: str | None = opt(None, "Model reference for `init: pretrained` (folder, hub id or alias).")
    num_layers: int = opt(2, "Decoder layers of the draft (`truncate` and `config`).", ge=1)
    layers: list[int] | None = opt(
        None,
        "For `truncate`: which of the target's layers the draft keeps, 0-based and in order; negative counts "
        "from the end (e.g. [0, -1] = the first and the last). Its length must equal `num_layers`. null = "
        "the first `num_layers` layers.",
    )
    hidden_size: int = opt(256, "Hidden size for `init: config`.", ge=8)
    intermediate_size: int = opt(768, "MLP width for `init: config`.", ge=8)
    num_attention_heads: int = opt(4, "Attention heads for `init: config`.", ge=1)
    num_key_value_heads: int = opt(2, "KV heads for `init: config` (must divide the heads).", ge=1)
    tie_word_embeddings: bool | None = opt(
        None, "Tie input embeddings and output head for `init: config`; null = as the target does."
    )
    trust_remote_code: bool = opt(False, "Allow model code shipped with a `pretrained` draft.")
    parallel_tokens: int = opt(
        0,
        "Parallel drafting (PARD): train the draft to propose this many tokens in ONE forward pass, from "
        "mask tokens placed after the last real token (vLLM `parallel_drafting`; a round then costs about one "
        "draft step instead of k, which is what makes drafting pay on a CPU). 0 = ordinary autoregressive "
        "drafting. Eval uses k <= this value for such a draft.",
        ge=0,
    )
    vocab_size: int = opt(
        0,
        "Trim the exported draft to this many tokens (0 = keep the target's whole vocabulary): the tokens of "
        "the training rows by frequency, then the lowest remaining ids, always with the special and single-byte "
        "tokens. The output head is the largest matrix of a small draft (SmolLM2: 49152 x 576, 8x one "
        "layer); a trimmed draft reads a fraction of it, and vLLM serves it with `use_heterogeneous_vocab` "
        "(greedy drafting only; the output stays exactly the target's). Training still uses the full "
        "vocabulary. On the embedded default in bfloat16, 16384 tokens ran 1.41x against the full draft's 1.37x, "
        "within this CPU's noise, and greedy-only drafting gives up probabilistic drafting at T > 0 "
        "(BENCHMARKS.md, section 11), so the shipped config keeps 0. In float32 on a CPU without bfloat16 "
        "arithmetic the head weighs twice as much and 8192 tokens pay: 1.18-1.23x against 1.13-1.15x at k=2 "
        "(section 12).",
        ge=0,
        hashed_when_set=True,
    )
    mask_token_id: int | None = opt(
        None,
        "Token id of the parallel-drafting mask (written as `pard_token` in the draft's config.json); null = "
        "the highest special token that is not BOS/EOS/PAD/UNK and not in the chat template, else the last "
        "vocabulary id.",
        ge=0,
    )


@dataclass
class Config:
    run: RunConfig = section(RunConfig, "Run identity and folder.")
    target: TargetConfig = section(TargetConfig, "The model being accelerated (teacher).")
    draft: DraftConfig = section(DraftConfig, "The draft model being distilled (student).")
    data: DataConfig = section(DataConfig, "`distill data`: prompts -> target-generated training data.")
    train: TrainConfig = section(TrainConfig, "`distill train`: knowledge distillation of the draft.")
    eval: EvalConfig = section(EvalConfig, "`distill eval`: drafts inside vLLM speculative decoding.")
    publish: PublishConfig = section(PublishConfig, "`distill publish`: versioned draft releases.")

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)


# ---------------------------------------------------------------------------------------------------------
# Type checking of user values against the schema (before OmegaConf sees them, so all problems are listed).


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def describe_type(tp: Any) -> str:
    optional, inner = _is_optional(tp)
    if optional:
        return describe_type(inner) + " or null"
    origin = get_origin(inner)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(inner))
    if origin in (list, typing.List):  # noqa: UP006
        return f"a list of {_plural(get_args(inner)[0])}"
    if dataclasses.is_dataclass(inner):
        keys = ", ".join(f.name for f in dataclasses.fields(inner))
        return f"a mapping with keys {{{keys}}}"
    return _SCALAR_WORDS[inner][0] if inner in _SCALAR_WORDS else str(inner)


# Each scalar type in words, alone and as a list's elements.
_SCALAR_WORDS: dict[Any, tuple[str, str]] = {
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    bool: ("true/false", "true/false values"),
    str: ("a string", "strings"),
}


def _plural(tp: Any) -> str:
    """The element type of a list, in words: "integers", "mappings with keys {...}"."""
    if dataclasses.is_dataclass(tp):
        return describe_type(tp).replace("a mapping", "mappings", 1)
    return _SCALAR_WORDS[tp][1] if tp in _SCALAR_WORDS else str(tp)


def _value_ok(value: Any, tp: Any) -> bool:
    optional, inner = _is_optional(tp)
    if value is None:
        return optional
    origin = get_origin(inner)
    if origin is Literal:
        allowed = get_args(inner)
        # YAML reads `precision: 32` as an integer; a Literal of strings accepts its string form.
        return value in allowed or (all(isinstance(a, str) for a in allowed) and str(value) in allowed)
    if origin in (list, typing.List):  # noqa: UP006
        return isinstance(value, (list, ListConfig))
    if dataclasses.is_dataclass(inner):
        return isinstance(value, (dict, DictConfig))
    if inner is bool:
        return isinstance(value, bool)
    if inner is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if inner is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if inner is str:
        return isinstance(value, (str, int, float)) and not isinstance(value, bool)
    return True


def _did_you_mean(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if close:
        return f" Did you mean '{close[0]}'?"
    return " Valid keys: " + ", ".join(candidates) + "."


def _check_node(node: Any, cls: Any, prefix: str, problems: list[str]) -> None:
    if not isinstance(node, (dict, DictConfig)):
        problems.append(f"{prefix or 'config'}: expected a mapping, got {node!r}.")
        return
    fields = _fields(cls)
    hints = _hints(cls)
    for key in node:
        key = str(key)
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            problems.append(f"{dotted}: unknown key.{_did_you_mean(key, list(fields))}")
            continue
        tp = hints[key]
        value = node[key]
        if isinstance(value, str) and "${" in value:
            continue  # interpolations are checked after resolution
        _, inner = _is_optional(tp)
        if dataclasses.is_dataclass(inner) and isinstance(value, (dict, DictConfig)):
            _check_node(value, inner, dotted, problems)
        elif not _value_ok(value, tp):
            problems.append(f"{dotted}: got {value!r}, expected {describe_type(tp)}.")
        elif get_origin(inner) in (list, typing.List) and value is not None:  # noqa: UP006
            elem = get_args(inner)[0]
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(elem):
                    _check_node(item, elem, f"{dotted}[{i}]", problems)
                elif not _value_ok(item, elem):
                    problems.append(f"{dotted}[{i}]: got {item!r}, expected {describe_type(elem)}.")


def _check_ranges(obj: Any, prefix: str, problems: list[str]) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        dotted = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            _check_ranges(value, dotted, problems)
            check = getattr(value, "problems", None)
            if callable(check):
                problems.extend(f"{dotted}.{p}" for p in check())
            continue
        if isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    _check_ranges(item, f"{dotted}[{i}]", problems)
        m = f.metadata
        scalar_bounds = [
            (m.get("ge"), ">=", lambda v, b: v >= b),
            (m.get("gt"), ">", lambda v, b: v > b),
            (m.get("le"), "<=", lambda v, b: v <= b),
            (m.get("lt"), "<", lambda v, b: v < b),
        ]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            for bound, op, ok in scalar_bounds:
                if bound is not None and not ok(value, bound):
                    problems.append(f"{dotted}: got {value}, must be {op} {bound}.")
        if isinstance(value, list):
            each = [
                (m.get("each_ge"), ">=", lambda v, b: v >= b),
                (m.get("each_gt"), ">", lambda v, b: v > b),
                (m.get("each_le"), "<=", lambda v, b: v <= b),
            ]
            for bound, op, ok in each:
                if bound is None:
                    continue
                bad = [v for v in value if not ok(v, bound)]
                if bad:
                    problems.append(f"{dotted}: {bad} out of range, every value must be {op} {bound}.")


def _section_problems(cfg: Config) -> list[str]:
    problems: list[str] = []
    _check_ranges(cfg, "", problems)
    d = cfg.draft
    if d.init == "pretrained" and not d.model:
        problems.append("draft.model: required when draft.init is 'pretrained' (a folder, hub id or alias).")
    if d.init == "config" and d.num_attention_heads % d.num_key_value_heads:
        problems.append(
            f"draft.num_key_value_heads: {d.num_key_value_heads} must divide draft.num_attention_heads "
            f"({d.num_attention_heads})."
        )
    if d.init == "config" and d.hidden_size % d.num_attention_heads:
        problems.append(
            f"draft.hidden_size: {d.hidden_size} must be a multiple of draft.num_attention_heads "
            f"({d.num_attention_heads})."
        )
    if d.layers is not None:
        if d.init != "truncate":
            problems.append(
                f"draft.layers: only `draft.init: truncate` keeps target layers (init is '{d.init}'); remove it."
            )
        elif len(d.layers) != d.num_layers:
            problems.append(
                f"draft.layers: names {len(d.layers)} layers but draft.num_layers is {d.num_layers}; set "
                f"draft.num_layers={len(d.layers)}."
            )
    if d.parallel_tokens == 1:
        problems.append(
            "draft.parallel_tokens: 1 proposal per round is ordinary drafting; use 0 (off) or >= 2 for parallel "
            "drafting."
        )
    return problems


# ---------------------------------------------------------------------------------------------------------
# Loading


def _load_yaml(path: str | Path) -> DictConfig:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"config file {p} not found. Pass an existing YAML, e.g. -c configs/tiny.yaml.")
    try:
        node = OmegaConf.load(p)
    except Exception as exc:  # yaml.YAMLError and friends
        raise InputError(f"config file {p} is not valid YAML: {exc}. Fix the syntax and rerun.") from exc
    if node is None or isinstance(node, ListConfig):
        raise InputError(f"config file {p} must be a mapping with sections {', '.join(SECTIONS)}.")
    return node


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line, without OmegaConf's `full_key:`/`object_type=` trailer."""
    text = str(getattr(exc, "msg", None) or exc)
    return " ".join(text.split("\n    full_key:")[0].split())


def _parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item:
            raise ConfigError([f"override '{item}': expected dotted.key=value (e.g. train.max_steps=10)."])
        try:  # one by one, so that the message names the override that does not parse
            OmegaConf.from_dotlist([item])
        except Exception as exc:  # yaml's ParserError/ScannerError, OmegaConf's own errors
            raise ConfigError(
                [
                    f"override '{item}': the value is not valid YAML ({_one_line(exc)}). Close brackets and "
                    "quotes, e.g. 'eval.k=[1,2]', and quote a string holding ': ' (key='\"a: b\"')."
                ]
            ) from None
    try:  # each parses alone; together they can still clash (a key set both as a value and as a section)
        return OmegaConf.from_dotlist(list(overrides))
    except Exception as exc:
        raise ConfigError([f"overrides {overrides}: {_one_line(exc)}"]) from None


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load, merge, type-check and validate. Raises `ConfigError` listing every problem."""
    layers = []
    if path is not None:
        layers.append(_load_yaml(path))
    layers.append(_parse_overrides(list(overrides)))
    problems: list[str] = []
    for layer in layers:
        _check_node(OmegaConf.to_container(layer, resolve=False), Config, "", problems)
    if problems:
        raise ConfigError(problems)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), *layers)
        OmegaConf.resolve(merged)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise ConfigError([f"{key}: {_one_line(exc)}"]) from exc
    assert isinstance(cfg, Config)
    problems = _section_problems(cfg)
    if problems:
        raise ConfigError(problems)
    from distill.precision import resolve_auto

    resolve_auto(cfg)
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain dict of a config (or one section): safe to pickle, JSON-dump, or save in a checkpoint."""
    out = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


def output_view(section_obj: Any) -> Any:
    """Plain dict of a config section without its `run_only` keys (recursively)."""
    if not dataclasses.is_dataclass(section_obj):
        return section_obj
    out = {}
    for f in dataclasses.fields(section_obj):
        if f.metadata.get("run_only"):
            continue
        value = getattr(section_obj, f.name)
        if f.metadata.get("hashed_when_set") and value == f.default:
            continue
        out[f.name] = output_view(value) if dataclasses.is_dataclass(value) else to_plain(value)
    return out


def to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return to_dict(value)
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value


def config_hash(*parts: Any) -> str:
    """Stable short hash of config sections (dataclasses or plain values)."""
    payload = [to_dict(p) if dataclasses.is_dataclass(p) else p for p in parts]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# Documentation, read from the schema (`distill docs`, README's config reference)


def _default_repr(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return ""
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        value = [dataclasses.asdict(v) for v in value]
    return json.dumps(value)


def iter_docs(cls: Any = Config, prefix: str = "") -> typing.Iterator[tuple[str, str, str, str]]:
    """Yield (dotted key, type, default, help) for every key of the schema."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}.{f.name}" if prefix else f.name
        _, inner = _is_optional(hints[f.name])
        if dataclasses.is_dataclass(inner):
            yield dotted, "section", "", f.metadata.get("help", "")
            yield from iter_docs(inner, dotted)
            continue
        bounds = " ".join(
            f"{sym} {f.metadata[k]}"
            for k, sym in (
                ("ge", ">="),
                ("gt", ">"),
                ("le", "<="),
                ("lt", "<"),
                ("each_ge", "each >="),
                ("each_gt", "each >"),
                ("each_le", "each <="),
            )
            if k in f.metadata
        )
        tp = describe_type(hints[f.name]) + (f" ({bounds})" if bounds else "")
        yield dotted, tp, _default_repr(f), f.metadata.get("help", "")
        if get_origin(inner) in (list, typing.List):  # noqa: UP006
            elem = get_args(inner)[0]
            if dataclasses.is_dataclass(elem):  # each entry's own keys, e.g. eval.drafts[].method
                yield from iter_docs(elem, f"{dotted}[]")


def docs_markdown(section_name: str | None = None) -> str:
    lines = []
    for key, tp, default, help_ in iter_docs():
        if section_name and not (key == section_name or key.startswith(section_name + ".")):
            continue
        if tp == "section":
            lines.append(f"\n### `{key}`\n\n{help_}\n\n| key | type | default | meaning |\n|---|---|---|---|")
        else:
            lines.append(f"| `{key}` | {tp} | `{default}` | {help_} |")
    return "\n".join(lines).strip() + "\n"
