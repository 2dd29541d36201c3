"""Schema of the `train` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from distill.schema import opt


@dataclass
class TrainConfig:
    loss: Literal["fkl", "rkl", "jsd", "tvd", "ce"] = opt("fkl", "Distillation loss.")
    max_steps: int = opt(200, "Optimizer steps.", ge=1)
    batch_size: int = opt(8, "Sequences per micro-batch per device.", ge=1)
    grad_accum: int = opt(1, "Micro-batches per optimizer step.", ge=1)
    lr: float = opt(1e-4, "Peak learning rate (AdamW).", gt=0.0)
    max_seq_len: int = opt(512, "Sequences are cut to this many tokens.", ge=8)
    teacher: Literal["online", "cached"] = opt("online", "Teacher logits from a frozen target or the cache.")
    devices: int = opt(1, "Devices per node.", ge=1)
    strategy: Literal["auto", "ddp", "ddp_spawn", "fsdp"] = opt("auto", "Lightning strategy.")
    precision: Literal["32", "bf16-mixed"] = opt("32", "Training precision.")
    val_every: int = opt(50, "Validate every N steps.", ge=1)
    ckpt_every: int = opt(50, "Checkpoint every N steps.", ge=1)
    resume: Literal["auto", "never"] = opt("auto", "Continue from the newest valid checkpoint.")
