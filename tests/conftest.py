"""Shared fixtures: tiny models and tokenizers built in code (never a download), an isolated cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prompt_files import write_prompts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from distill.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved tiny Llama target (4 layers, hidden 128, vocab 512) with the tiny tokenizer."""
    from distill.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_target") / "model", seed=0, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """An unrelated random tiny Llama (2 layers) on the same tokenizer: a poor draft."""
    from distill.models.tiny import save_tiny_model

    return save_tiny_model(
        tmp_path_factory.mktemp("tiny_draft") / "model", seed=123, tokenizer=tiny_tokenizer, num_layers=2
    )


@pytest.fixture()
def tiny_llama():
    """A random 2-layer Llama in memory (vocab 64, hidden 32, tied embeddings), eval mode; fresh per test,
    since tests take gradients through it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture()
def isolated_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DISTILL_CACHE", str(cache))
    return cache


@pytest.fixture()
def prompts_file(tmp_path) -> Path:
    """60 short prompts as jsonl (`prompt` field)."""
    return write_prompts(tmp_path / "prompts.jsonl")


@pytest.fixture()
def tiny_config_overrides(tiny_target_dir, prompts_file, tmp_path) -> list[str]:
    """Overrides that point configs/tiny.yaml at the session's tiny target, a temp run dir and prompts."""
    return [f"target.model={tiny_target_dir}", f"run.dir={tmp_path / 'run'}", f"data.source={prompts_file}"]
