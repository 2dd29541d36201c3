"""Copies of a saved (tiny) model folder with one defect each, for the bad-input tests of every stage; EAGLE heads
and data-stage run folders built in code for the bench tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

Weights = Literal["intact", "missing", "truncated", "pickled"]


def model_copy(src: Path, dst: Path, *, weights: Weights = "intact", remote_code: bool = False) -> Path:
    """`src` copied to `dst`, its safetensors weights `missing`, `truncated` (a copy cut short) or replaced by
    `pickled` ones (older hub folders); `remote_code`: a model type transformers knows only through the folder's
    own code (an auto_map in config.json)."""
    shutil.copytree(src, dst)
    st = dst / "model.safetensors"
    if weights == "truncated":
        data = st.read_bytes()
        st.write_bytes(data[: len(data) // 2])
    elif weights in ("missing", "pickled"):
        st.unlink()
        if weights == "pickled":
            (dst / "pytorch_model.bin").write_bytes(b"pickled weights")
    if remote_code:
        config = json.loads((dst / "config.json").read_text())
        config["model_type"] = "xllama"
        config["auto_map"] = {"AutoConfig": "configuration_x.XConfig"}
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def eagle_head(
    target: Path,
    dst: Path,
    *,
    num_layers: int = 1,
    drop: tuple[str, ...] = (),
    fc_shape: tuple[int, int] | None = None,
) -> Path:
    """An EAGLE-1 head folder for `target` as `bench_eagle` exports it (fc.weight, layers.<i>.<...> under vLLM's
    names; no embeddings, head or tokenizer: vLLM shares the target's). It starts as the identity on the
    target's state (fc = [0 | I], the target's last layer with its output projections zeroed), so vLLM runs it
    with sane numbers. `drop` leaves tensors out, `fc_shape` makes fc.weight another shape: the defective heads
    of the preflight tests."""
    import torch
    from safetensors.torch import load_file, save_file

    from bench.bench_eagle import build_head, save_head
    from distill.models.draft import load_causal_lm

    save_head(build_head(load_causal_lm(target), num_layers, -1), target, dst, "float32")
    if drop or fc_shape:
        weights = load_file(str(dst / "model.safetensors"))
        if fc_shape:
            weights["fc.weight"] = torch.zeros(fc_shape)
        save_file({k: v for k, v in weights.items() if k not in drop}, str(dst / "model.safetensors"))
    return dst


def data_run_dir(root: Path, tokenizer, n_train: int = 48, n_val: int = 8) -> Path:
    """A run folder with a data stage's train/val splits: tiny-tokenizer sentences, the second half scored."""
    from datasets import Dataset

    from distill.models.tiny import synthetic_corpus

    sentences = synthetic_corpus(n_train + n_val, seed=1)
    rows = []
    for text in sentences:
        ids = tokenizer(text)["input_ids"][:40]
        half = len(ids) // 2
        rows.append({"input_ids": ids, "loss_mask": [0] * half + [1] * (len(ids) - half)})
    for split, part in (("train", rows[:n_train]), ("val", rows[n_train:])):
        Dataset.from_list(part).save_to_disk(str(root / "data" / split))
    return root
