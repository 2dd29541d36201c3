"""Worker job "speculate": time vLLM with and without speculative decoding on fixed token-id prompts.

The job dict is documented in `distill/evaluate/jobs.py` (the eval stage builds it; the reference engine takes
the same dict). Configurations sharing an engine (same method, draft, k and draft sampling; only the temperature
differs) run on one engine, started once; its start-up time is reported separately from the timed passes.
Each temperature gets a warm-up pass, then `repeats` timed passes over all prompts; the speculative counters
are differences of `LLM.get_metrics()` around the timed passes only. With `job["rounds"]` > 1 the engines run
that many times in turn (A B C, A B C) and each configuration's passes are pooled (`jobs.pool_rounds`); each
round starts its engines again, unless `job["keep_engines"]` keeps them all running from the first round on. After
each engine the results so far are written to `job["partial_path"]` so a crash or a timeout keeps them.
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distill.evaluate import hardware
from distill.evaluate.jobs import pool_rounds
from distill.evaluate.metrics import SpecCounters, counters_delta, extract_spec_counters, sum_counters
from distill.utils.fs import atomic_write_json

log = logging.getLogger("distill.vllm_worker.speculate")

ENGINE_KEYS = ("method", "draft", "k", "draft_sample_method", "parallel_drafting")


def engine_groups(configs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Group configurations that can share one engine (they differ only in temperature), in job order."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for c in configs:
        groups.setdefault(tuple(c.get(key) for key in ENGINE_KEYS), []).append(c)
    return list(groups.values())


def speculative_config(cfg: dict[str, Any], job: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM `speculative_config` for one configuration (None = no speculation)."""
    method = cfg.get("method")
    if method is None:
        return None
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": int(cfg["k"])}
    if method == "ngram":
        spec["prompt_lookup_min"] = int(job.get("ngram_prompt_lookup_min", 2))
        spec["prompt_lookup_max"] = int(job.get("ngram_prompt_lookup_max", 5))
        return spec
    spec["model"] = cfg["draft"]
    spec["draft_sample_method"] = cfg.get("draft_sample_method") or "greedy"
    spec["rejection_sample_method"] = job.get("rejection_sample_method", "standard")
    if cfg.get("parallel_drafting"):
        # One draft forward over [next token, mask * (k - 1)] proposes all k (mask id: `pard_token`).
        spec["parallel_drafting"] = True
    if cfg.get("heterogeneous_vocab"):
        # A trimmed-vocabulary draft: vLLM maps ids between the tokenizers by string (greedy drafting only).
        spec["use_heterogeneous_vocab"] = True
    return spec


def engine_kwargs(cfg: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model": job["target"],
        "dtype": job.get("dtype", "float32"),
        "seed": int(job.get("seed", 0)),
        "max_model_len": int(job["max_model_len"]),
        "max_num_seqs": int(job.get("max_num_seqs", 8)),
        "enforce_eager": bool(job.get("enforce_eager", True)),
        "tensor_parallel_size": int(job.get("tensor_parallel_size", 1)),
        "trust_remote_code": bool(job.get("trust_remote_code", False)),
        "disable_log_stats": False,  # get_metrics() is empty without it
    }
    if job.get("device") == "cuda":
        kw["gpu_memory_utilization"] = float(job.get("gpu_memory_utilization", 0.85))
    spec = speculative_config(cfg, job)
    if spec is not None:
        kw["speculative_config"] = spec
    return kw


def empty_result(cfg: dict[str, Any], error: str | None = None) -> dict[str, Any]:
    k = int(cfg.get("k") or 0)
    return {
        "name": cfg["name"],
        "method": cfg.get("method"),
        "draft": cfg.get("draft"),
        "k": k,
        "temperature": float(cfg["temperature"]),
        "draft_sample_method": cfg.get("draft_sample_method"),
        "parallel_drafting": bool(cfg.get("parallel_drafting")),
        "heterogeneous_vocab": bool(cfg.get("heterogeneous_vocab")),
        "startup_s": None,
        "wall_s": [],
        "load_avg": [],
        "foreign_cpu": [],
        "output_tokens": 0,
        "output_tokens_per_pass": [],
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "accepted_per_pos": [0] * k,
        "texts": [],
        "token_ids": [],
        "error": error,
    }


def _sampling_params(job: dict[str, Any], temperature: float, n_prompts: int) -> list[Any]:
    from vllm import SamplingParams

    eos = job.get("eos_token_id")
    stop = [int(e) for e in (job.get("stop_token_ids") or [eos]) if e is not None]
    seed = int(job.get("seed", 0))
    # One seed per prompt: the same sampling work in every repeat and every configuration.
    return [
        SamplingParams(
            temperature=temperature, max_tokens=int(job["max_tokens"]), stop_token_ids=stop, seed=seed + i
        )
        for i in range(n_prompts)
    ]


def _generate(llm: Any, prompts: list[list[int]], params: list[Any]) -> list[Any]:
    inputs = [{"prompt_token_ids": p} for p in prompts]
    return llm.generate(inputs, params, use_tqdm=False)


def measure_temperature(
    llm: Any, cfg: dict[str, Any], job: dict[str, Any], clock: Callable[[], float] = time.perf_counter
) -> dict[str, Any]:
    """Warm-up pass, then `repeats` timed passes; counters summed over the timed passes."""
    prompts = job["prompts"]
    params = _sampling_params(job, float(cfg["temperature"]), len(prompts))
    warm = min(len(prompts), int(job.get("max_num_seqs", 8)))
    _generate(llm, prompts[:warm], params[:warm])
    k = int(cfg.get("k") or 0)
    res = empty_result(cfg)
    deltas: list[SpecCounters] = []
    for _ in range(int(job.get("repeats", 1))):
        before = extract_spec_counters(llm.get_metrics())
        res["load_avg"].append(hardware.load_avg())
        cpu0 = cpu_snapshot()
        t0 = clock()
        outs = _generate(llm, prompts, params)
        res["wall_s"].append(clock() - t0)
        res["foreign_cpu"].append(foreign_cpu_share(cpu0, cpu_snapshot(), res["wall_s"][-1]))
        deltas.append(counters_delta(before, extract_spec_counters(llm.get_metrics()), k))
        res["output_tokens_per_pass"].append(sum(len(o.outputs[0].token_ids) for o in outs))
    res["output_tokens"] = res["output_tokens_per_pass"][0]
    res["texts"] = [o.outputs[0].text for o in outs]
    res["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
    total = sum_counters(deltas, k)
    res.update(
        num_drafts=total.num_drafts,
        num_draft_tokens=total.num_draft_tokens,
        num_accepted_tokens=total.num_accepted_tokens,
        accepted_per_pos=total.accepted_per_pos,
    )
    return res


def _proc_busy_ticks(stat: str) -> int | None:
    """Busy clock ticks of the whole machine from /proc/stat's first line (everything but idle and iowait)."""
    fields = stat.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    steal = int(fields[8]) if len(fields) > 8 else 0
    return user + nice + system + irq + softirq + steal


def _session_ticks(session: int, proc: Path | None = None) -> int:
    """CPU ticks (utime + stime) used so far by the processes of one session: this worker and the engine
    processes vLLM starts (the worker runs in its own session, see distill.utils.subproc)."""
    total = 0
    for d in (proc or Path("/proc")).iterdir():
        if not d.name.isdigit():
            continue
        try:
            rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        # rest[0] is field 3 (state): session is field 6, utime and stime fields 14 and 15.
        if int(rest[3]) == session:
            total += int(rest[11]) + int(rest[12])
    return total


def cpu_snapshot() -> tuple[int, int] | None:
    """(machine busy ticks, this session's ticks), or None where /proc is not there (not Linux)."""
    try:
        busy = _proc_busy_ticks(Path("/proc/stat").read_text())
        own = _session_ticks(os.getsid(0))
    except (OSError, ValueError):
        return None
    return None if busy is None else (busy, own)


def foreign_cpu_share(
    before: tuple[int, int] | None, after: tuple[int, int] | None, wall_s: float
) -> float | None:
    """Share of the machine's CPU time used by processes outside this eval during a timed pass (0 = the
    machine was ours). The load average cannot tell this: vLLM's own engine processes already load 2 cores."""
    if before is None or after is None or wall_s <= 0:
        return None
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    capacity = wall_s * ticks_per_s * (os.cpu_count() or 1)
    foreign = (after[0] - before[0]) - (after[1] - before[1])
    return round(max(0.0, foreign / capacity), 3)


def _shutdown(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # best effort: the process group is killed at the end anyway
        log.debug("engine shutdown: %s", exc)


def start_engine(
    group: list[dict[str, Any]], job: dict[str, Any]
) -> tuple[Any, float] | list[dict[str, Any]]:
    """(engine, start-up seconds) for `group`, or the group's error results when the engine does not start."""
    from vllm import LLM

    t0 = time.perf_counter()
    try:
        llm = LLM(**engine_kwargs(group[0], job))
    except Exception as exc:
        log.exception("engine start failed for %s", group[0]["name"])
        return [empty_result(c, f"engine start failed: {type(exc).__name__}: {exc}") for c in group]
    return llm, time.perf_counter() - t0


def measure_group(
    llm: Any, group: list[dict[str, Any]], job: dict[str, Any], startup: float | None
) -> list[dict[str, Any]]:
    """Measure each temperature of `group` on its running engine; errors become per-config `error` strings."""
    out = []
    for cfg in group:
        try:
            res = measure_temperature(llm, cfg, job)
        except Exception as exc:
            log.exception("measurement failed for %s at T=%s", cfg["name"], cfg["temperature"])
            res = empty_result(cfg, f"{type(exc).__name__}: {exc}")
        res["startup_s"] = startup
        out.append(res)
    return out


def stop_engine(llm: Any) -> None:
    _shutdown(llm)
    del llm
    gc.collect()


def run_group(group: list[dict[str, Any]], job: dict[str, Any]) -> list[dict[str, Any]]:
    """Start one engine for `group`, measure each temperature, stop it."""
    started = start_engine(group, job)
    if isinstance(started, list):
        return started
    llm, startup = started
    try:
        return measure_group(llm, group, job, startup)
    finally:
        stop_engine(llm)


class KeptEngines:
    """`job["keep_engines"]`: each group's engine starts in the first round and serves every later one (its
    start-up is reported in the first round only, None after); all of them are stopped by `close`. An engine
    that failed to start is not tried again: its error repeats in every round."""

    def __init__(self, job: dict[str, Any], n_engines: int) -> None:
        if job.get("device") == "cuda":
            # The engines share the GPU: each gets its part of the memory the eval may take.
            share = float(job.get("gpu_memory_utilization", 0.85)) / max(1, n_engines)
            job = {**job, "gpu_memory_utilization": share}
        self.job = job
        self.engines: dict[int, tuple[Any, float] | list[dict[str, Any]]] = {}

    def run_group(self, index: int, group: list[dict[str, Any]]) -> list[dict[str, Any]]:
        first = index not in self.engines
        if first:
            self.engines[index] = start_engine(group, self.job)
        started = self.engines[index]
        if isinstance(started, list):
            return [dict(r) for r in started]
        llm, startup = started
        return measure_group(llm, group, self.job, startup if first else None)

    def close(self) -> None:
        for started in self.engines.values():
            if not isinstance(started, list):
                stop_engine(started[0])
        self.engines.clear()


PLUGIN_ENTRY_POINT = "distill.vllm_worker.plugin:register"


def plugin_entry_point_registered() -> bool:
    """vLLM runs its engine in spawned processes on CPU: only the installed entry point reaches them."""
    from importlib.metadata import entry_points

    eps = entry_points(group="vllm.general_plugins")
    return any(ep.value.replace(" ", "") == PLUGIN_ENTRY_POINT for ep in eps)


def environment(job: dict[str, Any]) -> dict[str, Any]:
    import vllm

    from distill.vllm_worker import plugin

    return {
        "engine": "vllm",
        "engine_version": getattr(vllm, "__version__", "unknown"),
        "device": job.get("device", "cpu"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "hardware": hardware.describe(job.get("device", "cpu")),
        "vllm_env": {
            k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU") or k == "OMP_NUM_THREADS"
        },
        "plugin": {**plugin.status(), "entry_point": plugin_entry_point_registered()},
    }


def _write_partial(job: dict[str, Any], payload: dict[str, Any]) -> None:
    path = job.get("partial_path")
    if path:
        atomic_write_json(path, payload)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run every configuration of the job; return {"results": [...], "complete": True, engine facts...}."""
    from distill.vllm_worker import plugin

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # The entry point loads the plugin in vLLM's own processes; registering here as well covers the engine
    # processes forked from this one even when the package's entry points are stale.
    plugin.register()
    payload: dict[str, Any] = {**environment(job), "results": [], "complete": False, "measured": 0}
    _write_partial(job, payload)
    groups = engine_groups(job["configs"])
    rounds = int(job.get("rounds", 1))
    kept = KeptEngines(job, len(groups)) if job.get("keep_engines") and rounds > 1 else None
    done: list[list[dict[str, Any]]] = []
    try:
        for r in range(rounds):
            done.append([])
            for i, group in enumerate(groups):
                log.info(
                    "engine %d/%d%s: %s k=%s %s",
                    i + 1,
                    len(groups),
                    f" (round {r + 1}/{rounds})" if rounds > 1 else "",
                    group[0]["name"],
                    group[0].get("k"),
                    group[0].get("draft_sample_method") or "",
                )
                done[-1].extend(kept.run_group(i, group) if kept else run_group(group, job))
                # Pooled so far, and how many configurations were measured (the eval's progress counts them).
                payload["results"] = pool_rounds(done)
                payload["measured"] = sum(map(len, done))
                payload["last"] = {k: v for k, v in done[-1][-1].items() if k not in ("texts", "token_ids")}
                _write_partial(job, payload)
    finally:
        if kept:
            kept.close()
    payload.pop("last", None)
    payload["complete"] = True
    payload["plugin"] = {**plugin.status(), "entry_point": plugin_entry_point_registered()}
    return payload
