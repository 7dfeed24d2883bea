"""The package version, and the git commit of the checkout it was loaded from; importable
without the rest of adaattn."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

__version__ = "0.1.0"

def git_commit() -> str | None:
    """HEAD of the checkout this package was loaded from, or None outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        # safe.directory: a copied checkout owned by another user is still ours to read.
        res = subprocess.run(
            ["git", "-c", "safe.directory=*", "rev-parse", "HEAD"], cwd=here,
            capture_output=True, text=True, timeout=10,
        )
        sha = res.stdout.strip()
        if res.returncode == 0 and _SHA.fullmatch(sha):
            return sha
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return _read_head(here)
    except (OSError, ValueError):
        return None


_SHA = re.compile(r"[0-9a-f]{40}")


def _read_head(start: Path) -> str | None:
    """HEAD read from the .git files themselves, for machines without a usable git."""
    for folder in (start, *start.parents):
        gitdir = folder / ".git"
        if gitdir.is_file():  # a worktree: "gitdir: <path>"
            text = gitdir.read_text().strip()
            if not text.startswith("gitdir:"):
                return None
            gitdir = (folder / text[len("gitdir:"):].strip()).resolve()
        if gitdir.is_dir():
            break
    else:
        return None
    head = (gitdir / "HEAD").read_text().strip()
    if not head.startswith("ref:"):
        return head if _SHA.fullmatch(head) else None
    ref = head[len("ref:"):].strip()
    common = gitdir
    if (gitdir / "commondir").is_file():
        common = (gitdir / (gitdir / "commondir").read_text().strip()).resolve()
    for base in (gitdir, common):
        if (base / ref).is_file():
            sha = (base / ref).read_text().strip()
            return sha if _SHA.fullmatch(sha) else None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref and _SHA.fullmatch(parts[0]):
                return parts[0]
    return None
