"""What `pip install elastic-train` gives a user: the wheel built from this tree carries the
PEP 561 markers, the license and its metadata, the extras, every data file of the packages, and a
base requirement list without the test, benchmark, chaos or plotting dependencies."""
from __future__ import annotations

import email.parser
import importlib.metadata
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("elastic", "checkpointing", "chaos")
EXTRAS = {"plot", "chaos", "tensorboard", "bench", "progress", "data", "mlflow", "wandb", "hf", "test"}
# Only some users need these; none may be a requirement of the base install.
NOT_IN_BASE = {"moto", "matplotlib", "pytest", "pytest-timeout", "pytest-xdist", "tensorboard", "ruff", "mypy",
               "rich", "jsonschema", "mlflow-skinny", "wandb", "transformers", "safetensors"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel of a copy of this tree (the build writes build/ and *.egg-info beside its
    sources; the working tree is left alone)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-q", "-w", str(out), str(src)]
    # The installed setuptools when it can build the project (no download); else pip's isolated build.
    if Version(importlib.metadata.version("setuptools")) >= Version("77"):
        command.insert(4, "--no-build-isolation")
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = out.glob("elastic_train-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def _metadata(wheel: zipfile.ZipFile):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.parser.Parser().parsestr(wheel.read(name).decode())


def _requirements(wheel: zipfile.ZipFile) -> list[Requirement]:
    return [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist") or []]


def test_every_package_is_typed(wheel):
    names = set(wheel.namelist())
    assert {f"{package}/py.typed" for package in PACKAGES} <= names


def test_the_license_file_and_its_metadata(wheel):
    licenses = [n for n in wheel.namelist() if ".dist-info/licenses/" in n]
    assert [n.rsplit("/", 1)[1] for n in licenses] == ["LICENSE"]
    text = wheel.read(licenses[0]).decode()
    assert text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]


def test_the_extras_are_declared(wheel):
    assert set(_metadata(wheel).get_all("Provides-Extra") or []) >= EXTRAS


def test_each_extra_brings_what_it_is_for(wheel):
    def names(extra: str) -> set[str]:
        return {f"{r.name}[{','.join(sorted(r.extras))}]" if r.extras else r.name for r in _requirements(wheel)
                if r.marker is not None and r.marker.evaluate({"extra": extra})}

    assert "matplotlib" in names("plot")
    assert {"moto[server]", "matplotlib"} <= names("chaos")
    assert "tensorboard" in names("tensorboard")
    assert "ray[train]" in names("bench")
    assert {"pytest", "ruff", "mypy"} <= names("test")
    # The suite exercises every other extra (a self-reference that pip resolves).
    assert names("progress") == {"rich"}
    assert "ray[data]" in names("data")
    assert names("mlflow") == {"mlflow-skinny"} and names("wandb") == {"wandb"}
    assert names("hf") == {"transformers", "safetensors"}
    assert "elastic-train[bench,chaos,data,hf,mlflow,plot,progress,tensorboard,wandb]" in names("test")
    assert "jsonschema" in names("test")


def test_the_base_install_needs_no_optional_dependency(wheel):
    base = [r for r in _requirements(wheel) if r.marker is None]
    names = {r.name.lower() for r in base}
    assert {"ray", "torch", "fsspec", "s3fs", "pyarrow", "numpy"} <= names
    assert names & NOT_IN_BASE == set()
    (ray,) = [r for r in base if r.name == "ray"]
    assert "train" not in ray.extras and "default" in ray.extras


def test_every_data_file_of_the_packages_is_shipped(wheel):
    """Files beside the modules (markers, JSON Schemas, ...) reach the wheel only through
    package-data: one added without it would be missing from every install. (A README beside
    the code is for the repository's readers.)"""
    names = set(wheel.namelist())
    data = [str(path.relative_to(ROOT)) for package in PACKAGES for path in (ROOT / package).rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc", ".md") and "__pycache__" not in path.parts]
    assert [name for name in data if name not in names] == []


def test_the_console_script(wheel):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "elastic = elastic.__main__:main" in wheel.read(name).decode()
