"""Schema of the `eval` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from distill.schema import opt

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


@dataclass
class DraftRef:
    name: str = opt("draft", "Label of this draft in the report.")
    model: str = opt("", "Model reference: folder, hub id or alias.")
    k: list[int] = opt(
        [],
        "Speculative tokens per step to sweep for this draft; empty = eval.k (e.g. [4] for a parallel draft "
        "measured beside an autoregressive one at [1]).",
        each_ge=1,
    )
    method: Literal["draft_model", "eagle"] = opt(
        "draft_model",
        "vLLM speculative method for this draft. `draft_model`: a standalone small LM with the target's "
        "vocabulary (what `distill train` writes). `eagle`: an EAGLE-1 head (fc.weight + decoder layers, "
        "reading the target's hidden states; it may share the target's embeddings, head and tokenizer), "
        "measured with engine vllm only and without the analytic estimate.",
    )


@dataclass
class EvalConfig:
    engine: Literal["auto", "vllm", "hf"] = opt(
        "auto",
        "`vllm` = real vLLM speculative decoding; `hf` = the reference PyTorch engine; `auto` = vLLM if installed.",
    )
    prompts: str = opt("", "Prompt source for eval; empty = the `test` split of `data.source`.")
    prompt_field: str = opt(
        "auto", "Field holding the prompt in `eval.prompts` (`prompt`, `messages`, `text`, auto)."
    )
    num_prompts: int = opt(
        100,
        "Prompts evaluated: the first ones that fit data.max_prompt_tokens (longer ones are skipped).",
        ge=1,
    )
    max_tokens: int = opt(128, "New tokens per prompt (stops early at EOS).", ge=1)
    drafts: list[DraftRef] = opt(
        [DraftRef("base", "${run.dir}/draft_init"), DraftRef("distilled", "${run.dir}/draft")],
        "Drafts to compare, each {name, model, k, method}; k (default: eval.k) and method (default: "
        "draft_model) are optional.",
    )
    k: list[int] = opt([1, 2, 3, 4, 5, 6], "Speculative tokens per step to sweep.", each_ge=1)
    temperatures: list[float] = opt([0.0], "Sampling temperatures to evaluate.", each_ge=0.0)
    repeats: int = opt(3, "Timed repeats per configuration (median reported).", ge=1)
    rounds: int = opt(
        1,
        "Sweeps over all configurations in turn (A B C, A B C, ...); each configuration's repeats are pooled over "
        "the rounds (median of repeats x rounds passes) and the report adds its speedup per round. On a shared, "
        "drifting machine 2 keeps one slow spell from deciding a ratio; every round starts each vLLM engine again "
        "unless eval.keep_engines.",
        ge=1,
    )
    keep_engines: bool = opt(
        False,
        "With eval.rounds > 1 on vLLM: start each configuration's engine once and keep all of them running until "
        "the last round, instead of starting each again every round (a start costs 1-2 minutes on a 2-core CPU: "
        "compile, KV cache, draft). All engines are resident at once, so it suits a few configurations (the "
        "protocol's no_spec, ngram and one draft): on CPU each engine takes its own eval.cpu_kvcache_gib plus its "
        "processes' memory, and nothing checks that N of them fit; on a GPU they split "
        "eval.gpu_memory_utilization evenly. A start-up time is then reported for the first round only.",
        hashed_when_set=True,
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = opt(
        None, "Precision of target and drafts in eval; null = target.dtype. Greedy equality holds in float32."
    )
    draft_sample_methods: list[str] = opt(
        ["greedy", "probabilistic"],
        "vLLM `draft_sample_method`s swept at temperature > 0 (greedy = argmax drafts, probabilistic = sampled "
        "drafts with full draft probabilities in the ratio test). Temperature 0 always uses greedy.",
    )
    rejection_sample_method: Literal["standard", "block"] = opt(
        "standard", "vLLM `rejection_sample_method` (`synthetic` is not offered: it asserts on CPU)."
    )
    ngram: bool = opt(
        True, "Also measure vLLM's prompt-lookup (ngram) speculation, the no-training baseline."
    )
    ngram_k: int = opt(0, "Speculative tokens for ngram; 0 = the largest of eval.k.", ge=0)
    ngram_prompt_lookup_min: int = opt(
        2, "Shortest n-gram matched in the prompt (vLLM prompt_lookup_min).", ge=1
    )
    ngram_prompt_lookup_max: int = opt(
        5, "Longest n-gram matched in the prompt (vLLM prompt_lookup_max).", ge=1
    )
    max_num_seqs: int = opt(
        8, "Prompts decoded concurrently (vLLM max_num_seqs; the batch of the measurement).", ge=1
    )
    tensor_parallel_size: int = opt(1, "vLLM tensor parallelism (GPUs) for target and draft.", ge=1)
    enforce_eager: bool = opt(
        False,
        "vLLM enforce_eager. false (vLLM's own default, what `vllm serve` runs): compiled decoding, torch.compile "
        "on CPU (needs a C++ compiler) and CUDA graphs on GPU; on the 2-core CPU the target decoded 1.19x faster "
        "than eager, so eager speedups overstate a served draft's (1.25x eager vs 1.19x compiled, BENCHMARKS.md). "
        "true: no compile, an engine starts about a minute sooner.",
    )
    cpu_reserved_cores: int = opt(
        0,
        "VLLM_CPU_NUM_OF_RESERVED_CPU: cores vLLM keeps free on CPU (its default 1 halves a 2-core machine).",
        ge=0,
    )
    cpu_kvcache_gib: int = opt(2, "VLLM_CPU_KVCACHE_SPACE: GiB of KV cache on CPU.", ge=1)
    gpu_memory_utilization: float = opt(0.85, "vLLM gpu_memory_utilization on GPUs.", gt=0.0, le=1.0)
    timeout_s: float = opt(
        7200.0, "The vLLM worker is stopped after this many seconds (partial results kept).", gt=0.0
    )
    min_acceptance: float = opt(
        0.3,
        "The deploy gate's bar on how often the draft matches the target: the share of rounds whose first "
        "drafted token is accepted (per_position_acceptance[0]; for k=1 the acceptance rate). Not vLLM's "
        "acceptance_rate (accepted / drafted tokens), which falls as k grows and would hold back longer drafts "
        "that measured faster. Below the bar a configuration is recommended only when none passes (then with "
        "deploy: false); a faster configuration held back by this bar alone is named in the recommendation's "
        "reason. Untrained drafts sit near 0.05.",
        ge=0.0,
        le=1.0,
    )
    cost_ratio: float | None = opt(
        None,
        "Draft/target cost ratio c for the analytic estimate; null = measured (PyTorch decode steps).",
        ge=0.0,
    )
    analytic_prompts: int = opt(
        8,
        "Prompts used to estimate acceptance from the distributions (Σ min(p, q)) for the analytic "
        "estimate; 0 = skip the estimate.",
        ge=0,
    )
    plots: bool = opt(True, "Write PNG plots (per-position acceptance, speedup vs k).")

    def problems(self) -> list[str]:
        out = []
        bad = [m for m in self.draft_sample_methods if m not in DRAFT_SAMPLE_METHODS]
        if bad or not self.draft_sample_methods:
            out.append(
                f"draft_sample_methods: {bad or '[]'} invalid; use a non-empty list of "
                f"{', '.join(DRAFT_SAMPLE_METHODS)}."
            )
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            out.append(
                f"ngram_prompt_lookup_min: {self.ngram_prompt_lookup_min} must be <= "
                f"eval.ngram_prompt_lookup_max ({self.ngram_prompt_lookup_max})."
            )
        names = [d.name for d in self.drafts]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            out.append(f"drafts: names must be unique, {dup} repeated.")
        reserved = {"no_spec", "ngram"} & set(names)
        if reserved:
            out.append(f"drafts: {sorted(reserved)} are reserved names (the baselines); rename the draft.")
        if len(set(self.k)) != len(self.k) or not self.k:
            out.append(f"k: {self.k} must be a non-empty list without repeats.")
        if not self.temperatures:
            # An empty sweep measures nothing at all (not even the no_spec baseline), yet would exit 0.
            out.append(
                "temperatures: [] measures nothing; list at least one sampling temperature, e.g. [0.0]."
            )
        return out
