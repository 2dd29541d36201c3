"""Schema of the `data` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from distill.schema import opt, section


@dataclass
class LogitsConfig:
    top_k: int = opt(0, "Cache the target's top-k log-probs per response token (0 = off).", ge=0)
    batch_size: int = opt(
        8, "Sequences per teacher forward pass when building the cache.", ge=1, run_only=True
    )
    source: Literal["auto", "vllm", "forward"] = opt(
        "auto",
        "Where the top-k comes from: `vllm` = the log-probs vLLM returns while generating (no extra pass; "
        "raw model log-probs, before temperature), `forward` = one transformers forward pass per sequence "
        "after generation; `auto` = vllm when the vLLM engine generates, else forward.",
    )
    codec: Literal["zlib", "lzma", "none"] = opt(
        "lzma", "Compressor of the cache (after delta coding); zlib is faster to write and read, ~8% larger."
    )


@dataclass
class DataConfig:
    source: str = opt(
        "sharegpt",
        "Prompt source: built-in alias `sharegpt`, or a path to jsonl/json/parquet/csv or a saved `datasets` folder. "
        "Prompts from files keep their layout (indentation, spacing); ShareGPT's are whitespace-normalised.",
    )
    prompt_field: str = opt(
        "auto",
        "Field holding the prompt: `prompt` (string), `messages` (chat list), `text`, or `auto` (first present).",
    )
    response_field: str = opt("auto", "Field holding the dataset's own response (for `responses: dataset`).")
    val_fraction: float = opt(0.02, "Share of prompts (by text hash) in the `val` split.", ge=0.0, lt=1.0)
    test_fraction: float = opt(
        0.02, "Share of prompts (by text hash) in the `test` split (used by eval).", ge=0.0, lt=1.0
    )
    max_train_prompts: int = opt(
        2000,
        "Train prompts to use (0 = all): the first this many, in a fixed order, that fit data.max_prompt_tokens.",
        ge=0,
    )
    max_val_prompts: int = opt(
        100, "Validation prompts to use (0 = all), chosen like data.max_train_prompts.", ge=0
    )
    max_prompt_tokens: int = opt(256, "Prompts longer than this (after the chat template) are skipped.", ge=1)
    max_new_tokens: int = opt(128, "Response length cap when the target generates.", ge=1)
    temperature: float = opt(0.0, "Target sampling temperature for responses (0 = greedy).", ge=0.0)
    top_p: float = opt(1.0, "Nucleus sampling for responses.", gt=0.0, le=1.0)
    responses_per_prompt: int = opt(1, "Responses generated per prompt.", ge=1)
    system_prompt: str | None = opt(None, "System message prepended to every prompt (null = none).")
    engine: Literal["auto", "vllm", "hf"] = opt("auto", "Generation engine; `auto` = vLLM when installed.")
    responses: Literal["generate", "dataset"] = opt(
        "generate", "`generate` = target-written responses; `dataset` = keep the dataset's own responses."
    )
    batch_size: int = opt(
        64,
        "Prompts per generation batch: vLLM keeps this many requests in flight (across batches with "
        "data.vllm_stream); also the unit of resumption (each batch is one atomic chunk, written when its last "
        "response is done).",
        ge=1,
    )
    tensor_parallel_size: int = opt(1, "vLLM tensor parallelism for generation.", ge=1, run_only=True)
    data_parallel_size: int = opt(
        1,
        "vLLM data parallelism: this many engines, each on tensor_parallel_size GPUs, split the chunks.",
        ge=1,
        run_only=True,
    )
    shard_index: int = opt(
        0, "This job's shard of the prompts (several jobs build one dataset).", ge=0, run_only=True
    )
    num_shards: int = opt(1, "Number of parallel data jobs.", ge=1)
    overwrite: bool = opt(
        False, "Discard existing data built with another config instead of refusing.", run_only=True
    )
    merge: bool = opt(
        False,
        "Only join the shards of a sharded build (num_shards > 1) into the final dataset; no generation. "
        "The job that finishes last merges automatically; this is for rerunning the merge by hand.",
        run_only=True,
    )
    vllm_kvcache_gib: int = opt(
        4, "KV-cache size for vLLM on CPU (VLLM_CPU_KVCACHE_SPACE, GiB).", ge=1, run_only=True
    )
    vllm_gpu_memory_utilization: float = opt(
        0.85, "Share of GPU memory vLLM may use (GPU only).", gt=0.0, le=1.0, run_only=True
    )
    vllm_enforce_eager: bool = opt(
        False,
        "vLLM enforce_eager for generation. false (vLLM's default): compiled decoding, torch.compile on CPU "
        "(needs a C++ compiler), CUDA graphs on GPU; on the 2-core CPU 1.11x the eager rate but ~50 s more "
        "start-up, a gain from about 250k generated tokens on (BENCHMARKS.md section 6). true: eager, for small "
        "or one-off builds.",
        run_only=True,
    )
    vllm_stream: bool = opt(
        True,
        "true: vLLM keeps data.batch_size requests in flight across batches, a finished request's slot going "
        "to the next batch's next prompt at once, and writes each batch when its last response is done. "
        "false: one generate call per batch, whose batch drains at each batch's end while its longest "
        "responses finish (the behaviour before 2026-12-07; for comparison, BENCHMARKS.md section 6).",
        run_only=True,
    )
    worker_timeout_s: float = opt(
        172800.0,
        "Stop the vLLM generation worker after this many seconds (the work done so far is kept).",
        gt=0.0,
        run_only=True,
    )
    logits: LogitsConfig = section(LogitsConfig, "Optional compact cache of the target's top-k logits.")

    def problems(self) -> list[str]:
        out = []
        if self.shard_index >= self.num_shards:
            out.append(f"shard_index: {self.shard_index} must be < data.num_shards ({self.num_shards}).")
        if self.val_fraction + self.test_fraction >= 1.0:
            out.append("val_fraction: val_fraction + test_fraction must leave room for a train split (< 1).")
        if self.responses_per_prompt > 1 and self.temperature == 0 and self.responses == "generate":
            # Greedy decoding writes the same response every time: copies would only weigh prompts twice.
            out.append(
                f"responses_per_prompt: {self.responses_per_prompt} responses per prompt need sampling; set "
                "data.temperature > 0 (e.g. 1.0) or data.responses_per_prompt=1."
            )
        return out
