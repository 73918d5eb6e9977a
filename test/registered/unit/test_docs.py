"""The documentation keeps up with the code: every LoRA path switch the package reads is described in
docs/lora-kernel-paths.md, and the README's and docs' relative links lead to files of the clone."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_lora_switch_is_documented() -> None:
    read = set()
    for path in (ROOT / "python" / "sglang").rglob("*.py"):
        # A name in quotes of its own: what os.environ is asked for, directly or through a constant.
        read |= set(re.findall(r"""["'](SGLANG_LORA_[A-Z0-9_]+)["']""", path.read_text()))
    assert len(read) >= 12, sorted(read)  # the pattern still finds the switches
    page = (ROOT / "docs" / "lora-kernel-paths.md").read_text()
    missing = sorted(name for name in read if f"`{name}`" not in page)
    assert not missing, f"read by the package but not in docs/lora-kernel-paths.md: {missing}"


def test_relative_links_lead_to_files_of_the_clone() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", doc.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path = (doc.parent / target).resolve()
            if not path.exists() or ROOT not in path.parents:
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken
