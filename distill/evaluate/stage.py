"""`distill eval`: measure drafts inside real vLLM speculative decoding (or the reference PyTorch engine).

run(cfg): validate everything (target, drafts, vocabularies, prompts, engine) before writing anything; build
the job (`distill/evaluate/jobs.py`); run it in the vLLM worker subprocess (timeout → partial results, marked
incomplete) or in the reference engine; write `eval/report.json`, `eval/report.md` and the PNG plots; mark the
stage complete only when every configuration was measured.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distill import rundir
from distill.config import Config
from distill.errors import DistillError, InputError, RuntimeFailure
from distill.evaluate import draftcheck, hardware, jobs, report
from distill.utils.fs import atomic_write_json, atomic_write_text, read_json
from distill.utils.progress import progress

log = logging.getLogger("distill.eval")


@dataclass
class Plan:
    """Everything validated before the stage writes anything."""

    engine: str  # "vllm" | "hf"
    device: str  # "cpu" | "cuda"
    dtype: str
    target_dir: Path
    target_config: Any
    eos_token_id: int
    stop_token_ids: list[int]
    drafts: dict[str, Path]
    draft_configs: dict[str, Any]
    prompts: list[list[int]]
    prompt_source: str
    skipped_prompts: int
    max_model_len: int
    notes: list[str] = field(default_factory=list)
    parallel: dict[str, int] = field(default_factory=dict)  # draft name -> K of a parallel (PARD) draft
    methods: dict[str, str] = field(default_factory=dict)  # draft name -> vLLM method (draft_model, eagle)


# ---------------------------------------------------------------------------------------------------------
# Preflight


def choose_engine(cfg: Config) -> tuple[str, list[str]]:
    from distill.utils.subproc import require_vllm, vllm_available

    want = cfg.eval.engine
    if want == "hf":
        return "hf", []
    if want == "vllm":
        require_vllm("eval.engine")
        return "vllm", []
    if vllm_available():
        return "vllm", []
    note = (
        "vLLM is not installed: eval.engine=auto fell back to the reference PyTorch engine. Install "
        "`distill[cpu]` or `distill[gpu]` to measure inside vLLM."
    )
    log.warning(note)
    return "hf", [note]


def _device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - torch is a dependency
        return "cpu"


def resolve_drafts(
    cfg: Config, target_tok: Any, target_config: Any
) -> tuple[dict[str, Path], dict[str, Any]]:
    """Resolve every `eval.drafts[i].model` and check it speaks the target's vocabulary and holds readable
    weights."""
    from distill.models.draft import load_tokenizer, remote_code_refused
    from distill.models.resolve import resolve_model

    if not cfg.eval.drafts:
        raise InputError("eval.drafts: empty; list at least one {name, model} to measure.")
    folders, configs = {}, {}
    for i, d in enumerate(cfg.eval.drafts):
        key = f"eval.drafts[{i}].model"
        local = Path(d.model).expanduser()
        if d.model and not local.exists() and _under(local, cfg.run_dir):
            raise InputError(
                f"{key}: draft '{d.name}' folder {local} does not exist. Run `distill train` first (it writes "
                "draft_init/ and draft/), or point eval.drafts at existing drafts, e.g. "
                "'eval.drafts=[{name: a, model: path/to/draft}]'."
            )
        folder = resolve_model(d.model, key=key)
        shapes = draftcheck.tensor_shapes(
            draftcheck.weight_files(folder, key=key, name=d.name), key=key, name=d.name
        )
        configs[d.name] = _draft_config(cfg, folder, key)
        # Before the tokenizer: a head has none, and a folder of the wrong kind is named as such.
        check_method(cfg, i, shapes, configs[d.name], target_config)
        if d.method == "eagle" and not has_tokenizer(folder):
            # An EAGLE head without a tokenizer drafts with the target's (vLLM shares it).
            vocab = len(target_tok.get_vocab())
        else:
            try:
                with remote_code_refused("draft", folder):
                    tok = load_tokenizer(folder, trust_remote_code=cfg.draft.trust_remote_code)
            except InputError:
                raise
            except Exception as exc:
                raise InputError(f"{key}: cannot load a tokenizer from {folder} ({exc}).") from exc
            vocab = check_draft_vocab(cfg, target_tok, tok, folder, key=key, name=str(d.model))
        folders[d.name] = folder
        check_draft_folder(cfg, i, shapes, configs[d.name], target_config, vocab)
    return folders, configs


def check_draft_vocab(
    cfg: Config, target_tok: Any, draft_tok: Any, folder: Path, *, key: str, name: str
) -> int:
    """The draft's tokenizer length after checking it speaks the target's vocabulary: the same one, or, for a
    trimmed draft (`distill_vocab.json`), the target's tokens at the kept ids."""
    from distill.models.draft import check_same_vocab
    from distill.models.vocab import KEPT_IDS_FILE, check_subset_vocab, read_kept_ids

    try:
        trimmed = read_kept_ids(folder)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(
            f"{key}: cannot read {folder / KEPT_IDS_FILE} ({exc}); re-export the draft."
        ) from exc
    if trimmed is None:
        return check_same_vocab(
            target_tok, draft_tok, target_name=str(cfg.target.model), draft_name=name, key=key
        )
    kept_ids, vocab_len = trimmed
    target_vocab = target_tok.get_vocab()
    why = check_subset_vocab(target_vocab, draft_tok.get_vocab(), kept_ids)
    if not why and vocab_len != len(target_vocab):
        why = f"it was trimmed from a vocabulary of {vocab_len} tokens, the target's has {len(target_vocab)}"
    if why:
        raise InputError(
            f"{key}: trimmed draft {name} does not fit the target ({cfg.target.model}): {why}. Trim it from a "
            "draft of this target (draft.vocab_size in `distill train`)."
        )
    return len(kept_ids)


# Files any of which means a folder ships its own tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def _draft_config(cfg: Config, folder: Path, key: str) -> Any:
    from distill.models.draft import load_model_config, remote_code_refused

    try:
        with remote_code_refused("draft", folder):
            return load_model_config(folder, trust_remote_code=cfg.draft.trust_remote_code)
    except InputError:
        raise
    except Exception as exc:  # a missing or malformed config.json: the user's folder, not a bug of ours
        raise InputError(f"{key}: cannot read the model config of {folder} ({exc}).") from exc


def check_draft_folder(
    cfg: Config, i: int, shapes: dict[str, list[int]], config: Any, target_config: Any, vocab_len: int
) -> None:
    """Embedding table the target's size, checked from the safetensors headers (`shapes`, read by
    `draftcheck.tensor_shapes`, which also checks the weights are there and readable), so a broken draft stops
    here (exit 2, nothing written) instead of failing inside the engine."""
    key, name = f"eval.drafts[{i}].model", cfg.eval.drafts[i].name
    draftcheck.check_vocab_rows(
        config,
        target_config,
        draftcheck.embedding_rows(shapes),
        vocab_len,
        key=key,
        name=name,
        target=str(cfg.target.model),
    )


def check_method(cfg: Config, i: int, shapes: dict[str, list[int]], config: Any, target_config: Any) -> None:
    """The folder is what `eval.drafts[i].method` says: a complete EAGLE-1 head for this target for `eagle`,
    and not an EAGLE head for `draft_model`."""
    d, key = cfg.eval.drafts[i], f"eval.drafts[{i}].model"
    if d.method == "eagle":
        draftcheck.check_eagle_head(
            config, target_config, shapes, key=key, name=d.name, target=str(cfg.target.model)
        )
    elif draftcheck.is_eagle_head(shapes):
        raise InputError(
            f"{key}: draft '{d.name}' holds an EAGLE head ({draftcheck.EAGLE_FC}), not a standalone draft "
            f"model; measure it with eval.drafts[{i}].method=eagle."
        )


def draft_ks(cfg: Config) -> dict[str, list[int]]:
    """The k each draft sweeps: its own `eval.drafts[i].k`, else `eval.k`."""
    return {d.name: list(d.k) or list(cfg.eval.k) for d in cfg.eval.drafts}


def parallel_drafts(cfg: Config, configs: dict[str, Any]) -> tuple[dict[str, int], list[str]]:
    """Which drafts are parallel (PARD) drafts, from their configs: name -> K, and notes for the report.

    Such a draft is measured with vLLM's `parallel_drafting` at the k of its sweep (`draft_ks`) that are <= K
    (the masks past K were never trained); when none is, at K.
    """
    from distill.models.draft import parallel_tokens_of

    found, notes = {}, []
    sweeps = draft_ks(cfg)
    for i, d in enumerate(cfg.eval.drafts):
        if d.method != "draft_model":
            continue  # parallel drafting is a property of standalone drafts
        config = configs[d.name]
        mask = getattr(config, "pard_token", None)
        big_k = parallel_tokens_of(config)
        if mask is not None and not 0 <= int(mask) < int(config.vocab_size):
            raise InputError(
                f"eval.drafts[{i}].model: draft '{d.name}' has pard_token {mask} (its parallel-drafting mask "
                f"id) outside its {config.vocab_size} embeddings; retrain it with a valid draft.mask_token_id."
            )
        if not big_k:
            if mask is not None:
                notes.append(
                    f"draft '{d.name}' has a pard_token but no distill_parallel_tokens (the k it was trained "
                    "for): measured as an ordinary autoregressive draft."
                )
            continue
        found[d.name] = big_k
        swept = sweeps[d.name]
        ks = jobs.parallel_ks(swept, big_k)
        if not any(k <= big_k for k in swept):
            notes.append(
                f"draft '{d.name}' is a parallel draft trained for k <= {big_k}, but its k sweep {swept} "
                f"has no such k: measured at k={big_k} instead."
            )
        else:
            skipped = [k for k in swept if k > big_k]
            if skipped:
                notes.append(
                    f"draft '{d.name}' is a parallel draft trained for k <= {big_k}: measured at k={ks}, "
                    f"not at k={skipped}."
                )
    return found, notes


def _under(path: Path, parent: Path) -> bool:
    try:
        path.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


def load_eval_prompts(cfg: Config) -> tuple[list[Any], str]:
    from distill.prompts.sources import load_prompts, load_split

    e, d = cfg.eval, cfg.data
    # Read past eval.num_prompts: prompts longer than data.max_prompt_tokens are skipped later, and the user
    # asked for num_prompts evaluated prompts, not num_prompts read.
    reserve = 3 * e.num_prompts + 32
    if e.prompts:
        pset = load_prompts(e.prompts, prompt_field=e.prompt_field, response_field="", key="eval.prompts")
        return pset.records[:reserve], e.prompts
    records, _ = load_split(
        d.source,
        "test",
        val_fraction=d.val_fraction,
        test_fraction=d.test_fraction,
        limit=reserve,
        prompt_field=d.prompt_field,
        response_field=d.response_field,
        key="data.source",
    )
    if not records:
        raise InputError(
            f"data.source: the test split of '{d.source}' is empty (data.test_fraction={d.test_fraction}). "
            "Raise data.test_fraction or set eval.prompts to a prompt file."
        )
    return records, f"{d.source} (test split)"


def tokenize_prompts(
    records: list[Any],
    tok: Any,
    max_prompt_tokens: int,
    limit: int | None = None,
    *,
    key: str = "eval.prompts",
) -> tuple[list[list[int]], int]:
    """Chat-template each prompt into token ids, keeping the first `limit` that fit; prompts longer than
    `max_prompt_tokens` are skipped (and counted)."""
    from distill.data.prepare import prompt_token_ids

    out: list[list[int]] = []
    skipped = 0
    for rec in records:
        if limit is not None and len(out) >= limit:
            break
        if getattr(tok, "chat_template", None):
            ids = prompt_token_ids(tok, rec, None, key=key)
        else:
            ids = list(tok(rec.text, add_special_tokens=False)["input_ids"])
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        out.append(ids)
    return out, skipped


# Positions past prompt + new tokens + k that the engine's max_model_len keeps free.
SPARE_POSITIONS = 8


def k_sources(cfg: Config, parallel: dict[str, int]) -> list[tuple[int, str]]:
    """Every speculative k the job runs, with the config key that sets it (what an error must name)."""
    e = cfg.eval
    out = []
    for i, d in enumerate(e.drafts):
        swept, key = (list(d.k), f"eval.drafts[{i}].k") if d.k else (list(e.k), "eval.k")
        for k in jobs.parallel_ks(swept, parallel.get(d.name, 0)):
            # A parallel draft whose sweep has no k <= its trained K runs at K, set by its config.json.
            out.append((k, key if k in swept else f"eval.drafts[{i}].model"))
    if e.ngram:
        out.append((e.ngram_k, "eval.ngram_k") if e.ngram_k else (max(e.k), "eval.k"))
    return out


def model_len(cfg: Config, prompts: list[list[int]], parallel: dict[str, int], target_config: Any) -> int:
    """The engine's max_model_len: longest prompt + eval.max_tokens + the largest k + spare. When it exceeds
    the target's positions the error names the key at fault: the k when prompt + new tokens alone fit."""
    longest, new = max(map(len, prompts)), cfg.eval.max_tokens
    k, key = max(k_sources(cfg, parallel), key=lambda s: s[0], default=(0, "eval.k"))
    need = longest + new + k + SPARE_POSITIONS
    limit = int(getattr(target_config, "max_position_embeddings", 0) or 0)
    if not limit or need <= limit:
        return need
    room = limit - longest - new - SPARE_POSITIONS
    if room >= 1:
        raise InputError(
            f"{key}: k={k} speculative tokens + prompts ({longest} tokens) + {new} new tokens need {need} "
            f"positions, more than the target's {limit}; lower {key} (at most {room} fits here)."
        )
    raise InputError(
        f"eval.max_tokens: prompts ({longest} tokens) + {new} new tokens + k={k} speculative tokens ({key}) "
        f"exceed the target's {limit} positions; lower eval.max_tokens or data.max_prompt_tokens."
    )


def prompt_shortfall(cfg: Config, got: int, read: int, skipped: int, source: str) -> list[str]:
    """A note (and a warning) when fewer prompts than eval.num_prompts were there to evaluate: the report's
    prompt count alone does not say that the request was cut short."""
    want = cfg.eval.num_prompts
    if got >= want:
        return []
    note = (
        f"eval.num_prompts={want}, but only {got} prompts were available ({source}: {read} read, {skipped} "
        f"longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens} skipped): {got} evaluated."
    )
    log.warning(note)
    return [note]


def preflight(cfg: Config) -> Plan:
    from distill.models.draft import load_model_config, load_tokenizer, remote_code_refused
    from distill.models.resolve import require_weights, resolve_model

    engine, notes = choose_engine(cfg)
    refuse_eagle_without_vllm(cfg, engine, notes)
    target_dir = resolve_model(cfg.target.model, key="target.model", revision=cfg.target.revision)
    require_weights(target_dir, key="target.model")
    tc = cfg.target.trust_remote_code
    with remote_code_refused("target", target_dir):
        target_tok = load_tokenizer(target_dir, trust_remote_code=tc)
        target_config = load_model_config(target_dir, trust_remote_code=tc)
    drafts, draft_configs = resolve_drafts(cfg, target_tok, target_config)
    parallel, parallel_notes = parallel_drafts(cfg, draft_configs)
    records, source = load_eval_prompts(cfg)
    prompts, skipped = tokenize_prompts(
        records,
        target_tok,
        cfg.data.max_prompt_tokens,
        cfg.eval.num_prompts,
        key="eval.prompts" if cfg.eval.prompts else "data.source",
    )
    if not prompts:
        raise InputError(
            f"eval.prompts: all {len(records)} prompts are longer than data.max_prompt_tokens="
            f"{cfg.data.max_prompt_tokens}; raise it or use shorter prompts."
        )
    max_model_len = model_len(cfg, prompts, parallel, target_config)
    notes += prompt_shortfall(cfg, len(prompts), len(records), skipped, source)
    if target_tok.eos_token_id is None:
        raise InputError(f"target.model: the tokenizer of {target_dir} has no eos token; eval stops at EOS.")
    gen_eos = getattr(target_config, "eos_token_id", None)
    stop_ids = sorted(
        {
            int(x)
            for x in [target_tok.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])]
            if x is not None
        }
    )
    device = _device()
    if engine == "vllm" and device == "cpu" and not cfg.eval.enforce_eager:
        from distill.utils.subproc import require_cpp_compiler

        require_cpp_compiler("eval.enforce_eager")
    return Plan(
        engine=engine,
        device=device,
        dtype=cfg.eval.dtype or cfg.target.dtype,
        target_dir=target_dir,
        target_config=target_config,
        eos_token_id=int(target_tok.eos_token_id),
        stop_token_ids=stop_ids,
        drafts=drafts,
        draft_configs=draft_configs,
        prompts=prompts,
        prompt_source=source,
        skipped_prompts=skipped,
        max_model_len=max_model_len,
        notes=notes + parallel_notes + eagle_notes(cfg) + trimmed_notes(cfg, draft_configs),
        parallel=parallel,
        methods={d.name: d.method for d in cfg.eval.drafts},
    )


def eagle_notes(cfg: Config) -> list[str]:
    return [
        f"draft '{d.name}' is an EAGLE head (method eagle): measured inside vLLM, with no analytic estimate "
        "(its cost ratio and acceptance need the target's hidden states)."
        for d in cfg.eval.drafts
        if d.method == "eagle"
    ]


def trimmed_notes(cfg: Config, configs: dict[str, Any]) -> list[str]:
    """Say so when a trimmed draft's probabilistic-drafting rows, asked for, are not measured."""
    if not any(t > 0 for t in cfg.eval.temperatures) or "probabilistic" not in cfg.eval.draft_sample_methods:
        return []
    return [
        f"draft '{name}' has a trimmed vocabulary (draft.vocab_size): vLLM runs it with use_heterogeneous_vocab, "
        "which drafts greedily only, so its probabilistic-drafting rows are not measured."
        for name in sorted(trimmed_drafts(configs))
    ]


def refuse_eagle_without_vllm(cfg: Config, engine: str, notes: list[str]) -> None:
    """EAGLE heads run inside vLLM only: the reference engine drafts with standalone models."""
    if engine != "hf":
        return
    for i, d in enumerate(cfg.eval.drafts):
        if d.method == "eagle":
            why = " (vLLM is not installed)" if notes else ""
            raise InputError(
                f"eval.drafts[{i}].method: draft '{d.name}' is an EAGLE head, which only vLLM runs, but this eval "
                f"uses the reference engine{why}, which measures method draft_model only. Set eval.engine=vllm "
                "(with `distill[cpu]` or `distill[gpu]` installed) or leave the head out of eval.drafts."
            )


# ---------------------------------------------------------------------------------------------------------
# Job and engines


def build_job(cfg: Config, plan: Plan, partial_path: Path | None) -> dict[str, Any]:
    e = cfg.eval
    ngram_k = (e.ngram_k or max(e.k)) if e.ngram else None
    return {
        "kind": "speculate",
        "target": str(plan.target_dir),
        "dtype": plan.dtype,
        "trust_remote_code": cfg.target.trust_remote_code,
        "prompts": plan.prompts,
        "max_tokens": e.max_tokens,
        "eos_token_id": plan.eos_token_id,
        "stop_token_ids": plan.stop_token_ids,
        "max_model_len": plan.max_model_len,
        "configs": jobs.build_configs(
            drafts=[(n, str(p)) for n, p in plan.drafts.items()],
            ks=list(e.k),
            draft_ks=draft_ks(cfg),
            temperatures=list(e.temperatures),
            draft_sample_methods=list(e.draft_sample_methods),
            ngram_k=ngram_k,
            parallel=plan.parallel,
            methods=plan.methods,
            trimmed=trimmed_drafts(plan.draft_configs),
        ),
        "repeats": e.repeats,
        "rounds": e.rounds,
        "keep_engines": e.keep_engines,
        "seed": cfg.run.seed,
        "rejection_sample_method": e.rejection_sample_method,
        "ngram_prompt_lookup_min": e.ngram_prompt_lookup_min,
        "ngram_prompt_lookup_max": e.ngram_prompt_lookup_max,
        "ngram_min": e.ngram_prompt_lookup_min,
        "ngram_max": e.ngram_prompt_lookup_max,  # reference engine's names
        "max_num_seqs": e.max_num_seqs,
        "tensor_parallel_size": e.tensor_parallel_size,
        "enforce_eager": e.enforce_eager,
        "gpu_memory_utilization": e.gpu_memory_utilization,
        "device": plan.device,
        "partial_path": str(partial_path) if partial_path else None,
    }


def trimmed_drafts(configs: dict[str, Any]) -> set[str]:
    """Names of the drafts with a trimmed vocabulary (vLLM runs them with `use_heterogeneous_vocab`)."""
    from distill.models.vocab import is_trimmed

    return {name for name, c in configs.items() if is_trimmed(draftcheck.text_config(c))}


def worker_env(cfg: Config, device: str) -> dict[str, str]:
    if device != "cpu":
        return {}
    return {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(cfg.eval.cpu_reserved_cores),
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.eval.cpu_kvcache_gib),
    }


class PartialWatcher:
    """Progress of the eval worker, read from the partial results it rewrites after each configuration."""

    def __init__(self, partial: Path, bar: Any, total: int) -> None:
        self.partial, self.bar, self.seen = partial, bar, 0
        self.task = bar.add_task("eval (vllm)", total=total, rate="starting engine")

    def __call__(self) -> None:
        try:
            got = read_json(self.partial) if self.partial.is_file() else {"results": []}
            rows = got["results"]
            # Configurations measured, over every round (pooled rows repeat them); older workers: the rows.
            measured = int(got.get("measured", len(rows)))
        except (OSError, ValueError, KeyError, TypeError):
            return  # being rewritten: next poll
        if measured > self.seen and rows:
            last = got.get("last") or rows[-1]
            self.bar.update(self.task, advance=measured - self.seen, rate=describe_row(last))
            self.seen = measured


def describe_row(row: dict[str, Any]) -> str:
    """`distilled k=2 T=0.0: 33.6 tok/s, acceptance 0.39` from a worker result row."""
    head = f"{row.get('name')}" + (f" k={row['k']}" if row.get("k") else "") + f" T={row.get('temperature')}"
    parts = []
    rate = report.tokens_per_s(row)
    if rate:
        parts.append(f"{rate:.1f} tok/s")
    drafted, accepted = row.get("num_draft_tokens"), row.get("num_accepted_tokens")
    if drafted:
        parts.append(f"acceptance {accepted / drafted:.2f}")
    if row.get("error"):
        parts.append(f"error: {str(row['error'])[:80]}")
    return head + (": " + ", ".join(parts) if parts else "")


def run_engine(cfg: Config, plan: Plan, out_dir: Path) -> tuple[dict[str, Any], str | None]:
    """(engine output, error). On a crash or timeout the output holds the configurations that finished."""
    partial = out_dir / "partial.json"
    job = build_job(cfg, plan, partial)
    if plan.engine == "hf":
        from distill.evaluate.reference import run_reference_job

        try:
            return {"engine": "hf", "complete": True, **run_reference_job(job)}, None
        except DistillError:
            raise  # Interrupted (SIGTERM) must stay exit 130 / "interrupted", InputError exit 2
        except Exception as exc:
            raise RuntimeFailure(f"reference engine failed: {type(exc).__name__}: {exc}") from exc
    from distill.utils.subproc import run_worker

    if partial.exists():
        partial.unlink()
    try:
        with progress(every_s=0) as bar:  # one line per measured configuration (each takes minutes on CPU)
            out = run_worker(
                job,
                log_path=out_dir / "worker.log",
                timeout_s=cfg.eval.timeout_s,
                env=worker_env(cfg, plan.device),
                what="vLLM eval worker",
                poll=PartialWatcher(partial, bar, len(job["configs"]) * cfg.eval.rounds),
            )
        return out, None
    except RuntimeFailure as exc:
        got = read_json(partial) if partial.is_file() else {"results": []}
        got["complete"] = False
        return got, str(exc)


# ---------------------------------------------------------------------------------------------------------
# Report


def _analytic(cfg: Config, plan: Plan, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Cost ratios c, the acceptance estimated from the distributions (Σ min(p, q)) and the analytic speedups
    beside the measured ones."""
    try:
        from distill.evaluate import analytic
    except ImportError as exc:
        return {"available": False, "note": f"distill.evaluate.analytic unavailable ({exc})"}
    # A standalone draft's decode step can be timed alone; an EAGLE head's needs the target's hidden states.
    standalone = {n: f for n, f in plan.drafts.items() if plan.methods.get(n, "draft_model") == "draft_model"}
    if cfg.eval.cost_ratio is not None:
        ratios = {name: float(cfg.eval.cost_ratio) for name in standalone}
        how = "eval.cost_ratio (configured)"
    else:
        ratios = {
            name: float(analytic.measure_cost_ratio(plan.target_dir, folder, dtype=plan.dtype))
            for name, folder in standalone.items()
        }
        how = "measured: PyTorch KV-cached decode step time, draft / target, batch 1"
    report.add_analytic(rows, analytic.expected_speedup, ratios)
    estimates = _estimated_acceptance(cfg, plan, rows, analytic)
    report.add_estimates(rows, analytic.expected_speedup, ratios, estimates)
    return {
        "available": True,
        "cost_ratio": ratios,
        "cost_ratio_source": how,
        "formula": "speedup = (1 - a^(k+1)) / ((1 - a)(1 + k c)); analytic_speedup uses the measured "
        "acceptance a, estimated_speedup the acceptance estimated from the distributions. Parallel drafts "
        "(one draft forward per round): (1 + c) replaces (1 + k c), and the estimate is E / (1 + c) with "
        "E = 1 + sum_{i=1..k} prod_{j<i} a_j from the acceptance a_j at each draft position",
        "estimated_acceptance": [
            {"name": n, "temperature": t, "draft_sample_method": m, **v} for (n, t, m), v in estimates.items()
        ],
        "estimate_prompts": min(cfg.eval.analytic_prompts, len(plan.prompts)),
    }


def _estimated_acceptance(
    cfg: Config, plan: Plan, rows: list[dict[str, Any]], analytic: Any
) -> dict[tuple[str, float, str], dict[str, Any]]:
    """α = Σ min(p, q) on the target's greedy continuations of the first `eval.analytic_prompts` prompts."""
    n = min(cfg.eval.analytic_prompts, len(plan.prompts))
    if n == 0:
        return {}
    keys = sorted(
        {
            (r["name"], float(r["temperature"]), r.get("draft_sample_method") or "greedy")
            for r in rows
            if r.get("method") == "draft_model"
        }
    )
    out = {}
    for name, temp, dsm in keys:
        kwargs = {
            "max_tokens": min(cfg.eval.max_tokens, 64),
            "eos_token_id": plan.eos_token_id,
            "temperature": temp,
            "draft_sample_method": dsm,
            "dtype": plan.dtype,
        }
        if name in plan.parallel:
            out[(name, temp, dsm)] = _parallel_estimate(plan, name, n, kwargs, analytic)
            continue
        est = analytic.estimate_acceptance(plan.target_dir, plan.drafts[name], plan.prompts[:n], **kwargs)
        out[(name, temp, dsm)] = {k: est[k] for k in ("alpha", "top1_agreement", "num_positions") if k in est}
    return out


PARALLEL_ESTIMATE_KEYS = (
    "k",
    "alpha_per_draft_position",
    "tokens_per_round",
    "top1_agreement_per_draft_position",
    "num_rounds",
    "num_positions",
)


def _parallel_estimate(
    plan: Plan, name: str, n: int, kwargs: dict[str, Any], analytic: Any
) -> dict[str, Any]:
    """Per-draft-position acceptance of a parallel draft (one packed forward per prompt), or why not."""
    try:
        est = analytic.estimate_parallel_acceptance(
            plan.target_dir, plan.drafts[name], plan.prompts[:n], k=plan.parallel[name], **kwargs
        )
    except ValueError as exc:  # e.g. every continuation shorter than K + 1 tokens
        return {"parallel": True, "available": False, "note": f"no estimate for parallel draft {name}: {exc}"}
    return {"parallel": True, **{k: est[k] for k in PARALLEL_ESTIMATE_KEYS}}


def _memory(plan: Plan, batch: int) -> dict[str, Any]:
    from distill.evaluate.memory import estimate

    return estimate(
        (plan.target_dir, plan.target_config),
        {n: (plan.drafts[n], plan.draft_configs[n]) for n in plan.drafts},
        dtype=plan.dtype,
        max_model_len=plan.max_model_len,
        batch=batch,
    )


def assemble(
    cfg: Config, plan: Plan, out: dict[str, Any], error: str | None, *, analytic: bool = True
) -> dict[str, Any]:
    results = list(out.get("results") or [])
    failed = [
        f"{r['name']} k={r.get('k')} T={r.get('temperature')}: {r['error']}"
        for r in results
        if r.get("error")
    ]
    expected = len(build_job(cfg, plan, None)["configs"])
    complete = bool(out.get("complete")) and error is None and not failed and len(results) == expected
    if error is None and not complete:
        error = (
            (f"{len(failed)} configuration(s) failed: " + "; ".join(failed))
            if failed
            else (f"only {len(results)} of {expected} configurations finished")
        )
    rows = report.build_rows(results, dtype=plan.dtype)
    analytic_info = _analytic(cfg, plan, rows) if analytic and rows else {"available": False}
    # Partial rows must never yield deploy: true (a better configuration may be among the missing ones).
    recs = report.recommend(
        rows, min_acceptance=cfg.eval.min_acceptance, incomplete=None if complete else error
    )
    e = cfg.eval
    settings = {
        "max_num_seqs": e.max_num_seqs,
        "repeats": e.repeats,
        "rounds": e.rounds,
        "keep_engines": e.keep_engines,
        "draft_sample_methods": e.draft_sample_methods,
        "rejection_sample_method": e.rejection_sample_method,
        "min_acceptance": e.min_acceptance,
        "enforce_eager": e.enforce_eager,
        "tensor_parallel_size": e.tensor_parallel_size,
        "seed": cfg.run.seed,
        "ngram_prompt_lookup": [e.ngram_prompt_lookup_min, e.ngram_prompt_lookup_max],
        "vllm_env": out.get("vllm_env") or worker_env(cfg, plan.device),
        "plugin": out.get("plugin"),
    }
    return {
        "engine": out.get("engine", plan.engine),
        "engine_version": out.get("engine_version"),
        "device": out.get("device", plan.device),
        "hardware": out.get("hardware") or hardware.describe(out.get("device", plan.device)),
        "dtype": plan.dtype,
        "target": str(cfg.target.model),
        "prompts": {
            "source": plan.prompt_source,
            "count": len(plan.prompts),
            "skipped_too_long": plan.skipped_prompts,
        },
        "max_tokens": e.max_tokens,
        "complete": complete,
        "error": error,
        "settings": settings,
        "results": rows,
        "recommendation": _headline(recs),
        "recommendations": recs,
        "analytic": analytic_info,
        "memory": _memory(plan, min(e.max_num_seqs, len(plan.prompts))),
        "notes": plan.notes,
        "warnings": plugin_warnings(out, results) + load_warnings(out, results) + _greedy_warnings(rows),
    }


def _greedy_warnings(rows: list[dict[str, Any]]) -> list[str]:
    found = report.greedy_warnings(rows)
    for msg in found:
        log.warning(msg)
    return found


def plugin_warnings(out: dict[str, Any], results: list[dict[str, Any]]) -> list[str]:
    """Speculation at T > 0 on vLLM CPU is only right with distill's plugin loaded in the engine processes."""
    plugin = out.get("plugin") or {}
    hot = any(r.get("method") and float(r.get("temperature", 0)) > 0 for r in results)
    if out.get("engine") != "vllm" or out.get("device") != "cpu" or not hot:
        return []
    if plugin.get("patched") and not plugin.get("entry_point"):
        msg = (
            "WARNING: the distill vLLM plugin is not registered as an entry point (vllm.general_plugins: "
            "distill_cpu_fixes = distill.vllm_worker.plugin:register); reinstall distill (`pip install -e .`). "
            "vLLM's engine processes ran with the broken CPU expand kernel (vLLM issue #55005): speculative "
            "results at temperature > 0 are wrong."
        )
        log.warning(msg)
        return [msg]
    return []


# Share of the machine's CPU used by other processes during a timed pass above which timings are flagged.
FOREIGN_CPU_LIMIT = 0.15


def load_warnings(out: dict[str, Any], results: list[dict[str, Any]]) -> list[str]:
    """Flag timings taken while other processes used the machine (they skew tokens/s). Both engines measure
    the CPU share used outside the eval per pass (the vLLM worker: outside its process session; the reference
    engine: outside this process); the load average (which counts vLLM's own engine processes, ~3 on an idle
    2-core machine) is the fallback where that is missing."""
    foreign = [x for r in results for x in (r.get("foreign_cpu") or []) if x is not None]
    if foreign:
        if max(foreign) <= FOREIGN_CPU_LIMIT:
            return []
        msg = (
            f"WARNING: other processes used up to {100 * max(foreign):.0f}% of the machine's CPU during the timed "
            f"passes ({100 * min(foreign):.0f}% at least): tokens/s and speedups are skewed. Rerun on an idle "
            "machine before deciding."
        )
        log.warning(msg)
        return [msg]
    cores = out.get("cpu_count") or os.cpu_count() or 1
    loads = [x for r in results for x in (r.get("load_avg") or []) if x is not None]
    if not loads or max(loads) <= cores:
        return []
    msg = (
        f"WARNING: the machine was busy during the timed passes (1-min load average up to {max(loads):.1f} on "
        f"{cores} cores, {min(loads):.1f} at least): other processes shared the cores, so tokens/s and speedups "
        "are skewed. Rerun on an idle machine before deciding."
    )
    log.warning(msg)
    return [msg]


def _headline(recs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The contract's single `recommendation`: the best deployable one, else the lowest temperature's."""
    if not recs:
        return None
    deployable = [r for r in recs if r["deploy"]]
    return max(deployable, key=lambda r: r["speedup"]) if deployable else recs[0]


def write_outputs(cfg: Config, rep: dict[str, Any], out: dict[str, Any], out_dir: Path) -> None:
    atomic_write_json(out_dir / "raw_results.json", out)
    (out_dir / "partial.json").unlink(missing_ok=True)  # raw_results.json now holds the same
    atomic_write_json(out_dir / "report.json", rep)
    atomic_write_text(out_dir / "report.md", report.markdown(rep))
    if cfg.eval.plots and rep["results"]:
        from distill.evaluate import plots

        plots.plot_per_position(rep["results"], out_dir / "acceptance_per_position.png")
        plots.plot_speedup(rep["results"], out_dir / "speedup_vs_k.png")


def run(cfg: Config) -> int | None:
    plan = preflight(cfg)  # raises InputError before anything is written
    rundir.start_stage(cfg, "eval")
    # From here eval/ is rewritten: an earlier completion record must not vouch for what a failed or
    # interrupted run leaves there (`distill run` would skip eval and publish would meet a broken report).
    rundir.clear_complete(cfg, "eval")
    out_dir = cfg.run_dir / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info(
        "eval: %d prompts, %d configurations on %s (%s, %s)",
        len(plan.prompts),
        len(build_job(cfg, plan, None)["configs"]),
        plan.engine,
        plan.device,
        plan.dtype,
    )
    out, error = run_engine(cfg, plan, out_dir)
    rep = assemble(cfg, plan, out, error)
    write_outputs(cfg, rep, out, out_dir)
    if not rep["complete"]:
        raise RuntimeFailure(
            f"eval incomplete — {rep['error']}\nPartial report (marked incomplete): {out_dir / 'report.json'}"
        )
    rundir.mark_complete(cfg, "eval", {"recommendation": rep["recommendation"], "engine": rep["engine"]})
    for rec in rep["recommendations"]:
        (log.info if rec["deploy"] else log.warning)("T=%s: %s", rec["temperature"], rec["reason"])
    log.info("eval report: %s", out_dir / "report.md")
    return 0
