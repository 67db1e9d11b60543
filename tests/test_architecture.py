"""The import contracts of pyproject.toml ([tool.importlinter]): the layers run one way (tools ->
triton adapters -> routing | algorithms -> engine -> the neutral modules), scheduler_model is a
base package, and no package or module sits in an import circle.  Checked with import-linter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _lint(*args: str) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--no-cache", "--no-logo", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)


def test_import_contracts_hold():
    r = _lint()
    assert r.returncode == 0, f"lint-imports found broken contracts:\n{r.stdout}\n{r.stderr}"
    assert "0 broken" in r.stdout, r.stdout


@pytest.mark.parametrize("contract", ["layers", "scheduler-model-base", "scheduler-model-users", "no-circles"])
def test_each_contract_is_declared_and_checked(contract):
    r = _lint("--contract", contract)
    assert r.returncode == 0, f"{contract}:\n{r.stdout}\n{r.stderr}"
    assert "1 kept, 0 broken" in r.stdout, r.stdout


def test_a_broken_contract_fails(tmp_path):
    """The check is not vacuous: the same contracts on a copy whose engine imports the triton
    adapters (an upward import) and whose scheduler_model imports tokenrouter are reported broken."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(REPO_ROOT / "python_backend_src" / "tokenrouter", src / "tokenrouter",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pt"))
    shutil.copytree(REPO_ROOT / "scheduler_model", src / "scheduler_model",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (src / "tokenrouter" / "engine" / "upward.py").write_text("from ..triton import common  # noqa: F401\n")
    (src / "scheduler_model" / "upward.py").write_text("import tokenrouter.protocol  # noqa: F401\n")
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(src)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "tokenrouter.engine.upward -> tokenrouter.triton.common" in r.stdout, r.stdout
    assert "scheduler_model.upward -> tokenrouter.protocol" in r.stdout, r.stdout
