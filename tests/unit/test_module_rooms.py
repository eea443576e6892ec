"""Each module sits in its process's room: what a rank runs never imports the controller's
process code, and checkpointing never imports the runtime. Read from the sources (every import
statement, nested ones too), so the check starts no process."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module an import statement of `path` names, at any depth of the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def offenders(package: str, forbidden: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = sorted(m for m in imported_modules(path) if m == forbidden or m.startswith(forbidden + "."))
        found += [f"{path.relative_to(ROOT)} imports {m}" for m in bad]
    return found


@pytest.mark.parametrize(("package", "forbidden"), [
    ("elastic/_worker", "elastic._controller"),     # a rank's code: no controller-process module
    ("checkpointing", "elastic"),                   # the checkpoint library stands alone
])
def test_no_module_imports_across_its_room(package, forbidden):
    assert offenders(package, forbidden) == []


def test_the_check_sees_nested_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from elastic._controller.actor import CheckpointView\n    import elastic.x\n")
    assert {"elastic._controller.actor", "elastic._controller.actor.CheckpointView", "elastic.x"} <= \
        imported_modules(module)
