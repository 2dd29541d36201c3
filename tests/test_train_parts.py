"""Unit tests of train-stage parts: launcher ranks."""

from __future__ import annotations

import pytest

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
