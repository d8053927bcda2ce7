"""Where a benchmark result came from: the commit (no third-party imports: the HF baseline runs
under a torch-only interpreter too)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """HEAD's hash, with "-dirty" when tracked files differ from it (the result is then not
    reproducible from the commit alone); SLORA_COMMIT where the tree has no .git."""
    if os.environ.get("SLORA_COMMIT"):  # the GPU machine gets a copy of the tree without .git
        return os.environ["SLORA_COMMIT"]
    try:
        head = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, cwd=REPO,
                                       stderr=subprocess.DEVNULL).strip()
        changed = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], text=True,
                                          cwd=REPO, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"
    return head + "-dirty" if changed else head
