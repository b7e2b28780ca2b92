"""What `pip show tileattn` and a package index show: license, authors, classifiers, extras."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def test_project_metadata_is_complete():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "BSD-3-Clause"
    assert all((ROOT / name).is_file() for name in project["license-files"])
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()
    assert project["authors"] and project["keywords"]
    classifiers = project["classifiers"]
    assert "Programming Language :: Python :: 3 :: Only" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers)  # PEP 639: the expression says it
    low = tuple(int(x) for x in project["requires-python"].removeprefix(">=").split("."))
    assert f"Programming Language :: Python :: {low[0]}.{low[1]}" in classifiers
    assert "matplotlib>=3.7" in project["optional-dependencies"]["plot"]  # named by `tileattn trace --plot`
