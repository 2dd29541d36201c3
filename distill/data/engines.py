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


class PerPromptSampler:
    """Sampling for `generate` in greedy mode: argmax over Gumbel-perturbed log-probs, each row its own RNG.

    argmax(log p + Gumbel noise) is an exact draw from p (the Gumbel-max trick). Drawing the noise from a
    generator seeded per response (`request_seed` of its prompt + response index) makes every response a function
    of its prompt alone: batch size, chunking, sharding and resumes do not change it (one global
    `torch.manual_seed` per batch would). Temperature and top-p are applied here, as vLLM does.
    """

    def __init__(self, seeds: list[int], temperature: float, top_p: float):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            logp = top_p_filter(logp, self.top_p)
        vocab = scores.shape[-1]
        u = torch.stack([torch.rand(vocab, generator=g) for g in self.generators]).to(scores.device)
        return logp - torch.log(-torch.log(u))  # u == 0 gives -inf noise: never picked


def top_p_filter(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens until their mass reaches `top_p` (always the top one); others -> -inf."""
    srt, idx = logp.sort(dim=-1, descending=True)
    p = srt.exp()
    drop = (p.cumsum(-1) - p) >= top_p  # the tokens before this one already hold top_p
    drop[..., 0] = False
    return logp.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))


def hf_generate(
    model: Any, tok: Any, prompts: list[Prompt], cfg: DataConfig, run_seed: int, eos: set[int]
) -> list[list[Response]]:
    """Batched `generate` with left padding; sampled responses depend on their prompt only (`PerPromptSampler`)."""
    from transformers import LogitsProcessorList

    n = cfg.responses_per_prompt
    rows = [p for p in prompts for _ in range(n)]  # response j of prompt i is row i * n + j
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    width = max(len(p.token_ids) for p in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, p in enumerate(rows):
        input_ids[i, width - len(p.token_ids) :] = torch.tensor(p.token_ids)
        attn[i, width - len(p.token_ids) :] = 1
    kwargs: dict[str, Any] = dict(
        max_new_tokens=cfg.max_new_tokens,
        do_sample=False,  # greedy over PerPromptSampler's perturbed scores when sampling
        pad_token_id=pad,
        eos_token_id=sorted(eos),
        temperature=None,
        top_p=None,
        top_k=None,
    )
    if cfg.temperature > 0:
        seeds = [request_seed(run_seed, p.prompt_id) + i % n for i, p in enumerate(rows)]
        kwargs["logits_processor"] = LogitsProcessorList(
            [PerPromptSampler(seeds, cfg.temperature, cfg.top_p)]
        )
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attn, **kwargs)
    new = out[:, width:].tolist()
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
        "enforce_eager": cfg.vllm_enforce_eager,
        # Requests the worker keeps in the engine at once; across chunk boundaries unless `stream` is off.
        "max_in_flight": cfg.batch_size,
        "stream": cfg.vllm_stream,
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
