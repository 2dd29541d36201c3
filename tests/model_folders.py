"""Copies of a saved (tiny) model folder with one defect each, for the bad-input tests of every stage."""

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
