"""Eval preflight helpers on their own: draft weight files, safetensors headers, vocabulary sizes, and the
eval section's own config checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from distill.errors import ConfigError, InputError
from distill.evaluate import draftcheck
from distill.models.resolve import WEIGHTS_INDEX

KEY = "eval.drafts[0].model"


def _files(folder: Path) -> list[Path]:
    return draftcheck.weight_files(folder, key=KEY, name="d")


def test_weight_files_needs_safetensors(tmp_path):
    with pytest.raises(InputError, match=r"eval\.drafts\[0\]\.model: draft 'd' folder .* holds no weights"):
        _files(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")  # never loaded: not a substitute
    with pytest.raises(InputError, match="pickled weights"):
        _files(tmp_path)


def test_weight_files_checks_the_shards_an_index_names(tmp_path, tiny_target_dir):
    shutil.copy(tiny_target_dir / "model.safetensors", tmp_path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / WEIGHTS_INDEX).write_text(json.dumps(index))
    with pytest.raises(InputError, match=r"lacks the weight shards \['model-00002-of-00002.safetensors'\]"):
        _files(tmp_path)
    (tmp_path / WEIGHTS_INDEX).write_text("{not json")
    with pytest.raises(InputError, match="unreadable"):
        _files(tmp_path)


def test_vocab_rows_reads_headers_and_rejects_truncation(tmp_path, tiny_target_dir):
    rows = draftcheck.vocab_rows(_files(tiny_target_dir), key=KEY, name="d")
    assert rows == {"model.embed_tokens.weight": 512, "lm_head.weight": 512}
    cut = tmp_path / "model.safetensors"
    data = (tiny_target_dir / "model.safetensors").read_bytes()
    for size in (len(data) - 1, 100, 3):  # missing tail, cut inside the header, not even a header length
        cut.write_bytes(data[:size])
        with pytest.raises(InputError, match="truncated or corrupt"):
            draftcheck.vocab_rows([cut], key=KEY, name="d")


def _config(vocab: int) -> SimpleNamespace:
    return SimpleNamespace(vocab_size=vocab)


def test_check_vocab_rows():
    ok = {"model.embed_tokens.weight": 512, "lm_head.weight": 512}
    draftcheck.check_vocab_rows(_config(512), _config(512), ok, 512, key=KEY, name="d", target="t")
    with pytest.raises(InputError, match=r"640 rows .* target \(t\) has 512.*resize_token_embeddings\(512\)"):
        draftcheck.check_vocab_rows(_config(640), _config(512), {}, 512, key=KEY, name="d", target="t")
    with pytest.raises(InputError, match=r"vocab_size 512 .* \{'lm_head.weight': 640\}.*inconsistent"):
        draftcheck.check_vocab_rows(
            _config(512), _config(512), {**ok, "lm_head.weight": 640}, 512, key=KEY, name="d", target="t"
        )
    # target and draft agree but both have fewer rows than the shared tokenizer
    with pytest.raises(InputError, match="500 rows but its tokenizer has 512"):
        draftcheck.check_vocab_rows(_config(500), _config(500), {}, 512, key=KEY, name="d", target="t")


def test_empty_temperatures_is_rejected_with_its_key():
    from distill.config import load_config

    with pytest.raises(ConfigError, match=r"eval\.temperatures: \[\] measures nothing"):
        load_config(None, ["eval.temperatures=[]"])
    assert load_config(None, ["eval.temperatures=[0.0, 0.7]"]).eval.temperatures == [0.0, 0.7]
