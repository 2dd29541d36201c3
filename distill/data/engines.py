"""Response producers. Each returns, per prompt, `n` responses as {"token_ids": [...], "finished": bool}.

- `hf`: transformers `generate` in batches with left padding (machines without vLLM).
- `vllm`: a job for the vLLM worker subprocess (`distill/vllm_worker/generate.py`); see `vllm_job`.
- `dataset`: the dataset's own response text, tokenised and cut at `max_new_tokens`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from distill.data.config import DataConfig
from distill.data.prepare import Prompt, request_seed

Response = dict[str, Any]


def eos_ids(tok: Any, model_dir: Path | None = None) -> set[int]:
    """Token ids that end a response: the tokenizer's EOS plus the model's generation_config `eos_token_id`s."""
    ids: set[int] = set()
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    extra: Any = None
    if model_dir is not None and (Path(model_dir) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        extra = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, list):
        ids.update(int(i) for i in extra)
    return ids


def cut_at_eos(token_ids: list[int], eos: set[int], max_new_tokens: int) -> Response:
    """Keep tokens up to and including the first EOS; without one the response was cut by the length cap."""
    for i, t in enumerate(token_ids):
        if t in eos:
            return {"token_ids": token_ids[: i + 1], "finished": True}
    return {"token_ids": token_ids[:max_new_tokens], "finished": False}


def hf_generate(
    model: Any, tok: Any, prompts: list[Prompt], cfg: DataConfig, run_seed: int, eos: set[int]
) -> list[list[Response]]:
    """Batched `generate` with left padding. Sampling is seeded from the chunk's first prompt id."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    width = max(len(p.token_ids) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p.token_ids) :] = torch.tensor(p.token_ids)
        attn[i, width - len(p.token_ids) :] = 1
    sample = cfg.temperature > 0
    kwargs: dict[str, Any] = dict(
        max_new_tokens=cfg.max_new_tokens,
        do_sample=sample,
        pad_token_id=pad,
        eos_token_id=sorted(eos),
        num_return_sequences=cfg.responses_per_prompt,
    )
    if sample:
        kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
        torch.manual_seed(request_seed(run_seed, prompts[0].prompt_id))
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attn, **kwargs)
    new = out[:, width:].tolist()
    n = cfg.responses_per_prompt
    return [
        [cut_at_eos(new[i * n + j], eos, cfg.max_new_tokens) for j in range(n)] for i in range(len(prompts))
    ]


def dataset_responses(tok: Any, prompts: list[Prompt], cfg: DataConfig, eos_id: int) -> list[list[Response]]:
    out = []
    for p in prompts:
        ids = list(tok(p.response or "", add_special_tokens=False)["input_ids"])
        if len(ids) >= cfg.max_new_tokens:
            out.append([{"token_ids": ids[: cfg.max_new_tokens], "finished": False}])
        else:
            out.append([{"token_ids": [*ids, eos_id], "finished": True}])
    return out


def from_vllm(raw: list[list[dict[str, Any]]], eos: set[int], eos_id: int) -> list[list[Response]]:
    """Worker output -> responses. vLLM keeps the EOS token in `token_ids` when it stops on it."""
    out = []
    for per_prompt in raw:
        rs = []
        for c in per_prompt:
            ids = list(c["token_ids"])
            finished = c.get("finish_reason") == "stop"
            if finished and (not ids or ids[-1] not in eos):
                ids.append(eos_id)
            r: dict[str, Any] = {"token_ids": ids, "finished": finished}
            if "topk_ids" in c:  # the target's top-k at each generated position (data.logits.source)
                r["topk_ids"], r["topk_logprobs"] = c["topk_ids"], c["topk_logprobs"]
            rs.append(r)
        out.append(rs)
    return out


def logits_from_vllm(cfg: DataConfig, engine: str) -> bool:
    """Whether the top-k cache is taken from vLLM's generation log-probs (no separate teacher pass)."""
    if not cfg.logits.top_k or engine != "vllm":
        return False
    return cfg.logits.source in ("auto", "vllm")


def vllm_job(
    *,
    model_dir: Path,
    dtype: str,
    trust_remote_code: bool,
    cfg: DataConfig,
    run_seed: int,
    chunks: list[tuple[Path, list[Prompt]]],
    on_gpu: bool,
) -> dict[str, Any]:
    return {
        "kind": "generate",
        "model": str(model_dir),
        "dtype": dtype,
        "seed": run_seed,
        "max_model_len": cfg.max_prompt_tokens + cfg.max_new_tokens,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "data_parallel_size": cfg.data_parallel_size,
        "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization if on_gpu else None,
        "trust_remote_code": trust_remote_code,
        "enforce_eager": not on_gpu,
        "sampling": {
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "max_tokens": cfg.max_new_tokens,
            "n": cfg.responses_per_prompt,
            "logprobs": cfg.logits.top_k if logits_from_vllm(cfg, "vllm") else None,
        },
        "chunks": [
            {
                "out": str(out),
                "prompts": [
                    {
                        "prompt_id": p.prompt_id,
                        "token_ids": p.token_ids,
                        "seed": request_seed(run_seed, p.prompt_id),
                    }
                    for p in ps
                ],
            }
            for out, ps in chunks
        ],
    }


def vllm_env(cfg: DataConfig, on_gpu: bool) -> dict[str, str]:
    if on_gpu:
        return {}
    # On CPU vLLM reserves a core by default (halves throughput on 2 cores) and needs a KV-cache size.
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm_kvcache_gib)}
