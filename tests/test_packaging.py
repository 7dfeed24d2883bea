"""What a wheel of adaattn carries: the library, its data files, and not the shipped GPT
checkpoints, which a source checkout keeps finding where they are."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_wheel_of_the_tree_carries_no_checkpoint_and_its_data_files(tmp_path):
    pytest.importorskip("setuptools")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                           "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = glob.glob(str(tmp_path / "adaattn-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.endswith(".pt")] == []
    for data in ("adaattn/priority.json", "adaattn/costs.json", "adaattn/py.typed", "adaattn/models/gpt.py"):
        assert data in names
    assert os.path.getsize(wheel) < 2_000_000


def test_the_source_checkout_finds_the_shipped_weights():
    from adaattn.models import DEFAULT_WEIGHTS, pretrained

    assert DEFAULT_WEIGHTS.is_file() and DEFAULT_WEIGHTS.parent == ROOT / "src" / "adaattn" / "models" / "weights"
    assert pretrained.read()["format"] == pretrained.FORMAT


def test_missing_shipped_weights_say_where_they_are(monkeypatch, tmp_path):
    from adaattn.models import pretrained

    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="source repository"):
        pretrained.read(tmp_path / "gpt_stdlib.pt")
