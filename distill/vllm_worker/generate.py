"""Worker job "generate": the target writes responses with vLLM's offline engine (data stage).

Job (JSON): {"kind": "generate", "model": DIR, "dtype": str, "seed": int, "max_model_len": int,
"tensor_parallel_size": int, "data_parallel_size": int, "gpu_memory_utilization": float,
"trust_remote_code": bool, "enforce_eager": bool, "max_in_flight": int, "stream": bool,
"sampling": {"temperature", "top_p", "max_tokens", "n", "logprobs": int | null},
"chunks": [{"out": PATH, "prompts": [{"prompt_id": str, "token_ids": [int], "seed": int | null}]}]}

Requests stream through one engine, `max_in_flight` at a time (the data stage's `data.batch_size`), refilled
from the next chunks as they finish (`ChunkStream`; with "stream": false a chunk's requests are submitted only
once the previous chunk is done, as one generate call per chunk would). Each chunk's result is written
atomically to its `out` path as soon as its last request is done, so a killed worker loses only the chunks not
yet written: {"responses": [[{"token_ids": [int], "finish_reason": str}] * n] per prompt,
"gen_s": float, "engine": "vllm", "engine_version": str}. Chunks whose `out` exists are skipped.
With `sampling.logprobs = k` each response also carries the target's top-k at every generated position:
"topk_ids": [[int] * k] and "topk_logprobs": [[float] * k] (descending; vLLM's raw log-probs, i.e. the model's
own distribution before temperature or top-p), one row per generated token.

Data parallelism: `LLM(data_parallel_size>1)` is refused for single-process use in this vLLM, so with
data_parallel_size = D > 1 this worker starts D copies of itself, each on its own group of
tensor_parallel_size GPUs (CUDA_VISIBLE_DEVICES) with every D-th chunk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Tokens per engine step when prefill is not chunked: vLLM's own CPU default with chunking.
UNCHUNKED_TOKEN_BUDGET = 4096


def _seeded_sampling_on_cpu(job: dict[str, Any]) -> bool:
    """Sampled (T > 0) responses get per-request seeds (`_sampling_params`); does this engine run on the CPU?"""
    if float(job["sampling"]["temperature"]) == 0.0:
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _sampling_params(job: dict[str, Any], seed: int | None) -> Any:
    from vllm import SamplingParams

    s = job["sampling"]
    greedy = float(s["temperature"]) == 0.0
    return SamplingParams(
        n=int(s["n"]),
        temperature=float(s["temperature"]),
        top_p=1.0 if greedy else float(s["top_p"]),
        max_tokens=int(s["max_tokens"]),
        seed=None if greedy else seed,
        detokenize=False,
        logprobs=s.get("logprobs") or None,
    )


def _build_llm(job: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=job["model"],
        tokenizer=job["model"],
        dtype=job["dtype"],
        seed=int(job["seed"]),
        max_model_len=int(job["max_model_len"]),
        tensor_parallel_size=int(job["tensor_parallel_size"]),
        trust_remote_code=bool(job.get("trust_remote_code", False)),
        enforce_eager=bool(job.get("enforce_eager", False)),
    )
    if job["sampling"].get("logprobs"):
        # vLLM caps returned log-probs at 20 per token unless told otherwise.
        kwargs["max_logprobs"] = int(job["sampling"]["logprobs"])
    if _seeded_sampling_on_cpu(job):
        # A seeded request whose prompt is prefilled in chunks has its generator rewound after each partial
        # step (`set_offset`), which CPU generators do not support: vLLM 0.32 dies with "CPU Generator does
        # not use offset" once a batch's prompts exceed the step's token budget. Whole-prompt prefill never
        # rewinds; the budget still covers the longest request.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(int(job["max_model_len"]), UNCHUNKED_TOKEN_BUDGET)
    if job.get("gpu_memory_utilization") is not None:
        kwargs["gpu_memory_utilization"] = float(job["gpu_memory_utilization"])
    return LLM(**kwargs)


def _write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _topk_rows(logprobs: Any, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """vLLM's per-position {token: Logprob} -> top-k ids and log-probs, descending.

    vLLM adds the sampled token to a position's dict when it is outside the top-k, so keep the k best.
    """
    ids, lps = [], []
    for position in logprobs:
        best = sorted(position.items(), key=lambda kv: kv[1].logprob, reverse=True)[:k]
        ids.append([int(t) for t, _ in best])
        lps.append([float(lp.logprob) for _, lp in best])
    return ids, lps


def _completion(c: Any, k: int) -> dict[str, Any]:
    out: dict[str, Any] = {"token_ids": list(c.token_ids), "finish_reason": c.finish_reason}
    if k:
        out["topk_ids"], out["topk_logprobs"] = _topk_rows(c.logprobs or [], k)
    return out


def _final_only(params: Any) -> Any:
    """Have the engine report a request once, when it is finished (what `LLM.generate` asks for too)."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


class ChunkStream:
    """Keeps `max_in_flight` requests in the engine across chunk boundaries and writes each chunk when its last
    request finishes.

    One `LLM.generate` call per chunk drains the batch at every chunk's end: the requests that stop early leave
    the engine running fewer and fewer sequences until the longest one finishes. Here a finished request's slot
    goes to the next chunk's next prompt at once, so the batch stays full until the last chunk, while each chunk
    is still written atomically on its own (the unit of resumption). Chunks finish about in order; a killed
    worker loses only the chunks not yet written. `gen_s` of a chunk is the wall time since the previous chunk
    was written (the first: since the first request), so the chunks' `gen_s` add up to the generation time.

    `engine` is vLLM's `LLMEngine` (`add_request(id, prompt, params)`, `step()` -> finished `RequestOutput`s);
    `request` builds a request's prompt and params, `write` stores a finished chunk. `across_chunks=False`
    submits a chunk only once the engine is empty: one generate call per chunk, for comparison.
    """

    def __init__(
        self,
        engine: Any,
        chunks: list[dict[str, Any]],
        max_in_flight: int,
        request: Callable[[dict[str, Any]], tuple[Any, Any]],
        write: Callable[[dict[str, Any], list[Any], float], None],
        across_chunks: bool = True,
    ) -> None:
        self.engine, self.chunks, self.max_in_flight = engine, chunks, max_in_flight
        self.request, self.write, self.across_chunks = request, write, across_chunks
        self.queue = [(c, i) for c, chunk in enumerate(chunks) for i in range(len(chunk["prompts"]))]
        self.queue.reverse()  # popped from the end: chunk 0's first prompt first
        self.results: list[list[Any]] = [[None] * len(chunk["prompts"]) for chunk in chunks]
        self.left = [len(chunk["prompts"]) for chunk in chunks]
        self.in_flight: dict[str, tuple[int, int]] = {}  # request id -> (chunk, prompt)
        self.last_chunk = -1  # the chunk of the last request submitted
        self.chunks_written = 0

    def _refill(self) -> None:
        while self.queue and len(self.in_flight) < self.max_in_flight:
            c, i = self.queue[-1]
            if not self.across_chunks and self.in_flight and c != self.last_chunk:
                break  # the next chunk waits until this one is done
            self.last_chunk = c
            self.queue.pop()
            request_id = f"distill-{c}-{i}"
            prompt, params = self.request(self.chunks[c]["prompts"][i])
            self.engine.add_request(request_id, prompt, params)
            self.in_flight[request_id] = (c, i)

    def run(self, keep_going: Callable[[], bool] = lambda: True) -> int:
        """Generate every chunk; returns how many were written. Stops early (writing nothing partial) when
        `keep_going()` turns false."""
        last = time.perf_counter()
        self._refill()
        while self.in_flight:
            if not keep_going():
                break
            for out in self.engine.step():
                if not out.finished or out.request_id not in self.in_flight:
                    continue
                c, i = self.in_flight.pop(out.request_id)
                self.results[c][i] = out
                self.left[c] -= 1
                if self.left[c] == 0:
                    now = time.perf_counter()
                    self.write(self.chunks[c], self.results[c], now - last)
                    self.results[c] = []  # written: free its outputs (log-probs are large)
                    self.chunks_written += 1
                    last = now
            self._refill()
        return self.chunks_written


def _write_chunk(chunk: dict[str, Any], outputs: list[Any], gen_s: float, k: int, version: str) -> int:
    responses = [[_completion(c, k) for c in out.outputs] for out in outputs]
    _write_json_atomic(
        Path(chunk["out"]),
        {"responses": responses, "gen_s": gen_s, "engine": "vllm", "engine_version": version},
    )
    return sum(len(c["token_ids"]) for r in responses for c in r)


def _run_single(job: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm.inputs import TokensPrompt

    parent = os.getppid()
    pending = [c for c in job["chunks"] if not Path(c["out"]).is_file()]
    if not pending:
        return {"chunks_done": 0, "tokens": 0, "engine_version": vllm.__version__}
    t0 = time.perf_counter()
    llm = _build_llm(job)
    startup_s = time.perf_counter() - t0
    print(f"engine ready in {startup_s:.1f} s; {len(pending)} chunks to generate", flush=True)
    k = int(job["sampling"].get("logprobs") or 0)
    tokens = 0

    def request(p: dict[str, Any]) -> tuple[Any, Any]:
        params = _final_only(_sampling_params(job, p.get("seed")))
        return TokensPrompt(prompt_token_ids=list(p["token_ids"])), params

    def write(chunk: dict[str, Any], outputs: list[Any], gen_s: float) -> None:
        nonlocal tokens
        tokens += _write_chunk(chunk, outputs, gen_s, k, vllm.__version__)
        print(f"chunk {stream.chunks_written + 1}/{len(pending)} done ({tokens} tokens so far)", flush=True)

    def parent_alive() -> bool:
        if os.getppid() == parent:
            return True
        # The stage was killed (kill -9 skips its cleanup): stop instead of racing the rerun's worker.
        print("parent process gone; stopping after the chunks already written", flush=True)
        return False

    max_in_flight = int(job.get("max_in_flight") or max(len(c["prompts"]) for c in pending))
    stream = ChunkStream(
        llm.llm_engine, pending, max_in_flight, request, write, across_chunks=bool(job.get("stream", True))
    )
    done = stream.run(parent_alive)
    return {
        "chunks_done": done,
        "tokens": tokens,
        "startup_s": startup_s,
        "engine_version": vllm.__version__,
    }


def _gpu_groups(dp: int, tp: int) -> list[str | None]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else None
    if devices is None:
        try:
            import torch

            n = torch.cuda.device_count()
        except Exception:
            n = 0
        devices = [str(i) for i in range(n)] if n else None
    if devices is None:
        return [None] * dp
    if len(devices) < dp * tp:
        raise RuntimeError(
            f"data_parallel_size {dp} x tensor_parallel_size {tp} needs {dp * tp} GPUs, "
            f"{len(devices)} visible"
        )
    return [",".join(devices[r * tp : (r + 1) * tp]) for r in range(dp)]


def _run_data_parallel(job: dict[str, Any]) -> dict[str, Any]:
    dp, tp = int(job["data_parallel_size"]), int(job["tensor_parallel_size"])
    groups = _gpu_groups(dp, tp)
    procs = []
    with tempfile.TemporaryDirectory(prefix="distill-dp-") as tmp:
        for rank in range(dp):
            sub = dict(job, data_parallel_size=1, chunks=job["chunks"][rank::dp])
            job_path, res_path = Path(tmp) / f"job{rank}.json", Path(tmp) / f"res{rank}.json"
            job_path.write_text(json.dumps(sub))
            env = dict(os.environ)
            if groups[rank] is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(groups[rank])
            cmd = [sys.executable, "-m", "distill.vllm_worker", str(job_path), str(res_path)]
            procs.append((subprocess.Popen(cmd, env=env), res_path))
        results = []
        for rank, (proc, res_path) in enumerate(procs):
            rc = proc.wait()
            if rc != 0 or not res_path.is_file():
                for other, _ in procs:
                    other.kill()
                raise RuntimeError(f"data-parallel rank {rank} failed (exit {rc})")
            results.append(json.loads(res_path.read_text()))
    return {
        "chunks_done": sum(r["chunks_done"] for r in results),
        "tokens": sum(r["tokens"] for r in results),
        "engine_version": results[0]["engine_version"],
        "data_parallel_size": dp,
    }


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    if int(job.get("data_parallel_size", 1)) > 1:
        return _run_data_parallel(job)
    return _run_single(job)
