"""Memory needed to serve target + draft: weights plus the KV cache for the configured length and batch.

Read from the model folders alone (config.json and the safetensors headers), no weights loaded.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1024**3


def param_count(folder: str | Path) -> int:
    """Number of parameters in the folder's safetensors files (from their JSON headers)."""
    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= int(dim)
            total += count
    return total


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Keys + values of every layer for one token."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * dtype_bytes


def estimate(
    target: tuple[Path, Any],
    drafts: dict[str, tuple[Path, Any]],
    *,
    dtype: str,
    max_model_len: int,
    batch: int,
) -> dict[str, Any]:
    """GiB for the target's weights and KV cache and for each draft's (a draft keeps its own KV cache)."""
    b = DTYPE_BYTES[dtype]
    tokens = max_model_len * batch
    gib = {
        "target weights": param_count(target[0]) * b / GIB,
        "target KV cache": kv_bytes_per_token(target[1], b) * tokens / GIB,
    }
    worst = 0.0
    for name, (folder, cfg) in drafts.items():
        w = param_count(folder) * b / GIB
        kv = kv_bytes_per_token(cfg, b) * tokens / GIB
        gib[f"draft {name} weights"] = w
        gib[f"draft {name} KV cache"] = kv
        worst = max(worst, w + kv)
    gib["total (target + largest draft)"] = gib["target weights"] + gib["target KV cache"] + worst
    return {
        "dtype": dtype,
        "max_model_len": max_model_len,
        "batch": batch,
        "gib": gib,
        "note": f"KV cache for {batch} sequences of {max_model_len} tokens in {dtype}; activations and the "
        "engine's own buffers come on top.",
    }
