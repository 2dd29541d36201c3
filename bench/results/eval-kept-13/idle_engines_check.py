"""Do idle resident vLLM engines use CPU while another engine decodes? Ad hoc check for eval.keep_engines.

Run as it ran on 2026-12-07 (output: idle_engines_check.jsonl):
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python idle_engines_check.py \
        ~/.cache/distill/models/smollm2-135m-instruct-v1 checkpoints/smollm2-sharegpt/draft
"""

import json
import os
import sys
import time
from pathlib import Path


def tree():
    kids = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kids.setdefault(int(rest[1]), []).append((int(d.name), int(rest[11]) + int(rest[12])))
    return kids


def descendants(pid, kids):
    out = {}
    for c, t in kids.get(pid, []):
        out[c] = t
        out.update(descendants(c, kids))
    return out


def main():
    from distill.vllm_worker import plugin

    plugin.register()
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    target, draft = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        for t in ["Explain how a bicycle works.", "Write a short poem about the sea.", "What is a hash map?"]
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    me = os.getpid()
    before = set(descendants(me, tree()))
    a = LLM(model=target, dtype="bfloat16", max_model_len=512, max_num_seqs=1, disable_log_stats=False)
    a_pids = set(descendants(me, tree())) - before
    b = LLM(
        model=target,
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=1,
        disable_log_stats=False,
        speculative_config={
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": 3,
            "parallel_drafting": True,
        },
    )
    b_pids = set(descendants(me, tree())) - before - a_pids
    sp = SamplingParams(temperature=0, max_tokens=128)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    hz = os.sysconf("SC_CLK_TCK")
    for name, llm, idle in (
        ("a decodes, b idle", a, b_pids),
        ("b decodes, a idle", b, a_pids),
        ("a decodes, b idle", a, b_pids),
    ):
        llm.generate(inputs[:1], sp, use_tqdm=False)
        t0 = descendants(me, tree())
        w0 = time.perf_counter()
        llm.generate(inputs, sp, use_tqdm=False)
        w = time.perf_counter() - w0
        t1 = descendants(me, tree())
        idle_s = sum(t1.get(p, 0) - t0.get(p, 0) for p in idle) / hz
        busy_s = sum(t1.get(p, 0) - t0.get(p, 0) for p in t1 if p not in idle) / hz
        print(
            json.dumps({"case": name, "wall_s": round(w, 2), "idle_engine_cpu_s": idle_s, "active_cpu_s": busy_s}),
            flush=True,
        )
    t0 = descendants(me, tree())
    time.sleep(10)
    t1 = descendants(me, tree())
    print(
        json.dumps({"case": "both idle 10 s", "cpu_s": sum(t1.get(p, 0) - t0.get(p, 0) for p in t1) / hz}),
        flush=True,
    )


if __name__ == "__main__":
    main()
