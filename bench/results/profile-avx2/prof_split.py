"""Split a py-spy raw profile (--subprocesses) of `distill eval` into the parts of a decode step per vLLM worker.

Usage: prof_split.py RAW_FILE WORKER_PID[=label] ...  Only the samples inside the worker's RPC handler (the model
steps) count; engine start-up (profile_run, compilation, warm-up) is left out.
"""
import collections, re, sys

def part(s: str) -> str | None:
    if "profile_run" in s or "compile_fx" in s or "warming_up" in s or "_execute_worker_rpc" not in s:
        return None
    if "propose" in s:
        if "compute_logits" in s or "_greedy_sample" in s:
            return "draft: head and argmax"
        if "_model_forward" in s or "LlamaModel.forward" in s or "Runner.call" in s:
            return "draft: layers"
        return "draft: rest (inputs, metadata)"
    if "GPUModelRunner.execute_model" in s:
        if "compute_logits" in s:
            return "target: head"
        if "_model_forward" in s:
            return "target: layers"
        return "target: rest (inputs, metadata)"
    if "sample_tokens" in s:
        return "sampling and rejection"
    return "rest of the step (messages, bookkeeping)"

raw, workers = sys.argv[1], [w.split("=") for w in sys.argv[2:]]
counts = {pid: collections.Counter() for pid, _ in workers}
for line in open(raw):
    stack, _, n = line.rstrip().rpartition(" ")
    if not n.isdigit():
        continue
    for pid, _ in workers:
        m = re.search(r'process %s:"[^"]*";(.*)$' % pid, stack)
        if m and (p := part(m.group(1))):
            counts[pid][p] += int(n)
for pid, label in workers:
    tot = sum(counts[pid].values())
    print(f"\n{label} (worker pid {pid}): {tot} samples in model steps")
    print("| part | share of the worker's step samples | samples |\n|---|---|---|")
    for k, v in sorted(counts[pid].items()):
        print(f"| {k} | {v / tot:.1%} | {v} |")
