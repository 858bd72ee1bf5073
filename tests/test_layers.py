"""The planes' layers contract (pyproject.toml ``[tool.importlinter]``): no import goes up, and no
package or module imports one that imports it back, checked with import-linter."""

import os
import pkgutil
import subprocess
import sys
import tomllib

import mlxcluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]


def test_import_contracts_are_kept():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    out = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_every_package_of_mlxcluster_has_a_layer():
    """A new plane cannot slip past the contract by being left out of it."""
    layers = next(c for c in _config()["contracts"] if c["type"] == "layers")["layers"]
    named = {name.strip() for line in layers for name in line.split("|")}
    ours = {f"mlxcluster.{m.name}" for m in pkgutil.iter_modules(mlxcluster.__path__) if m.name != "__main__"}
    assert ours - named == set()
