"""Schema of the `train` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from distill.schema import opt, section

PRECISIONS = ("32", "bf16-mixed", "auto")


@dataclass
class LossWeights:
    fkl: float = opt(0.0, "Weight of forward KL(teacher || student).", ge=0.0)
    rkl: float = opt(0.0, "Weight of reverse KL(student || teacher).", ge=0.0)
    jsd: float = opt(0.0, "Weight of the generalized JSD(train.jsd_beta).", ge=0.0)
    tvd: float = opt(0.0, "Weight of total variation (1 - expected acceptance).", ge=0.0)
    ce: float = opt(0.0, "Weight of cross-entropy on the target's response tokens.", ge=0.0)


@dataclass
class TrainConfig:
    loss: Literal["fkl", "rkl", "jsd", "tvd", "ce", "mix"] = opt(
        "fkl",
        "Distillation loss: forward KL, reverse KL, JSD(jsd_beta), total variation, cross-entropy on the target's "
        "tokens, or `mix` = the weighted sum in `loss_weights`.",
    )
    loss_weights: LossWeights = section(LossWeights, "Term weights when `loss: mix`.")
    jsd_beta: float = opt(
        0.5, "JSD interpolation: 0 = forward KL, 1 = reverse KL, 0.5 = symmetric JSD.", ge=0.0, le=1.0
    )
    kd_temperature: float = opt(1.0, "Softmax temperature of teacher and student in the loss.", gt=0.0)
    max_steps: int = opt(200, "Optimizer steps.", ge=1)
    batch_size: int = opt(8, "Sequences per micro-batch per device.", ge=1)
    grad_accum: int = opt(1, "Micro-batches per optimizer step.", ge=1)
    lr: float = opt(1e-4, "Peak learning rate (AdamW).", gt=0.0)
    min_lr_ratio: float = opt(0.1, "Cosine schedule floor as a fraction of `lr`.", ge=0.0, le=1.0)
    warmup_steps: int = opt(
        10, "Linear warm-up steps before the cosine decay (capped at max_steps for short runs).", ge=0
    )
    weight_decay: float = opt(
        0.0, "AdamW weight decay (matrices only; norms and biases never decay).", ge=0.0
    )
    adam_beta1: float = opt(0.9, "AdamW beta1.", ge=0.0, lt=1.0)
    adam_beta2: float = opt(0.99, "AdamW beta2.", ge=0.0, lt=1.0)
    grad_clip: float = opt(1.0, "Clip the gradient norm to this value (0 = off).", ge=0.0)
    parallel_mask_fraction: float = opt(
        1.0,
        "Parallel drafts (draft.parallel_tokens >= 2): share of anchors whose mask group is trained at each "
        "step (every anchor trains the next-token proposal). Below 1 a step costs about 1 + (k - 1) x this "
        "fraction of an ordinary draft's step instead of k x, in time and memory.",
        gt=0.0,
        le=1.0,
    )
    freeze_embeddings: bool = opt(
        False,
        "Keep the draft's input embeddings and output head at their starting values (the target's, for "
        "`draft.init: truncate`): the draft learns to reach the target's output space instead of moving it, "
        "and the vocabulary-sized weight gradient and its optimizer update are skipped.",
    )
    retain_freed_memory: bool = opt(
        True,
        "On Linux (glibc), keep freed memory in the training process instead of returning it to the kernel "
        "(mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD): the vocabulary-sized logits a step allocates and frees "
        "then reuse the same pages instead of page-faulting fresh ones (1.43x faster CPU steps measured, "
        "BENCHMARKS.md section 7). The cost is resident memory (about 1.4 GB more at the peak for the shipped "
        "parallel draft with train.logits_block_rows 1024): it is handed back every 20 steps, at once when the process passes 0.7 of the machine's "
        "(or its cgroup's) memory or the machine has less than 20% of it available, and when training ends; when "
        "those force hand-backs a few steps apart (a long run's fragmented heap) training goes back to glibc's "
        "default. false = glibc's default.",
        run_only=True,
    )
    logits_block_rows: int = opt(
        1024,
        "Draft predictions whose vocabulary-sized logits exist at once: the output head and the loss (and "
        "validation) run over a micro-batch's predictions in blocks of this many rows, each block's gradient "
        "computed before the next, so the draft's logits take one block's memory whatever the batch (1024 x "
        "49,152 floats = 0.2 GB; an online teacher's logits still cover the micro-batch) and freed blocks are "
        "reused step after step: 1.06x faster steps at half the peak memory (BENCHMARKS.md section 7). 0 = all "
        "of a micro-batch's predictions at once. Same loss and gradient either way, up to float rounding.",
        ge=0,
        run_only=True,
    )
    pack_sequences: bool = opt(
        True,
        "Put several of a micro-batch's sequences (with a parallel draft's mask groups) into one row of the "
        "draft's input where they fit in the longest one's length, each attending only to itself with its "
        "positions restarting at 0: every hidden state, loss and gradient is the unpacked one's (up to float "
        "rounding) while the draft's layers run over less padding: 1.14x faster steps for the shipped config "
        "(BENCHMARKS.md section 7). false = one "
        "sequence per row, right-padded to the longest. An online teacher's forward keeps the unpacked input.",
        run_only=True,
    )
    loss_gradient: Literal["auto", "autograd"] = opt(
        "auto",
        "How the gradient of the loss with respect to the draft's logits is computed, in the blocks of "
        "train.logits_block_rows: `auto` = in closed form where one exists (forward KL on the cached top-k "
        "rows, CE, and mixes of the two, at kd_temperature 1), written over the logits' own float copy 64 rows "
        "at a time while they sit in the processor's cache: for the shipped config 1.03x faster steps and 2.3 GB "
        "less at the peak (BENCHMARKS.md section 7); autograd for every other loss. `autograd` = always "
        "through autograd (the reference). Same gradient either way, up to float rounding.",
        run_only=True,
    )
    head_candidates: int = opt(
        0,
        "Train the output head's softmax over this many candidate tokens per micro-batch instead of the whole "
        "vocabulary (sampled softmax): every token the micro-batch's teacher rows (cached top-k, or the online "
        "teacher's top-k per position) and labels name (more than this when they name more), and a uniform "
        "sample of the other tokens, a new one each step, whose logits are raised by log(others / sampled) so "
        "that they stand for all the others in the softmax's normaliser. The head's matmuls and the loss "
        "shrink by the vocabulary over this size; the gradient is an estimate of the full one. Validation and "
        "the exported draft keep the full vocabulary (as does a draft whose logits are not a bias-free product of "
        "its head, e.g. soft-capped ones). For the shipped recipe 16384 trained as well as the whole "
        "vocabulary at equal steps with 1.34x faster steps (BENCHMARKS.md section 7). 0 = the whole vocabulary "
        "(exact).",
        ge=0,
        hashed_when_set=True,
    )
    max_seq_len: int = opt(512, "Sequences are cut to this many tokens.", ge=8)
    teacher: Literal["online", "cached"] = opt(
        "online",
        "`online` = run the frozen target for every batch; `cached` = use the data stage's top-k logits "
        "(needs data.logits.top_k > 0; no teacher in memory).",
    )
    teacher_dtype: Literal["auto", "float32", "bfloat16"] = opt(
        "auto", "Precision of the frozen online teacher; `auto` = target.dtype."
    )
    eval_temperature: float = opt(
        1.0, "Temperature of val/expected_acceptance (0 = greedy: equals top-1 agreement).", ge=0.0
    )
    val_max_positions: int = opt(
        8,
        "Per-position-in-response breakdown of validation figures: positions 0..N-1, then one `N+` bucket.",
        ge=1,
    )
    devices: int = opt(1, "Devices (processes) per node.", ge=1)
    num_nodes: int = opt(1, "Nodes (machines) in a multi-node run.", ge=1)
    accelerator: Literal["auto", "cpu", "gpu"] = opt("auto", "Lightning accelerator.")
    strategy: Literal["auto", "ddp", "ddp_spawn", "fsdp"] = opt("auto", "Lightning strategy.")
    # A plain string checked in problems(): `train.precision=32` arrives from YAML/dotlist as the integer 32,
    # which a Literal["32", ...] would reject.
    precision: str = opt(
        "32",
        "Training precision: `32`, `bf16-mixed`, or `auto`: bf16-mixed where the training device computes "
        "bfloat16 natively (a GPU of compute capability >= 8.0; a CPU with AVX512-BF16, AMX or Arm BF16), else "
        "32. `auto` is resolved when the config is loaded (logged; the run folder's config.yaml and the config "
        "hash carry the result, so a run resumed on another kind of machine may find its folder foreign).",
    )
    deterministic: bool = opt(
        True, "Deterministic algorithms (bit-exact resume on CPU; may be slower on GPU)."
    )
    num_workers: int = opt(0, "DataLoader worker processes per device.", ge=0, run_only=True)
    val_every: int = opt(50, "Validate every N steps.", ge=1)
    ckpt_every: int = opt(50, "Checkpoint every N steps.", ge=1, run_only=True)
    log_every: int = opt(5, "Log training metrics every N steps.", ge=1, run_only=True)
    resume: Literal["auto", "never"] = opt(
        "auto", "Continue from the newest valid checkpoint.", run_only=True
    )

    def problems(self) -> list[str]:
        out = []
        if self.precision not in PRECISIONS:
            out.append(f"precision: got {self.precision!r}, expected one of {', '.join(PRECISIONS)}.")
        if self.loss == "mix":
            w = self.loss_weights
            if not any([w.fkl, w.rkl, w.jsd, w.tvd, w.ce]):
                out.append(
                    "loss_weights: all weights are 0 with loss: mix; give at least one a positive weight."
                )
        if self.teacher == "cached" and self.kd_temperature != 1.0:
            out.append(
                "kd_temperature: must be 1.0 with teacher: cached (the cache holds T=1 log-probs); "
                "use teacher: online for another temperature."
            )
        if self.teacher == "cached" and self.eval_temperature not in (0.0, 1.0):
            out.append(
                "eval_temperature: must be 0 or 1 with teacher: cached (the cache holds T=1 log-probs)."
            )
        return out

    def loss_weight_map(self) -> dict[str, float]:
        """The loss as term weights (a single loss is a one-hot mix)."""
        if self.loss != "mix":
            return {self.loss: 1.0}
        w = self.loss_weights
        return {"fkl": w.fkl, "rkl": w.rkl, "jsd": w.jsd, "tvd": w.tvd, "ce": w.ce}
