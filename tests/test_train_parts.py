"""Unit tests of train-stage parts: launcher ranks, the compared vocabulary, cached rows past the tokenizer,
the stop flag."""

from __future__ import annotations

import signal

import pytest
import torch

RANK_VARS = ("RANK", "SLURM_PROCID", "SLURM_LOCALID", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


@pytest.mark.parametrize(
    ("env", "child"),
    [
        ({}, False),
        ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, False),
        ({"SLURM_PROCID": "1", "SLURM_LOCALID": "1"}, True),  # srun task 1 on the same node
        ({"SLURM_PROCID": "2", "SLURM_LOCALID": "0"}, True),  # srun task 2, first on its node
        ({"RANK": "3", "LOCAL_RANK": "0", "GROUP_RANK": "1"}, True),  # torchrun, second node
        ({"LOCAL_RANK": "1"}, True),  # Lightning's `ddp` re-execution
        ({"NODE_RANK": "1", "LOCAL_RANK": "0"}, True),
        ({"SLURM_PROCID": "0", "LOCAL_RANK": "1"}, True),  # `ddp` re-execution inside a one-task srun
    ],
)
def test_child_rank_follows_the_launcher(monkeypatch, env, child):
    from distill.pipeline import launcher_rank
    from distill.train.stage import is_child_rank

    for var in RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert is_child_rank() is child
    assert is_child_rank() == (launcher_rank() != 0)


def test_child_rank_uses_the_pipeline_rule(monkeypatch):
    import distill.pipeline as pipeline
    from distill.train.stage import is_child_rank

    monkeypatch.setattr(pipeline, "launcher_rank", lambda: 5)
    assert is_child_rank()


def test_shared_vocab_is_the_tokenizer_length():
    from distill.train.stage import shared_vocab

    assert shared_vocab(512, 576, 576) == 512  # both tables padded past the tokenizer
    assert shared_vocab(512, 512, 640) == 512
    assert shared_vocab(600, 576, 640) == 576  # an inconsistent folder: the rows both tables have


def _dense_loss(teacher_logits, student_logits):
    from distill.losses import LossSpec, per_token_loss

    labels = torch.zeros(student_logits.shape[0], dtype=torch.long)
    return {
        name: per_token_loss(LossSpec.single(name), student_logits, labels, teacher_logits)
        for name in ("fkl", "rkl", "jsd", "tvd")
    }


def test_cached_rows_past_the_tokenizer_equal_dense_over_the_tokenizer():
    """A full-width cache (k = padded vocab) restricted to the tokenizer equals the dense loss over it."""
    from distill.losses import LossSpec, SparseTeacher, eval_token_stats, per_token_loss
    from distill.train.module import fit_sparse_to_vocab

    g = torch.Generator().manual_seed(0)
    n, vocab, padded = 5, 12, 16
    t_logits = torch.randn(n, padded, generator=g, dtype=torch.float64).float() * 3
    t_logits[:, vocab:] += 4.0  # padded rows hold real mass in the teacher: they must not enter the KL
    s_logits = torch.randn(n, vocab, generator=g)
    lp = t_logits.log_softmax(-1)
    order = lp.argsort(-1, descending=True)
    cached = SparseTeacher(order, lp.gather(-1, order), torch.full((n,), float("-inf")))
    assert bool((cached.ids[:, :4] >= vocab).any())

    s_wide, aligned = fit_sparse_to_vocab(s_logits, cached, vocab)
    assert s_wide.shape == (n, vocab + 1) and int(aligned.ids.max()) == vocab
    labels = torch.zeros(n, dtype=torch.long)
    want = _dense_loss(t_logits[:, :vocab], s_logits)
    for name, dense in want.items():
        got = per_token_loss(LossSpec.single(name), s_wide, labels, aligned)
        torch.testing.assert_close(got, dense, atol=1e-4, rtol=1e-4)  # float32 renormalising
    acc_sparse, top1_sparse = eval_token_stats(s_wide, aligned, 1.0)
    acc_dense, top1_dense = eval_token_stats(s_logits, t_logits[:, :vocab], 1.0)
    torch.testing.assert_close(acc_sparse, acc_dense, atol=1e-4, rtol=1e-4)
    assert torch.equal(top1_sparse, top1_dense)

    # Gradients stay finite, and rows inside the tokenizer pass through untouched.
    s = s_logits.clone().requires_grad_(True)
    s_w, t_a = fit_sparse_to_vocab(s, cached, vocab)
    per_token_loss(LossSpec.single("rkl"), s_w, labels, t_a).sum().backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()
    inside = SparseTeacher(order[:, :3].clamp(max=vocab - 1), lp[:, :3], lp[:, 3:].logsumexp(-1))
    same_s, same_t = fit_sparse_to_vocab(s_logits, inside, vocab)
    assert same_s is s_logits and same_t is inside


def test_stop_flag_second_ctrl_c_stops_at_once():
    from distill.train.callbacks import StopFlag

    flag = StopFlag()
    flag.handler(signal.SIGINT, None)
    assert flag.requested and not flag.forced and flag.signal_name == "SIGINT"
    flag.handler(signal.SIGTERM, None)  # a scheduler's repeated SIGTERM just waits for the step boundary
    assert not flag.forced
    with pytest.raises(KeyboardInterrupt):
        flag.handler(signal.SIGINT, None)
    assert flag.forced


def test_checkpoint_save_flushes_the_csv_rows_logged_so_far(tmp_path):
    """CSVLogger writes its rows every 100 steps; a checkpoint flushes them, so a kill -9 right after a save
    loses none of the rows the resumed run will not log again."""
    from pathlib import Path
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger

    from distill.train.callbacks import AtomicCheckpoint, StopFlag

    logger = CSVLogger(str(tmp_path), name="csv")
    for step in (1, 2, 3):
        logger.log_metrics({"train/loss": 1.0 / step}, step=step)
    trainer = SimpleNamespace(
        global_step=3,
        loggers=[logger],
        is_global_zero=True,
        save_checkpoint=lambda path, weights_only=False: Path(path).write_bytes(b"ckpt"),
        strategy=SimpleNamespace(barrier=lambda name: None),
    )
    AtomicCheckpoint(tmp_path / "last.ckpt", every=10, max_steps=10, stop=StopFlag()).save(trainer)
    rows = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 3
