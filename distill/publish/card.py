"""The model card (`README.md` with Hugging Face front matter), written only from measured artefacts.

Every figure comes from the run folder: `eval/report.json` (acceptance, speedup, engine, hardware, prompts),
`config.yaml` (loss, steps, data source), `data/manifest.json` and the train metrics. Nothing is estimated here.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distill.evaluate import report as eval_report
from distill.publish.gate import draft_parallel_tokens, fastest, section
from distill.utils.fs import read_json

# Hub ids of the built-in target aliases and licenses we know for certain, so a card can name them even though
# the converted cache folder carries no model card. SmolLM2 is published under Apache-2.0 by HuggingFaceTB.
ALIAS_HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
KNOWN_LICENSES = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "apache-2.0",
    "HuggingFaceTB/SmolLM2-360M-Instruct": "apache-2.0",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": "apache-2.0",
    # built in code by distill (random weights): distill's own license
    "tiny-llama": "apache-2.0",
}


@dataclass
class TargetInfo:
    ref: str  # target.model as configured
    hub_id: str | None  # for `base_model` and the `vllm serve` line
    license: str | None
    license_source: str
    serve_as: str = ""  # the model argument of `vllm serve`


@dataclass
class CardInputs:
    name: str
    version: str
    model_ref: str  # what users pass to vLLM as the draft: hub repo or the release folder
    target: TargetInfo
    report: dict[str, Any]
    tags: list[str]
    training: dict[str, Any] = field(default_factory=dict)
    forced: bool = False
    force_reason: str = ""
    gate_problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # The published draft's eval rows, as the gate identifies them (by its folder): the card serves one of
    # these, never a setting measured for another draft of the same report.
    draft_rows: list[dict[str, Any]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------
# Target identity and license


def _front_matter(readme: Path) -> dict[str, str]:
    """Top-level `key: value` scalars of a README's YAML front matter (enough for license/base_model)."""
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    if not text.startswith("---"):
        return {}
    out = {}
    for line in text.splitlines()[1:]:
        if line.strip() == "---":
            break
        key, sep, value = line.partition(":")
        if sep and not line.startswith((" ", "-")) and value.strip():
            out[key.strip()] = value.strip().strip("'\"")
    return out


def target_info(ref: str, target_dir: Path | None, override: str) -> TargetInfo:
    """Who the target is and its license: `publish.license` override, the target's card, then known ids."""
    hub_id = ALIAS_HUB_IDS.get(ref) or (ref if ref.count("/") == 1 and not Path(ref).exists() else None)
    serve_as = hub_id or _local_model_path(ref, target_dir)
    meta = _front_matter(target_dir / "README.md") if target_dir else {}
    if override != "auto":
        return TargetInfo(ref, hub_id, override, "publish.license", serve_as)
    if meta.get("license"):
        return TargetInfo(ref, hub_id, meta["license"], f"{target_dir}/README.md", serve_as)
    for key in (hub_id, ref):
        if key and key in KNOWN_LICENSES:
            return TargetInfo(ref, hub_id, KNOWN_LICENSES[key], f"known license of {key}", serve_as)
    return TargetInfo(ref, hub_id, None, "unknown", serve_as)


def _local_model_path(ref: str, target_dir: Path | None) -> str:
    """What vLLM can load for a target without a hub id: its folder (aliases: their cache folder)."""
    if target_dir is not None:
        return str(target_dir.resolve())
    from distill.models.builtin import ALIASES

    return str(ALIASES[ref].folder) if ref in ALIASES else ref


# ---------------------------------------------------------------------------------------------------------
# How it was trained


def _last_metrics(run_dir: Path) -> dict[str, float]:
    """Last logged value of each column across the train stage's metrics.csv files."""
    out: dict[str, float] = {}
    for path in sorted((run_dir / "train").rglob("metrics.csv")):
        try:
            with open(path, newline="", encoding="utf-8") as f:
                for row in csv.DictReader(f):
                    for k, v in row.items():
                        if k and v not in (None, ""):
                            try:
                                out[k] = float(v)
                            except ValueError:
                                continue
        except OSError:
            continue
    return out


def _read_json_or_empty(path: Path) -> dict[str, Any]:
    try:
        obj = read_json(path)
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def training_facts(run_dir: Path, run_config: dict[str, Any]) -> dict[str, Any]:
    """Data, loss and steps of the run, from its own records (config.yaml, manifest, metrics)."""
    data, train, draft = (run_config.get(s, {}) for s in ("data", "train", "draft"))
    manifest = _read_json_or_empty(run_dir / "data" / "manifest.json")
    metrics = _last_metrics(run_dir)
    stage_train = _read_json_or_empty(run_dir / "stages" / "train.json").get("summary", {})
    return {
        "draft_init": {
            k: draft.get(k) for k in ("init", "model", "num_layers", "layers") if draft.get(k) is not None
        },
        "data": {
            "source": data.get("source"),
            "responses": data.get("responses"),
            "max_new_tokens": data.get("max_new_tokens"),
            "temperature": data.get("temperature"),
            "manifest": {k: v for k, v in manifest.items() if isinstance(v, (int, float, str))},
        },
        "train": {
            k: train.get(k)
            for k in (
                "loss",
                "max_steps",
                "batch_size",
                "grad_accum",
                "lr",
                "max_seq_len",
                "teacher",
                "precision",
                "devices",
                "strategy",
            )
            if k in train
        },
        "summary": stage_train if isinstance(stage_train, dict) else {},
        "last_metrics": {k: v for k, v in metrics.items() if k.startswith(("val/", "train/", "step"))},
    }


# ---------------------------------------------------------------------------------------------------------
# Serving


# k of the snippet for a draft the report never measured (only a forced release has none): a placeholder that
# the card labels as unmeasured.
UNMEASURED_K = 4


def _same_setting(row: dict[str, Any], rec: dict[str, Any]) -> bool:
    """Whether `rec` (a recommendation) describes `row`: same label, k and temperature, and the same draft
    folder, draft sampling and drafting where the recommendation records them (older reports do not)."""
    if (row.get("name"), row.get("k")) != (rec.get("name"), rec.get("k")):
        return False
    if float(row.get("temperature", 0.0)) != float(rec.get("temperature", 0.0)):
        return False
    if any(key in rec and row.get(key) != rec[key] for key in ("draft", "draft_sample_method")):
        return False
    return bool(row.get("parallel_drafting")) == bool(
        rec.get("parallel_drafting", row.get("parallel_drafting"))
    )


def recommended_row(rows: list[dict[str, Any]], report: dict[str, Any]) -> dict[str, Any] | None:
    """The published draft's row that eval's recommendation names, None when it names another draft.

    `rows` are the published draft's own (the gate picks them by its folder), so a recommendation for a draft
    measured beside it (another label, another folder) matches none of them.
    """
    rec = report.get("recommendation")
    if not isinstance(rec, dict) or rec.get("name") is None:
        return None
    return next((r for r in rows if _same_setting(r, rec)), None)


def fastest_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The draft's fastest measured setting; one that changed the target's greedy output only when no other
    was timed (it is not servable: the gate refuses it unless forced)."""
    clean = [r for r in rows if not eval_report.greedy_mismatch(r)]
    return fastest(clean) or fastest(rows) or (rows[0] if rows else None)


def best_setting(rows: list[dict[str, Any]], report: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
    """(the published draft's row to serve, whether it is eval's recommendation): the recommendation when it
    is for this draft, else this draft's own fastest measured setting (never another draft's)."""
    row = recommended_row(rows, report)
    return (row, True) if row is not None else (fastest_row(rows), False)


def speculative_config(
    model_ref: str, row: dict[str, Any] | None, report: dict[str, Any], *, from_rec: bool = False
) -> dict[str, Any]:
    """vLLM's speculative_config for serving `row` as eval measured it, with the release as the model.

    It starts from the recommendation's own speculative_config (when `from_rec`) or eval's builder for the
    row, so draft_sample_method carries over (vLLM defaults it to greedy, which accepts far less at temperature
    > 0 than probabilistic drafting measured there), and adds rejection_sample_method when eval ran a
    non-default one (the worker always passes it; vLLM's default is standard).
    """
    rec = section(report, "recommendation") if from_rec else {}
    measured = rec.get("speculative_config") or (eval_report.speculative_config(row) if row else None)
    spec = dict(measured or {"method": "draft_model"})
    # A recommendation from an older report may carry a speculative_config without k: the row has it.
    spec.setdefault("num_speculative_tokens", int(row["k"]) if row and row.get("k") else UNMEASURED_K)
    spec["model"] = model_ref
    parallel, _ = parallel_setting(row)
    if parallel:  # a report from before parallel drafts: the draft's config says so (gate warns)
        spec["parallel_drafting"] = True
    else:
        spec.pop("parallel_drafting", None)
    if (row and row.get("heterogeneous_vocab")) or draft_is_trimmed(row.get("draft") if row else None):
        # vLLM serves a trimmed-vocabulary draft only this way, and drafts it greedily.
        spec["use_heterogeneous_vocab"] = True
        spec["draft_sample_method"] = "greedy"
    rejection = section(report, "settings").get("rejection_sample_method")
    if row is not None and rejection and rejection != "standard":
        spec["rejection_sample_method"] = rejection
    return spec


def setting_note(row: dict[str, Any] | None, from_rec: bool, report: dict[str, Any]) -> str:
    """Where the snippet's setting comes from, at which temperature it was measured and what it gave."""
    if row is None:
        return (
            f"**This draft has no measured setting in the eval report**: k = {UNMEASURED_K} above is a "
            "placeholder, not a measurement. Run `distill eval` before serving it."
        )
    other = section(report, "recommendation").get("name")
    if from_rec:
        source = "eval's recommendation"
    elif other is not None:
        source = (
            f"this draft's fastest measured setting (eval's recommendation is for another draft, `{other}`)"
        )
    else:
        source = "this draft's fastest measured setting"
    dsm = row.get("draft_sample_method") or "greedy"
    return (
        f"Setting: {source}, measured at **temperature {_fmt(row.get('temperature'), 2)}** with "
        f"`draft_sample_method` {dsm} and k = {row.get('k')}: speedup {_fmt(row.get('speedup'), 2)}x over "
        f"the target alone, acceptance rate {_fmt(row.get('acceptance_rate'))}. Requests at another temperature "
        "accept differently: every measured setting is in the table below."
    )


def parallel_setting(row: dict[str, Any] | None) -> tuple[bool, int]:
    """(serve with parallel_drafting?, K the draft was trained for or 0 if unknown) for the served row.

    The row says how eval measured it (`parallel_drafting`); reports written before parallel drafts carry no
    such key, and then the draft's config decides.
    """
    if not row:
        return False, 0
    big_k = draft_parallel_tokens(row.get("draft"))
    if "parallel_drafting" in row:
        return bool(row["parallel_drafting"]), big_k
    return big_k > 0, big_k


def draft_is_trimmed(draft_dir: str | Path | None) -> bool:
    """Whether the draft folder a row measured is a trimmed-vocabulary draft (`distill_vocab.json`)."""
    from distill.models.vocab import KEPT_IDS_FILE

    return bool(draft_dir) and (Path(str(draft_dir)) / KEPT_IDS_FILE).is_file()


def vocab_section(spec: dict[str, Any]) -> str:
    if not spec.get("use_heterogeneous_vocab"):
        return ""
    return (
        "\n## Trimmed vocabulary\n\n"
        "This draft keeps only the tokens the target writes most (`distill_vocab.json` lists the target id of "
        "each of its tokens): its output head, the largest matrix of a small draft, is that much smaller. vLLM serves "
        'it with `"use_heterogeneous_vocab": true` (as above): it maps ids between the two tokenizers by their '
        "strings and constrains the draft to the shared tokens, and it drafts such a draft greedily only. A "
        "token the draft lacks is never proposed, and verification keeps the output exactly the target's.\n"
    )


def parallel_section(k: int, big_k: int) -> str:
    trained = (
        f"K = {big_k}" if big_k else "the K it was trained for (`distill_parallel_tokens` in config.json)"
    )
    return (
        "\n## Parallel drafting\n\n"
        "This is a **parallel draft** (PARD): ONE forward pass proposes all k tokens. vLLM feeds it the newest "
        "token followed by k − 1 mask tokens (`pard_token` in its config.json) and reads the k proposals from "
        "those positions, so a round costs about one draft step instead of k. Serve it with "
        f'`"parallel_drafting": true` (as above, k = {k}); k must be ≤ {trained}: the positions past K were never '
        "trained. Without `parallel_drafting` vLLM runs it as an ordinary (autoregressive) draft.\n"
    )


def serve_command(target: TargetInfo, spec: dict[str, Any]) -> str:
    return f"vllm serve {target.serve_as or target.hub_id or target.ref} --speculative-config '{json.dumps(spec)}'"


# ---------------------------------------------------------------------------------------------------------
# Rendering


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def _yaml_scalar(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid YAML scalar, quoting included


def front_matter(inp: CardInputs) -> str:
    lines = ["---"]
    if inp.target.hub_id:
        lines.append(f"base_model: {_yaml_scalar(inp.target.hub_id)}")
    lines.append(f"license: {_yaml_scalar(inp.target.license or 'other')}")
    lines += ["library_name: transformers", "pipeline_tag: text-generation", "tags:"]
    lines += [f"- {_yaml_scalar(t)}" for t in inp.tags]
    lines.append("---")
    return "\n".join(lines) + "\n"


def eval_table(report: dict[str, Any]) -> str:
    head = (
        "| draft | method | k | temperature | draft sampling | drafting | acceptance rate | mean acceptance "
        "length | tokens/s | speedup | greedy match |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for r in report.get("results", []):
        rows.append(
            "| "
            + " | ".join(
                [
                    _fmt(r.get("name")),
                    _fmt(r.get("method") or "none"),
                    _fmt(r.get("k")),
                    _fmt(r.get("temperature"), 2),
                    _fmt(r.get("draft_sample_method")),
                    _drafting(r),
                    _fmt(r.get("acceptance_rate")),
                    _fmt(r.get("mean_acceptance_length")),
                    _fmt(r.get("tokens_per_s"), 1),
                    _fmt(r.get("speedup"), 2),
                    _fmt(r.get("greedy_match")),
                ]
            )
            + " |"
        )
    return head + "\n" + "\n".join(rows)


def _drafting(row: dict[str, Any]) -> str:
    if row.get("method") != "draft_model":
        return "–"
    return "parallel" if row.get("parallel_drafting") else "autoregressive"


def measurement_context(report: dict[str, Any]) -> str:
    prompts = report.get("prompts") or {}
    hardware = report.get("hardware") or report.get("device") or "unknown"
    if isinstance(hardware, dict):
        hardware = hardware.get("summary") or ", ".join(f"{k}: {v}" for k, v in hardware.items())
    engine = f"{report.get('engine', 'unknown')} {report.get('engine_version', '')}".strip()
    return (
        f"Engine: **{engine}**; hardware: **{hardware}**; prompt set: **{prompts.get('source', 'unknown')}** "
        f"({prompts.get('count', '?')} prompts); max tokens: {report.get('max_tokens', '?')}. "
        "Speedup = tokens/s with speculation ÷ tokens/s of the target alone on the same prompts."
    )


def _license_line(t: TargetInfo) -> str:
    if t.license:
        return (
            f"License: `{t.license}` (source: {t.license_source}); the draft inherits the target's weights."
        )
    return (
        "License: **unknown** — the target's license could not be read from its metadata. The draft is "
        "derived from the target's weights: check the target's license before redistributing, and set "
        "`publish.license` to record it."
    )


def _forced_section(inp: CardInputs) -> str:
    if not inp.forced:
        return ""
    problems = "\n".join(f"- {p}" for p in inp.gate_problems) or "- (none: the gate passed)"
    return (
        f"\n> **Published with `publish.force=true`.** Reason given: {inp.force_reason}\n>\n"
        f"> The eval gate reported:\n\n{problems}\n"
    )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def not_deploy_causes(report: dict[str, Any], rec: dict[str, Any]) -> list[str]:
    """Why eval says do not deploy, in words: from the recommendation's `causes` codes where the report has
    them, and from its figures (completeness, acceptance vs eval.min_acceptance, speedup) either way."""
    codes = set(rec.get("causes") or [])
    settings = report.get("settings") or {}
    floor = _number(rec.get("min_acceptance")) or _number(settings.get("min_acceptance"))
    # The bar is on the first drafted token's acceptance; a report from before it was had only acceptance_rate.
    first = rec.get("first_drafted_acceptance", rec.get("acceptance_rate"))
    acc, speedup = _number(first), _number(rec.get("speedup"))
    what = "first drafted token accepted" if "first_drafted_acceptance" in rec else "acceptance"
    out = []
    if report.get("complete") is False or eval_report.CAUSE_INCOMPLETE in codes:
        out.append("the eval is incomplete, so these figures cover only part of the sweep")
    if rec.get("name") is None or eval_report.CAUSE_NOTHING in codes:
        out.append("no speculative configuration was measured")
    if (acc is not None and floor is not None and acc < floor) or eval_report.CAUSE_LOW_ACCEPTANCE in codes:
        shown = "n/a" if acc is None else f"{acc:.2f}"
        below = f"eval.min_acceptance {floor:.2f}" if floor is not None else "eval.min_acceptance"
        out.append(f"{what} {shown} is below {below}")
    if (speedup is not None and speedup <= 1.0) or eval_report.CAUSE_SLOWER in codes:
        shown = "n/a" if speedup is None else f"{speedup:.2f}x"
        out.append(f"speculation is not faster here (speedup {shown})")
    if eval_report.CAUSE_GREEDY in codes:
        out.append("speculation changed the target's greedy output in float32")
    return out or ["the eval's deploy gate did not pass"]


def _recommendation(report: dict[str, Any], *, other_draft: bool = False) -> str:
    rec = report.get("recommendation")
    if not isinstance(rec, dict):
        return ""
    if other_draft:  # its verdict is about a draft compared beside this one, not about this release
        return (
            f"\nEval's recommendation is for another draft measured beside this one: {rec.get('name')} "
            f"(`{rec.get('draft')}`) at k={rec.get('k')}, temperature {_fmt(rec.get('temperature'), 2)}, "
            f"speedup {_fmt(rec.get('speedup'), 2)}. It does not describe this release.\n"
        )
    deploy = bool(rec.get("deploy")) and report.get("complete") is not False
    verdict = "deploy" if deploy else f"do **not** deploy ({'; '.join(not_deploy_causes(report, rec))})"
    return (
        f"\nEval's recommendation: {verdict} — {rec.get('name')} at k={rec.get('k')}, temperature "
        f"{_fmt(rec.get('temperature'), 2)}, speedup {_fmt(rec.get('speedup'), 2)}. {rec.get('reason', '')}\n"
    )


def _training_section(t: dict[str, Any]) -> str:
    data, train = t.get("data", {}), t.get("train", {})
    lines = [
        f"- Starting draft: {json.dumps(t.get('draft_init', {}))}",
        f"- Data: prompts from `{data.get('source')}`, responses `{data.get('responses')}` by the target "
        f"(max {data.get('max_new_tokens')} new tokens, temperature {data.get('temperature')}).",
    ]
    if data.get("manifest"):
        lines.append(f"- Data manifest: {json.dumps(data['manifest'], sort_keys=True)}")
    lines.append(
        f"- Loss `{train.get('loss')}`, {train.get('max_steps')} optimizer steps, batch "
        f"{train.get('batch_size')} × accumulation {train.get('grad_accum')}, lr {train.get('lr')}, "
        f"max sequence length {train.get('max_seq_len')}, teacher `{train.get('teacher')}`, "
        f"precision {train.get('precision')}."
    )
    if t.get("summary"):
        lines.append(f"- Train summary: {json.dumps(t['summary'], sort_keys=True, default=str)}")
    if t.get("last_metrics"):
        shown = ", ".join(f"{k} = {_fmt(v, 4)}" for k, v in sorted(t["last_metrics"].items()))
        lines.append(f"- Last logged metrics: {shown}")
    return "\n".join(lines)


def render(inp: CardInputs) -> str:
    """The full README.md."""
    best, from_rec = best_setting(inp.draft_rows, inp.report)
    spec = speculative_config(inp.model_ref, best, inp.report, from_rec=from_rec)
    k = int(spec["num_speculative_tokens"])
    parallel, big_k = parallel_setting(best)
    other_draft = section(inp.report, "recommendation").get("name") is not None and not from_rec
    warnings = "".join(f"\n> Warning: {w}\n" for w in inp.warnings)
    return f"""{front_matter(inp)}
# {inp.name} (version {inp.version})

A draft model for **speculative decoding** of `{inp.target.hub_id or inp.target.ref}`, distilled from it with
`distill` (knowledge distillation on the target's own outputs). It proposes tokens that the target
verifies, so the target's output is unchanged while decoding can be faster.
{_forced_section(inp)}{warnings}
## Serve it with vLLM

```json
{json.dumps(spec, indent=2)}
```

```bash
{serve_command(inp.target, spec)}
```

{setting_note(best, from_rec, inp.report)}
{parallel_section(k, big_k) if parallel else ""}{vocab_section(spec)}
## Measured results

{measurement_context(inp.report)}

{eval_table(inp.report)}
{_recommendation(inp.report, other_draft=other_draft)}
## How it was trained

{_training_section(inp.training)}

## License

{_license_line(inp.target)}

Files: `SHA256SUMS` lists every file of this release (`sha256sum -c SHA256SUMS`); `provenance.json` records
the code version, packages and the run it came from.
"""
