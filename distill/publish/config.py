"""Schema of the `publish` section."""

from __future__ import annotations

import re
from dataclasses import dataclass

from distill.schema import opt

# Release folder names must be one safe path component (no separators, no hidden names, no pointer names).
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")
RESERVED_TAGS = ("auto", "latest", "LATEST")
_HUB_REPO = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass
class PublishConfig:
    dir: str = opt("releases", "Folder that holds releases: <dir>/<name>/<version>.")
    name: str = opt("${run.name}-draft", "Release name.")
    version: str = opt(
        "auto",
        "`auto` = next integer (1, 2, ...); anything else is used as a tag. An existing tag is refused.",
    )
    license: str = opt(
        "auto",
        "License written into the model card: `auto` = the target's (read from its metadata; built-in "
        "aliases are known), anything else (an SPDX-like id, e.g. apache-2.0) overrides it.",
    )
    tags: list[str] = opt(
        ["speculative-decoding", "draft-model", "distillation", "vllm"],
        "Tags in the model card's front matter.",
    )
    force: bool = opt(
        False, "Publish even when the eval gate fails; `force_reason` is written into the card."
    )
    force_reason: str = opt("", "Why the gate is overridden (required with force=true; shown in the card).")
    verify: str = opt(
        "",
        "Path of an existing release folder: check its SHA256SUMS and exit (0 intact, 1 tampered); "
        "nothing is published.",
    )
    push_to_hub: bool = opt(False, "Also upload the release with huggingface_hub (token from HF_TOKEN).")
    hub_repo: str = opt(
        "", "Hub repository (org/name) for push_to_hub; also used as the model id in the card."
    )
    hub_private: bool = opt(True, "Create the hub repository as private when it does not exist.")

    def problems(self) -> list[str]:
        out = []
        if self.version != "auto" and (not _TAG.match(self.version) or self.version in RESERVED_TAGS):
            out.append(
                f"version: '{self.version}' is not a valid release tag; use `auto` or letters, digits and ._+- "
                f"(not {', '.join(RESERVED_TAGS[1:])})."
            )
        if not _TAG.match(self.name):
            out.append(f"name: '{self.name}' must be one folder name of letters, digits and ._+-.")
        if self.force and not self.force_reason.strip():
            out.append("force_reason: required when publish.force=true (it is written into the model card).")
        if self.push_to_hub and not _HUB_REPO.match(self.hub_repo):
            out.append(f"hub_repo: '{self.hub_repo}' must be org/name when publish.push_to_hub=true.")
        return out
