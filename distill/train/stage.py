"""`distill train`: distil the draft on the target's distributions over the data stage's responses.

Validate everything (model references and weights, vocabulary, data, checkpoint) -> record the stage (a fresh
start first deletes what an earlier training left) -> build the draft and save it as `draft_init/` -> measure
the undistilled draft -> Lightning fit (resumable, from checksummed checkpoints; SIGTERM and Ctrl-C save and
exit 130) -> export `draft/` (never with non-finite weights) -> mark complete.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distill import rundir
from distill.config import Config, to_dict
from distill.errors import InputError, Interrupted, RuntimeFailure
from distill.losses import LossSpec
from distill.train.callbacks import (
    AtomicCheckpoint,
    LogProgress,
    StopFlag,
    TrimFreedMemory,
    handle_signals,
)
from distill.utils.fs import atomic_write_json, read_json, remove_stale_temporaries

log = logging.getLogger("distill.train")


@dataclass
class Plan:
    """What validation found: everything `run` needs before any weights load."""

    target_dir: Path
    train_dir: Path
    ckpt_path: Path
    resume_from: Path | None
    spec: LossSpec
    train_rows: int
    val_rows: int
    resume_step: int | None = None  # the global step `resume_from` holds


def train_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "train"


def is_child_rank() -> bool:
    """True in every process of a multi-process launch besides rank 0 (srun tasks, torchrun, Lightning's `ddp`
    re-execution, other nodes): they re-run this stage, and must not write the run folder's shared files."""
    from distill.pipeline import launcher_rank  # the one rank rule, shared with `distill run`

    return launcher_rank() != 0


def shared_vocab(tokenizer_len: int, draft_rows: int, target_rows: int) -> int:
    """The vocabulary the distributions are compared over: the shared tokenizer's length. Embedding tables padded
    past it (to a multiple of 64, ...) have rows no token id reaches; they must not enter the KL. When a table is
    smaller than the tokenizer (an inconsistent folder), the rows both tables have."""
    rows = min(draft_rows, target_rows)
    if tokenizer_len > rows:
        log.warning(
            "the tokenizer has %d tokens but an embedding table only %d rows; comparing the first %d",
            tokenizer_len,
            rows,
            rows,
        )
        return rows
    return tokenizer_len


def loss_spec(cfg: Config) -> LossSpec:
    t = cfg.train
    return LossSpec(t.loss_weight_map(), jsd_beta=t.jsd_beta, temperature=t.kd_temperature)


# ---------------------------------------------------------------------------------------------------------
# Validation (nothing written)


def _check_data(cfg: Config) -> tuple[int, int]:
    from distill.train.data import load_rows

    cached = cfg.train.teacher == "cached"
    train = load_rows(cfg.run_dir, "train", cached=cached, max_seq_len=cfg.train.max_seq_len)
    val = load_rows(cfg.run_dir, "val", cached=cached, max_seq_len=cfg.train.max_seq_len)
    t = cfg.train
    world = t.devices * t.num_nodes
    need = t.batch_size * t.grad_accum * world
    if len(train) < need:
        raise InputError(
            _cut_by_max_seq_len(cfg, train, need, "train")
            or f"train.batch_size: one optimizer step needs {need} sequences (batch_size {t.batch_size} x "
            f"grad_accum {t.grad_accum} x {world} processes) but {cfg.run_dir}/data/train has {len(train)} usable "
            "rows. Lower train.batch_size / train.grad_accum, or build more data (data.max_train_prompts)."
        )
    if len(val) == 0:
        raise InputError(
            _cut_by_max_seq_len(cfg, val, 1, "val")
            or f"{cfg.run_dir}/data/val has no usable rows; validation needs some. Rerun `distill data` with "
            "data.val_fraction > 0 (and data.max_val_prompts > 0)."
        )
    if cached and train.cache is not None:
        from distill.models.draft import load_model_config, remote_code_refused
        from distill.models.resolve import resolve_model

        target_dir = resolve_model(cfg.target.model, key="target.model")
        with remote_code_refused("target", target_dir):
            target_cfg = load_model_config(target_dir, trust_remote_code=cfg.target.trust_remote_code)
        target_vocab = int(target_cfg.vocab_size)
        if train.cache.meta.vocab_size != target_vocab:
            raise InputError(
                f"{cfg.run_dir}/data/topk: the cache was built for a vocabulary of {train.cache.meta.vocab_size} "
                f"rows, the target ({cfg.target.model}) has {target_vocab}. Rebuild the data with this target "
                "(`distill data` with data.overwrite=true)."
            )
    return len(train), len(val)


def _cut_by_max_seq_len(cfg: Config, rows: Any, need: int, split: str) -> str | None:
    """The message naming train.max_seq_len when the cut to it is why `split` has fewer than `need` rows with a
    response token (the rows have enough before the cut); None when another key is to blame."""
    firsts = sorted(m.index(1) for m in rows.ds["loss_mask"] if 1 in m)  # each row's first response token
    if len(firsts) < need:
        return None
    least = max(firsts[need - 1] + 1, 8)  # 8: the key's minimum
    return (
        f"train.max_seq_len: cutting sequences to {cfg.train.max_seq_len} tokens leaves {len(rows)} of the "
        f"{len(firsts)} rows of {cfg.run_dir}/data/{split} a response token to learn from, and "
        f"{'one optimizer step' if split == 'train' else 'validation'} needs {need}. Raise train.max_seq_len "
        f"to at least {least}."
    )


OTHER_CONFIG = "trained with a different config"


def _ckpt_problem(path: Path, stage_hash: str) -> str | None:
    """None when `path` loads safely, is intact and was trained with `stage_hash`, else what is wrong with it."""
    from distill.train.callbacks import checksum_problem

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        return f"cannot be loaded safely ({type(exc).__name__}: {exc})"
    damaged = checksum_problem(path, state.get("global_step")) or _non_finite_problem(state)
    if damaged:
        return damaged
    saved = (state.get("hyper_parameters") or {}).get("stage_hash")
    return None if saved == stage_hash else OTHER_CONFIG


def _tensors(obj: Any, name: str) -> Any:
    """(name, tensor) of every tensor in nested dicts / lists / tuples."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{name}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{name}.{i}")


def non_finite_names(tensors: Any) -> list[str]:
    """Names of the floating-point tensors among (name, tensor) pairs that hold a nan or an inf."""
    return [n for n, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _non_finite_problem(state: dict[str, Any]) -> str | None:
    """Weights or optimizer moments that are nan / inf: resuming them trains on nothing but nan."""
    bad = non_finite_names(_tensors({k: state.get(k) for k in ("state_dict", "optimizer_states")}, "ckpt"))
    if not bad:
        return None
    return f"holds non-finite values (nan/inf) in {_tensor_count(bad)} ({', '.join(n[5:] for n in bad[:3])})"


def _tensor_count(names: list[str]) -> str:
    return f"{len(names)} tensor{'' if len(names) == 1 else 's'}"


def _ckpt_step(path: Path) -> int:
    """The global step a (validated) checkpoint holds; memory-mapped, so its tensors are not read."""
    return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])


def _other_checkpoints(ckpt: Path) -> list[Path]:
    """Other checkpoints beside `ckpt` (copies, ModelCheckpoint files), newest first; temporaries excluded."""
    others = [p for p in ckpt.parent.glob("*.ckpt") if p.name != ckpt.name and p.is_file()]
    return sorted(others, key=lambda p: p.stat().st_mtime, reverse=True)


def _check_resume(cfg: Config, ckpt: Path) -> Path | None:
    """The newest valid checkpoint to resume from: `last.ckpt`, or when it is missing or cannot be loaded, the
    newest other checkpoint in train/ that loads and was trained with this config (a fresh start deletes them,
    so one of this training is never passed over)."""
    if cfg.train.resume == "never":
        return None
    want = rundir.stage_hash(cfg, "train")
    if not ckpt.is_file():
        return _first_valid(_other_checkpoints(ckpt), want)
    problem = _ckpt_problem(ckpt, want)
    if problem is None:
        return ckpt
    if problem == OTHER_CONFIG:
        raise InputError(
            f"{ckpt}: this checkpoint was trained with a different config (target/draft/data/train sections "
            "or run.seed). Use a new run.dir, restore the config, or set train.resume=never to start over."
        )
    tried = []
    for other in _other_checkpoints(ckpt):
        why = _ckpt_problem(other, want)
        if why is None:
            log.warning("%s %s; resuming from %s instead", ckpt, problem, other)
            return other
        tried.append(f"{other.name} {why}")
    fallback = (
        f"no other checkpoint there is usable: {'; '.join(tried)}"
        if tried
        else f"there is no other checkpoint in {ckpt.parent} to fall back to"
    )
    raise InputError(f"{ckpt}: {problem}, and {fallback}. Delete it or set train.resume=never to start over.")


def _first_valid(candidates: list[Path], stage_hash: str) -> Path | None:
    """The newest usable checkpoint when last.ckpt is missing; None when there is none at all. Checkpoints that
    are all foreign or damaged are refused rather than deleted by the fresh start that None would mean."""
    tried = []
    for path in candidates:
        why = _ckpt_problem(path, stage_hash)
        if why is None:
            log.warning("%s is missing; resuming from %s", path.parent / "last.ckpt", path)
            return path
        tried.append(f"{path.name} {why}")
    if tried:
        raise InputError(
            f"{candidates[0].parent}: no last.ckpt, and no other checkpoint there can be resumed ({'; '.join(tried)}). "
            "Use a new run.dir, restore the config, or set train.resume=never to start over (it deletes them)."
        )
    return None


def _check_models(cfg: Config) -> Path:
    from distill.models.draft import preflight_draft
    from distill.models.resolve import require_weights, resolve_model

    target_dir = resolve_model(cfg.target.model, key="target.model", revision=cfg.target.revision)
    draft_dir = preflight_draft(cfg, target_dir)  # vocabulary / layer checks on configs and tokenizers only
    # Weights that cannot load (pickle only, cut short) would fail after the run folder is written.
    if cfg.train.teacher == "online" or cfg.draft.init == "truncate":
        require_weights(target_dir, key="target.model")
    if draft_dir is not None:
        require_weights(draft_dir, key="draft.model")
    if cfg.draft.vocab_size:
        _check_vocab_size(cfg, draft_dir or target_dir)
    return target_dir


def _check_vocab_size(cfg: Config, tokenizer_dir: Path) -> None:
    """`draft.vocab_size` leaves room for the tokens every trimmed draft keeps, and the tokenizer is a
    byte-level BPE (what `vocab.trim_tokenizer_json` can reduce); checked before any training."""
    import json

    from distill.models.draft import load_tokenizer
    from distill.models.vocab import always_kept

    tokenizer = load_tokenizer(tokenizer_dir, trust_remote_code=cfg.target.trust_remote_code)
    path = tokenizer_dir / "tokenizer.json"
    kind = (
        json.loads(path.read_text(encoding="utf-8")).get("model", {}).get("type") if path.is_file() else None
    )
    if kind != "BPE":
        raise InputError(
            f"draft.vocab_size: trimming needs a BPE tokenizer.json, and {tokenizer_dir} has "
            f"{'a ' + str(kind) + ' one' if kind else 'none'}; set draft.vocab_size=0 (the full vocabulary)."
        )
    need = len(always_kept(tokenizer, None)) + 1  # + the mask token, chosen later, if it is not special
    if cfg.draft.vocab_size < need:
        raise InputError(
            f"draft.vocab_size: {cfg.draft.vocab_size} cannot hold the {need - 1} special and single-byte tokens "
            f"every trimmed draft keeps; use at least {need} (e.g. 16384), or 0 for the full vocabulary."
        )


def _check_hardware(cfg: Config) -> None:
    t = cfg.train
    has_gpu = torch.cuda.is_available()
    if t.accelerator == "gpu" and not has_gpu:
        raise InputError(
            "train.accelerator: 'gpu' but no CUDA device is visible; use train.accelerator=auto or cpu."
        )
    if t.strategy == "fsdp" and (t.accelerator == "cpu" or not has_gpu):
        raise InputError(
            "train.strategy: Lightning's FSDP strategy runs on GPUs only (it refuses accelerator='cpu'). On CPU "
            "use train.strategy=ddp (or ddp_spawn) with train.devices=N processes."
        )
    if (
        t.precision == "bf16-mixed"
        and has_gpu
        and t.accelerator != "cpu"
        and not torch.cuda.is_bf16_supported()
    ):
        raise InputError("train.precision: this GPU has no bfloat16 support; use train.precision=32.")


def validate(cfg: Config) -> Plan:
    spec = loss_spec(cfg)
    _check_hardware(cfg)
    target_dir = _check_models(cfg)
    n_train, n_val = _check_data(cfg)
    tdir = train_dir(cfg.run_dir)
    ckpt = tdir / "last.ckpt"
    resume_from = _check_resume(cfg, ckpt)
    return Plan(
        target_dir=target_dir,
        train_dir=tdir,
        ckpt_path=ckpt,
        resume_from=resume_from,
        spec=spec,
        train_rows=n_train,
        val_rows=n_val,
        resume_step=None if resume_from is None else _ckpt_step(resume_from),
    )


# ---------------------------------------------------------------------------------------------------------
# Building


def _teacher_dtype(cfg: Config) -> str:
    return cfg.target.dtype if cfg.train.teacher_dtype == "auto" else cfg.train.teacher_dtype


def load_teacher(cfg: Config, target_dir: Path) -> Any | None:
    if cfg.train.teacher == "cached":
        return None
    from distill.models.draft import load_causal_lm

    teacher = load_causal_lm(
        target_dir, dtype=_teacher_dtype(cfg), trust_remote_code=cfg.target.trust_remote_code
    )
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


def parallel_of(draft: Any, mask_fraction: float = 1.0) -> Any:
    """The draft's parallel-drafting setup (`distill.train.data.Parallel`), None for an ordinary draft."""
    from distill.models.draft import parallel_tokens_of
    from distill.train.data import Parallel

    tokens = parallel_tokens_of(draft.config)
    return Parallel(tokens, int(draft.config.pard_token), mask_fraction) if tokens else None


def val_positions(cfg: Config, draft: Any) -> int:
    """Validation buckets: draft positions 0..k-1 of a parallel draft, else positions in the response."""
    parallel = parallel_of(draft)
    return parallel.tokens if parallel is not None else cfg.train.val_max_positions


def freeze_embeddings(draft: Any) -> int:
    """Stop training the input embeddings and the output head (one matrix when tied); returns the weights frozen."""
    frozen: dict[int, Any] = {}
    for module in (draft.get_input_embeddings(), draft.get_output_embeddings()):
        if module is not None:
            frozen[id(module.weight)] = module.weight
    for weight in frozen.values():
        weight.requires_grad_(False)
    return sum(w.numel() for w in frozen.values())


def build_module(cfg: Config, draft: Any, teacher: Any | None, spec: LossSpec, vocab: int) -> Any:
    from distill.train.module import DistillModule, OptimConfig

    t = cfg.train
    optim = OptimConfig(
        lr=t.lr,
        min_lr_ratio=t.min_lr_ratio,
        warmup_steps=min(t.warmup_steps, t.max_steps),
        max_steps=t.max_steps,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        grad_clip=t.grad_clip,
    )
    hparams = {
        "config": {s: to_dict(getattr(cfg, s)) for s in ("run", "target", "draft", "data", "train")},
        "stage_hash": rundir.stage_hash(cfg, "train"),
    }
    return DistillModule(
        draft,
        teacher,
        spec,
        optim,
        vocab=vocab,
        eval_temperature=t.eval_temperature,
        max_positions=val_positions(cfg, draft),
        hparams=hparams,
        history_path=train_dir(cfg.run_dir) / "val_history.json",
        block_rows=t.logits_block_rows,
        closed_form=t.loss_gradient == "auto",
        head_candidates=t.head_candidates,
    )


def build_datamodule(cfg: Config, pad_id: int, parallel: Any = None) -> Any:
    from distill.train.data import DistillDataModule

    t = cfg.train
    return DistillDataModule(
        cfg.run_dir,
        batch_size=t.batch_size,
        grad_accum=t.grad_accum,
        max_seq_len=t.max_seq_len,
        cached=t.teacher == "cached",
        pad_id=pad_id,
        seed=cfg.run.seed,
        num_workers=t.num_workers,
        parallel=parallel,
        pack=t.pack_sequences,
    )


def build_trainer(cfg: Config, plan: Plan, stop: StopFlag, memory_retained: bool = False) -> Any:
    import lightning as L
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from rich.console import Console

    t = cfg.train
    on_terminal = Console().is_terminal
    # One CSV folder per attempt (a resumed run must not overwrite the earlier attempt's rows); `_finish`
    # merges them into train/metrics.csv.
    loggers = [
        CSVLogger(str(plan.train_dir), name="csv"),
        TensorBoardLogger(str(plan.train_dir), name="tensorboard", version=""),
    ]
    callbacks: list[Any] = [
        AtomicCheckpoint(plan.ckpt_path, every=t.ckpt_every, max_steps=t.max_steps, stop=stop),
        # A terminal gets the rich bar; a log file (cron, SLURM) gets a line every 30 s instead.
        RichProgressBar(leave=True) if on_terminal else LogProgress(),
    ]
    if memory_retained:
        from distill.utils import malloc

        callbacks.append(
            TrimFreedMemory(
                malloc.TRIM_EVERY_STEPS,
                malloc.retained_memory_budget(),
                reserve_bytes=malloc.memory_reserve_bytes(),
            )
        )
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=t.strategy,
        precision="32-true" if t.precision == "32" else "bf16-mixed",
        max_steps=t.max_steps,
        max_epochs=-1,
        val_check_interval=t.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=loggers,
        callbacks=callbacks,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        deterministic=t.deterministic,
        log_every_n_steps=t.log_every,
        default_root_dir=str(plan.train_dir),
        enable_model_summary=False,
        enable_progress_bar=on_terminal,
    )


# ---------------------------------------------------------------------------------------------------------
# Run


def _save_draft_init(cfg: Config, draft: Any, tokenizer: Any, target_dir: Path, plan: Plan) -> None:
    from distill.models.draft import save_hf_folder

    out = cfg.run_dir / "draft_init"
    if plan.resume_from is not None and (out / "config.json").is_file():
        return
    save_hf_folder(draft, tokenizer, out, generation_source=target_dir)
    log.info("saved the undistilled draft to %s", out)


def _baseline(
    cfg: Config, draft: Any, teacher: Any | None, plan: Plan, pad_id: int, vocab: int
) -> dict[str, Any]:
    """Validation figures of the undistilled draft (computed once per run folder)."""
    from distill.train.data import load_rows, val_loader
    from distill.train.module import evaluate_draft

    path = plan.train_dir / "baseline.json"
    if plan.resume_from is not None and path.is_file():
        return read_json(path)  # type: ignore[no-any-return]
    rows = load_rows(
        cfg.run_dir, "val", cached=cfg.train.teacher == "cached", max_seq_len=cfg.train.max_seq_len
    )
    t0 = time.perf_counter()
    figures = evaluate_draft(
        draft,
        teacher,
        val_loader(
            rows, cfg.train.batch_size, pad_id, parallel=parallel_of(draft), pack=cfg.train.pack_sequences
        ),
        plan.spec,
        eval_temperature=cfg.train.eval_temperature,
        vocab=vocab,
        max_positions=val_positions(cfg, draft),
        block_rows=cfg.train.logits_block_rows,
    )
    figures["step"] = 0
    figures["seconds"] = round(time.perf_counter() - t0, 3)
    atomic_write_json(path, figures)
    log.info(
        "undistilled draft: val/expected_acceptance %.4f, val/top1_agreement %.4f, val/loss %.4f",
        figures["expected_acceptance"],
        figures["top1_agreement"],
        figures["loss"],
    )
    return figures


def _fit(trainer: Any, module: Any, dm: Any, plan: Plan, stop: StopFlag) -> None:
    """trainer.fit with SIGTERM and Ctrl-C turned into "save at the next step boundary, then exit 130"."""
    try:
        with handle_signals(stop.handler):
            trainer.fit(
                module,
                datamodule=dm,
                ckpt_path=str(plan.resume_from) if plan.resume_from else None,
                weights_only=True,
            )
    except SystemExit as exc:  # Lightning turns the KeyboardInterrupt of a second Ctrl-C into sys.exit(1)
        if not stop.forced:
            raise
        raise Interrupted(
            f"stopped at once by a second Ctrl-C; {plan.ckpt_path} holds the last checkpoint saved, rerun the "
            "same command to resume from it."
        ) from exc
    if stop.requested:  # the signal came after the last step boundary: the final checkpoint is already saved
        raise Interrupted(f"received {stop.signal_name}; checkpoint saved, rerun the same command to resume.")


def _restore_last(plan: Plan) -> None:
    """After falling back to another checkpoint, copy it over the unreadable `last.ckpt` (atomically), so that
    `last.ckpt` is valid again even when no further step runs."""
    import shutil

    from distill.train.callbacks import write_checksum

    assert plan.resume_from is not None and plan.resume_step is not None
    tmp = plan.ckpt_path.with_name(f".{plan.ckpt_path.name}.restore.tmp")
    shutil.copyfile(plan.resume_from, tmp)
    os.replace(tmp, plan.ckpt_path)
    write_checksum(plan.ckpt_path, plan.resume_step)  # the unreadable file's record would refuse the copy
    log.warning("replaced the unreadable %s with a copy of %s", plan.ckpt_path, plan.resume_from)


def _interrupt_now(signum: int, frame: Any) -> None:
    # Inside a Lightning call but outside fit's step loop: raise what Lightning re-raises (an Exception), not
    # the KeyboardInterrupt it would turn into exit code 1.
    raise Interrupted(
        f"received {signal.Signals(signum).name} outside a training step (the last step's checkpoint is saved); "
        "rerun the same command to finish."
    )


def _export(cfg: Config, module: Any, tokenizer: Any, target_dir: Path) -> Path:
    from distill.models.draft import save_hf_folder

    draft = module.draft
    draft.eval()
    _refuse_non_finite(draft)
    trimmed = None
    if cfg.draft.vocab_size and cfg.draft.vocab_size < int(draft.config.vocab_size):
        draft, trimmed = _trimmed_copy(cfg, draft, tokenizer)
    return save_hf_folder(
        draft, tokenizer, cfg.run_dir / "draft", generation_source=target_dir, trimmed=trimmed
    )


def _trimmed_copy(cfg: Config, draft: Any, tokenizer: Any) -> tuple[Any, tuple[list[int], int]]:
    """A copy of `draft` keeping `draft.vocab_size` tokens chosen on the training rows, and what
    `save_hf_folder` needs to write it; logs the share of the validation rows' tokens kept."""
    import copy

    from distill.data.format import load_split_dataset
    from distill.models import vocab

    vocab_len = int(draft.config.vocab_size)
    counts = vocab.count_tokens(load_split_dataset(cfg.run_dir, "train")["input_ids"])
    kept = vocab.kept_for(counts, cfg.draft.vocab_size, tokenizer, draft.config)
    val = vocab.count_tokens(load_split_dataset(cfg.run_dir, "val")["input_ids"])
    log.info(
        "draft.vocab_size: the exported draft keeps %d of %d tokens (%.2f%% of the validation rows' tokens)",
        len(kept),
        vocab_len,
        100 * vocab.coverage(val, kept),
    )
    return vocab.trim_model(copy.deepcopy(draft), kept), (kept, vocab_len)


def _refuse_non_finite(draft: Any) -> None:
    """A draft with nan / inf weights is never exported (nor the stage marked complete): eval would measure it,
    publish would ship it."""
    bad = non_finite_names([*draft.named_parameters(), *draft.named_buffers()])
    if bad:
        raise RuntimeFailure(
            f"the trained draft has non-finite weights (nan/inf) in {_tensor_count(bad)} ({', '.join(bad[:3])}); it "
            "is not exported. The checkpoint it resumed from is damaged or training diverged: delete "
            "train/last.ckpt to fall back to an older checkpoint or set train.resume=never to start over, and "
            "lower train.lr if it happens again."
        )


def run(cfg: Config) -> int | None:
    from distill.utils.malloc import freed_memory_retained

    plan = validate(cfg)
    # Training's objects are gone when _train returns, so leaving the block hands their memory back.
    with freed_memory_retained(cfg.train.retain_freed_memory) as retained:
        _train(cfg, plan, retained)
    return None


def _train(cfg: Config, plan: Plan, memory_retained: bool = False) -> None:
    """The train stage proper (`run`), inside the allocator setting."""
    import lightning as L

    from distill.models.draft import build_initial_draft, load_model_config, load_tokenizer

    child = is_child_rank()
    if not child:
        rundir.start_stage(cfg, "train")
        plan.train_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(plan.train_dir)
        remove_stale_temporaries(cfg.run_dir)
        if plan.resume_from not in (None, plan.ckpt_path):
            _restore_last(plan)
        if plan.resume_from is None:
            _discard_earlier_training(cfg, plan)
        log.info(
            "train: %d train rows, %d val rows, loss %s, teacher %s, %s",
            plan.train_rows,
            plan.val_rows,
            plan.spec.weights,
            cfg.train.teacher,
            f"resuming from {plan.resume_from}" if plan.resume_from else "from scratch",
        )
    L.seed_everything(cfg.run.seed, workers=True, verbose=False)
    tokenizer = load_tokenizer(plan.target_dir, trust_remote_code=cfg.target.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    draft = build_initial_draft(cfg, plan.target_dir)
    target_rows = load_model_config(
        plan.target_dir, trust_remote_code=cfg.target.trust_remote_code
    ).vocab_size
    vocab = shared_vocab(len(tokenizer), int(draft.config.vocab_size), int(target_rows))
    teacher = load_teacher(cfg, plan.target_dir)
    baseline: dict[str, Any] | None = None
    if not child:
        _save_draft_init(cfg, draft, tokenizer, plan.target_dir, plan)
        baseline = _baseline(cfg, draft, teacher, plan, pad_id, vocab)
    L.seed_everything(cfg.run.seed, workers=True, verbose=False)
    stop = StopFlag()
    if cfg.train.freeze_embeddings:
        log.info("train.freeze_embeddings: %d embedding/head weights kept fixed", freeze_embeddings(draft))
    module = build_module(cfg, draft, teacher, plan.spec, vocab)
    module.baseline = baseline  # logged at step 0 of a fresh start, so the curves show the gain
    dm = build_datamodule(cfg, pad_id, parallel_of(draft, cfg.train.parallel_mask_fraction))
    trainer = build_trainer(cfg, plan, stop, memory_retained)
    t0 = time.perf_counter()
    if _missed_validation(cfg, plan):
        _validate_resumed_step(trainer, module, dm, plan)
    _fit(trainer, module, dm, plan, stop)
    # fit returns only at max_steps (an interruption raises); spawned strategies leave the parent's loop
    # state at 0, so the configured step count is the reliable one.
    # Decided from the config, not from files, so every rank takes the same (collective) branch.
    steps = cfg.train.max_steps
    if steps % cfg.train.val_every:
        module.eval_step = steps
        with handle_signals(_interrupt_now):
            trainer.validate(module, datamodule=dm, verbose=False)
    if not trainer.is_global_zero or child:
        return None
    _finish(cfg, plan, module, steps, tokenizer, baseline, time.perf_counter() - t0)
    return None


# What an earlier training left in the run folder besides the data: a fresh start deletes it first.
EARLIER_TRAINING_FILES = ("val_history.json", "baseline.json", "val_metrics.json", "metrics.csv")
EARLIER_TRAINING_DIRS = ("csv", "tensorboard")


def _discard_earlier_training(cfg: Config, plan: Plan) -> None:
    """Before a fresh start writes anything: delete what an earlier training (another config's, or one
    train.resume=never starts over) left, so that a fresh start interrupted before its first checkpoint leaves
    neither a checkpoint a rerun would refuse as foreign (or resume) nor a completion record and `draft/` that
    claim the stage complete beside the new `draft_init/`. A resume never comes here."""
    import shutil

    from distill.train.callbacks import CHECKSUM_SUFFIX, checksum_path

    rundir.clear_complete(cfg, "train")  # first: the record must not outlive the outputs it describes
    draft = cfg.run_dir / "draft"
    if draft.is_dir():
        shutil.rmtree(draft)
    for ckpt in plan.train_dir.glob("*.ckpt"):
        checksum_path(ckpt).unlink(missing_ok=True)
        ckpt.unlink()
    for orphan in plan.train_dir.glob(f"*.ckpt{CHECKSUM_SUFFIX}"):  # sidecars of checkpoints deleted by hand
        orphan.unlink()
    for name in EARLIER_TRAINING_FILES:
        (plan.train_dir / name).unlink(missing_ok=True)
    for name in EARLIER_TRAINING_DIRS:  # their curves would merge into the new training's
        if (plan.train_dir / name).is_dir():
            shutil.rmtree(plan.train_dir / name)


def _missed_validation(cfg: Config, plan: Plan) -> bool:
    """Whether the resumed step is a validation step whose validation never finished. The checkpoint of a step
    is saved before that step's validation runs, and Lightning does not repeat it on resume, so a hard kill
    (or a stop request) there would lose it. Read from files every rank sees, so all take the same branch."""
    from distill.train.module import read_history

    step = plan.resume_step
    if not step or step % cfg.train.val_every:
        return False
    return all(h.get("step") != step for h in read_history(plan.train_dir / "val_history.json"))


def _validate_resumed_step(trainer: Any, module: Any, dm: Any, plan: Plan) -> None:
    """Validate the resumed checkpoint's weights, recorded at its step, before training goes on."""
    log.info(
        "validating step %s first: its validation did not finish before the interruption", plan.resume_step
    )
    module.eval_step = plan.resume_step
    with handle_signals(_interrupt_now):
        trainer.validate(
            module, datamodule=dm, ckpt_path=str(plan.resume_from), verbose=False, weights_only=True
        )


def merge_csv_logs(tdir: Path) -> Path:
    """train/csv/version_*/metrics.csv -> train/metrics.csv, ordered by step. An attempt that resumed from an
    earlier step replays rows: per family of rows (training, validation), its rows replace the earlier attempts'
    rows of that family from its first step on, and families it did not log keep theirs (a rerun of a finished
    run logs only the final validation, which must not drop the last training row)."""
    import csv
    import io

    from distill.utils.fs import atomic_write_text

    versions = sorted(
        (tdir / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])
    )
    rows: list[dict[str, str]] = []
    header: list[str] = []
    for path in versions:
        with open(path, newline="") as f:
            new = list(csv.DictReader(f))
        rows = replace_replayed(rows, new)
        header.extend(k for k in (new[0].keys() if new else []) if k not in header)
    rows.sort(key=_row_step)  # stable: rows of one step stay in the order they were logged
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=header, restval="")
    writer.writeheader()
    writer.writerows(rows)
    out = tdir / "metrics.csv"
    atomic_write_text(out, buf.getvalue())
    return out


def row_family(row: dict[str, str]) -> frozenset[str]:
    """The metric groups a logged row fills (`train`, `val`, `val_pos`, ...): `train/loss` -> `train`."""
    return frozenset(
        k.split("/")[0] for k, v in row.items() if v not in ("", None) and k not in ("step", "epoch")
    )


def _row_step(row: dict[str, str]) -> int:
    return int(float(row.get("step") or 0))


def replace_replayed(rows: list[dict[str, str]], new: list[dict[str, str]]) -> list[dict[str, str]]:
    """`rows` + `new`, without the rows of `rows` that `new` logged again: those of a family `new` has, at or
    after the first step `new` logged for it."""
    first: dict[frozenset[str], int] = {}
    for r in new:
        family = row_family(r)
        first[family] = min(first.get(family, _row_step(r)), _row_step(r))
    kept = [r for r in rows if _row_step(r) < first.get(row_family(r), _row_step(r) + 1)]
    return [*kept, *new]


def _finish(
    cfg: Config,
    plan: Plan,
    module: Any,
    steps: int,
    tokenizer: Any,
    baseline: dict[str, Any] | None,
    seconds: float,
) -> None:
    from distill.train.module import read_history

    out = _export(cfg, module, tokenizer, plan.target_dir)
    history = read_history(plan.train_dir / "val_history.json")
    final = history[-1] if history else {}
    atomic_write_json(plan.train_dir / "val_metrics.json", {"baseline": baseline, "final": final})
    merge_csv_logs(plan.train_dir)
    summary: dict[str, Any] = {
        "steps": steps,
        "seconds_this_run": round(seconds, 1),
        "baseline": {k: (baseline or {}).get(k) for k in ("expected_acceptance", "top1_agreement", "loss")},
        "final": {k: final.get(k) for k in ("expected_acceptance", "top1_agreement", "loss")},
        "draft": str(out),
        "checkpoint": str(plan.ckpt_path),
    }
    log.info(
        "trained %d steps: val/expected_acceptance %.4f -> %.4f, val/top1_agreement %.4f -> %.4f; draft at %s",
        summary["steps"],
        _or_nan(summary["baseline"]["expected_acceptance"]),
        _or_nan(final.get("expected_acceptance")),
        _or_nan(summary["baseline"]["top1_agreement"]),
        _or_nan(final.get("top1_agreement")),
        out,
    )
    rundir.mark_complete(cfg, "train", summary)


def _or_nan(value: float | None) -> float:
    """A figure for %-formatting: nan when it was not measured (an untrained draft's 0.0 stays 0.0)."""
    return float("nan") if value is None else float(value)
