"""Regenerate the README's config reference from the schema (`make docs`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from distill.config import docs_markdown

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def main() -> int:
    readme = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    text = readme.read_text()
    block = f"{START}\n{docs_markdown()}{END}"
    new, n = re.subn(re.escape(START) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    if n == 0:
        new = text.rstrip() + "\n\n## Config reference\n\n" + block + "\n"
    readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
