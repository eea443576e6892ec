"""The documentation against the code, cheaply: README.md and docs/*.md name only flags that the
main job's parser has, list exactly the fields (and defaults) of every config class and the
arguments of ElasticTrainer, and link only to files and headings that exist."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import pathlib
import re
from unittest import mock

import pytest

import elastic.config
from elastic.trainer import ElasticTrainer

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGURATION = ROOT / "docs" / "configuration.md"
FLAGS_SECTION = "The main job's flags"

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


class _Captured(Exception):
    pass


@pytest.fixture(scope="module")
def pretrain_flags() -> set[str]:
    """Every option string of examples/pretrain.py's parser (taken as it is built, not parsed)."""
    import pretrain
    seen: dict[str, argparse.ArgumentParser] = {}

    def capture(self, *args, **kwargs):
        seen["parser"] = self
        raise _Captured

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), pytest.raises(_Captured):
        pretrain.parse_args([])
    return {s for s in seen["parser"]._option_string_actions if s.startswith("--")}


def _sections(text: str, level: str = "## ") -> dict[str, str]:
    """Heading text -> the body under it, up to the next heading of the same level (fences removed)."""
    body = FENCE.sub("", text)
    parts = re.split(rf"^{re.escape(level)}(.+)$", body, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _table_rows(section: str) -> list[list[str]]:
    """The cells of each table row of a section, header and separator rows left out."""
    rows = []
    for line in section.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("field", "flag", "argument"):
            continue
        rows.append(cells)
    return rows


def _section_named(sections: dict[str, str], name: str) -> str:
    matches = [body for heading, body in sections.items() if heading.split()[0].strip("`") == name
               or heading.startswith(name)]
    assert len(matches) == 1, f"docs/configuration.md needs exactly one '## {name}' section, found {len(matches)}"
    return matches[0]


def test_the_flags_table_lists_exactly_the_main_jobs_flags(pretrain_flags):
    section = _section_named(_sections(CONFIGURATION.read_text()), FLAGS_SECTION)
    documented = {flag for row in _table_rows(section) for flag in FLAG.findall(row[0])}
    assert documented - pretrain_flags == set(), "documented flags that examples/pretrain.py does not have"
    assert pretrain_flags - documented - {"--help"} == set(), \
        "examples/pretrain.py flags missing from docs/configuration.md"


def _command_lines(text: str) -> list[str]:
    """Code (fenced blocks with their `\\` continuations joined, and inline spans) that runs pretrain.py."""
    lines = []
    for block in FENCE.findall(text):
        lines += block.replace("\\\n", " ").splitlines()
    lines += INLINE_CODE.findall(FENCE.sub("", text))
    return [line.split("pretrain.py", 1)[1] for line in lines if "pretrain.py" in line]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_pretrain_command_in_the_docs_uses_real_flags(doc, pretrain_flags):
    unknown = {(flag, line.strip()) for line in _command_lines(doc.read_text())
               for flag in FLAG.findall(line.split("#", 1)[0]) if flag not in pretrain_flags}
    assert not unknown, f"{doc.name}: examples/pretrain.py has no such flag"


def test_configuration_md_names_main_job_flags_only(pretrain_flags):
    named = set(FLAG.findall(CONFIGURATION.read_text()))
    assert named - pretrain_flags == set(), "docs/configuration.md names a flag examples/pretrain.py lacks"


def _config_classes() -> list[type]:
    return [cls for _, cls in inspect.getmembers(elastic.config, inspect.isclass)
            if dataclasses.is_dataclass(cls) and cls.__module__ == elastic.config.__name__]


def _documented_defaults(section: str) -> dict[str, str]:
    return {row[0].strip("`"): row[1] for row in _table_rows(section) if re.fullmatch(r"`\w+`", row[0])}


def _same_default(cell: str, default: object) -> bool:
    """The table's default cell (`required`, or a Python literal in backticks) against the code's."""
    if default is dataclasses.MISSING or default is inspect.Parameter.empty:
        return cell == "required"
    shown = repr(default)
    if shown.startswith("<") and shown.endswith(">"):     # a sentinel, e.g. <min_workers>: the field it copies
        return cell.strip("`") == shown[1:-1]
    try:
        return ast.literal_eval(cell.strip("`")) == default
    except (ValueError, SyntaxError):
        return False


def test_there_is_a_config_class_to_check():
    assert {c.__name__ for c in _config_classes()} >= {"ScalingConfig", "CheckpointConfig", "FailureConfig",
                                                       "LRScalingConfig"}


@pytest.mark.parametrize("cls", _config_classes(), ids=lambda c: c.__name__)
def test_configuration_md_lists_every_field_with_its_default(cls):
    section = _section_named(_sections(CONFIGURATION.read_text()), cls.__name__)
    documented = _documented_defaults(section)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    assert set(documented) - set(fields) == set(), f"docs/configuration.md lists fields {cls.__name__} lacks"
    assert set(fields) - set(documented) == set(), f"{cls.__name__} fields missing from docs/configuration.md"
    for name, f in fields.items():
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert _same_default(documented[name], default), \
            f"{cls.__name__}.{name}: docs say {documented[name]}, the code's default is {default!r}"


def test_configuration_md_lists_every_argument_of_elastic_trainer():
    section = _section_named(_sections(CONFIGURATION.read_text()), "ElasticTrainer")
    documented = _documented_defaults(section)
    params = {name: p for name, p in inspect.signature(ElasticTrainer.__init__).parameters.items() if name != "self"}
    assert set(documented) == set(params)
    for name, p in params.items():
        assert _same_default(documented[name], p.default), f"ElasticTrainer({name}=...): docs say {documented[name]}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(doc: pathlib.Path) -> set[str]:
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", doc.read_text()), flags=re.M):
        slug, n = _slug(heading), 0
        while (f"{slug}-{n}" if n else slug) in anchors:
            n += 1
        anchors.add(f"{slug}-{n}" if n else slug)
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_points_to_something_that_exists(doc):
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"^[a-z]+:", target):          # http(s)://, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            broken.append(f"{target} (no file {resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    assert not broken, f"{doc.name}: broken links"


def test_every_chaos_scenario_is_documented():
    """chaos/README.md's Scenarios section names every scenario of chaos/scenarios.py."""
    from chaos.scenarios import SCENARIOS
    section = _sections((ROOT / "chaos" / "README.md").read_text())["Scenarios (chaos/scenarios.py)"]
    named = set(INLINE_CODE.findall(section))
    assert set(SCENARIOS) <= named, f"undocumented scenarios: {sorted(set(SCENARIOS) - named)}"


def test_every_cli_subcommand_is_documented_in_operations(capsys):
    """docs/operations.md shows every subcommand of the `elastic` command (issue 34), as code
    (`elastic <name> ...`); the subcommands are read from the CLI's own help."""
    from elastic import __main__ as cli
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    usage = capsys.readouterr().out
    commands = set(re.search(r"\{([a-z,]+)\}", usage).group(1).split(","))
    assert {"status", "report", "stop", "export", "ckpt", "chaos"} <= commands
    operations = (ROOT / "docs" / "operations.md").read_text()
    missing = sorted(c for c in commands if f"elastic {c}" not in operations)
    assert not missing, f"elastic subcommands not in docs/operations.md: {missing}"
