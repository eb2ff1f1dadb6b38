"""The environment setup built is the locked one: every package of scripts/requirements.lock is
installed at exactly its locked version, and what the code imports is declared."""

from __future__ import annotations

import importlib.metadata as metadata
import re

import tomllib

from omni_testing import ROOT

LOCK = ROOT / "scripts" / "requirements.lock"


def _locked() -> dict[str, str]:
    out = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"{LOCK.name}: {line!r} is not NAME==VERSION"
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def test_every_locked_package_is_installed_at_its_version() -> None:
    wrong = {}
    for name, version in _locked().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            wrong[name] = (version, installed)
    assert not wrong, f"locked vs installed: {wrong}"


def test_declared_dependencies_are_locked() -> None:
    project = tomllib.loads((ROOT / "python" / "pyproject.toml").read_text())["project"]
    locked = _locked()
    missing = []
    for requirement in project["dependencies"]:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0]).lower()
        if name not in locked and name not in ("torch", "sglang"):
            missing.append(name)
    assert not missing, f"declared in pyproject.toml but not in {LOCK.name}: {missing}"
