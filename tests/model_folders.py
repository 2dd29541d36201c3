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


def eagle_head(
    target: Path,
    dst: Path,
    *,
    num_layers: int = 1,
    drop: tuple[str, ...] = (),
    fc_shape: tuple[int, int] | None = None,
) -> Path:
    """An EAGLE-1 head folder for `target` under vLLM's names (fc.weight, layers.<i>.<...>; no embeddings, head
    or tokenizer: vLLM shares the target's). It starts as the identity on the target's state (fc = [0 | I],
    the target's last layer with its output projections zeroed), so vLLM runs it with sane numbers. `drop`
    leaves tensors out, `fc_shape` makes fc.weight another shape: the defective heads of the preflight tests."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    hidden, last = int(config["hidden_size"]), int(config["num_hidden_layers"]) - 1
    weights = load_file(str(target / "model.safetensors"))
    fc = torch.zeros(fc_shape or (hidden, 2 * hidden))
    if fc_shape is None:
        fc[:, hidden:] = torch.eye(hidden)
    head = {"fc.weight": fc}
    for i in range(num_layers):
        for name, value in weights.items():
            prefix = f"model.layers.{last}."
            if not name.startswith(prefix) or (i == 0 and "input_layernorm" in name):
                continue
            part = name[len(prefix) :]
            zero = part in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
            head[f"layers.{i}.{part}"] = torch.zeros_like(value) if zero else value.clone()
    dst.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in head.items() if k not in drop}, str(dst / "model.safetensors"))
    config.update(num_hidden_layers=num_layers, architectures=["EagleLlamaForCausalLM"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst
