"""The docs name what the code has, read from the code when the test runs: a field, a column,
a command or a setting added, renamed or removed in the code fails here, naming the doc to
update, until the doc says so. And every relative link of the README and the docs lands on a
file that exists (and on a heading that exists, when it names one)."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARKDOWN = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_ROW_NAME = re.compile(r"^\|\s*`([^`]+)`\s*\|", re.M)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The text without its fenced code blocks (no headings or links in there)."""
    return _FENCE.sub("", text)


def _section(path: Path, heading: str) -> str:
    """The section of `path` whose heading starts with `heading` (e.g. "## Results"): from
    that heading to the next heading of the same or a higher level."""
    text = _text(path)
    level = len(heading) - len(heading.lstrip("#"))
    start = None
    for m in _HEADING.finditer(text):
        here = len(m[1])
        if start is None:
            if m.group(0).startswith(heading):
                start = m.end()
        elif here <= level and not _inside_fence(text, m.start()):
            return text[start:m.start()]
    if start is None:
        pytest.fail(f"{path.relative_to(ROOT)} has no section headed {heading!r}")
    return text[start:]


def _inside_fence(text: str, at: int) -> bool:
    return any(f.start() < at < f.end() for f in _FENCE.finditer(text))


def _tables(section: str) -> list[list[str]]:
    """The names in the first column of each Markdown table of a section (`name` cells only)."""
    tables, current = [], None
    for line in section.splitlines():
        if line.startswith("|"):
            if current is None:
                current = []
                tables.append(current)
            if m := _ROW_NAME.match(line):
                current.append(m[1])
        else:
            current = None
    return tables


def _same_names(doc: str, what: str, in_code, in_doc) -> None:
    in_code, in_doc = list(in_code), list(in_doc)
    missing = [n for n in in_code if n not in in_doc]
    extra = [n for n in in_doc if n not in in_code]
    assert not missing and not extra, (
        f"{doc} is out of date with {what}: "
        + (f"not documented: {missing}" if missing else "")
        + ("; " if missing and extra else "")
        + (f"documented but not in the code: {extra}" if extra else ""))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks, dots, slashes,
    colons, apostrophes ...) dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(_prose(_text(path))):
        base = slug(m[2])
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


# (a) The shard line names every RequestSpec field, and nothing else.

SHARD_LINE = ("docs/contracts.md", "## A normalised request")
_SHARD_KEY = re.compile(r'(?:^[ \t]+|,[ \t]*)"(\w+)":', re.M)


def test_the_shard_line_names_every_request_spec_field():
    from jobs.input.request_spec import RequestSpec
    section = _section(ROOT / SHARD_LINE[0], SHARD_LINE[1])
    fields = [f.name for f in dataclasses.fields(RequestSpec)]
    _same_names(f"{SHARD_LINE[0]}, {SHARD_LINE[1]!r}", "jobs.input.request_spec.RequestSpec's fields",
                fields, _SHARD_KEY.findall(section))


# (b) Every Parquet column, and every column of stats.parquet, has its row.

RESULTS = DOCS / "results-and-ledger.md"


def test_every_result_column_is_documented():
    from jobs.results.parquet_files import RESULT_SCHEMA
    tables = _tables(_section(RESULTS, "## Results: one Parquet row per answer"))
    assert tables, "docs/results-and-ledger.md: the results section has no table of columns"
    _same_names("docs/results-and-ledger.md's table of result columns", "jobs.results.parquet_files.RESULT_SCHEMA",
                RESULT_SCHEMA.names, tables[0])


def test_every_stats_column_is_documented():
    from jobs.results.job_stats import STATS_SCHEMA
    tables = _tables(_section(RESULTS, "### `stats.parquet`"))
    _same_names("docs/results-and-ledger.md's table of stats.parquet", "jobs.results.job_stats.STATS_SCHEMA",
                STATS_SCHEMA.names, tables[0])


# (c) Every ledger table has its section, and its table every column.

def _ledger_tables():
    from jobs.ledger.models import Base
    return Base.metadata.sorted_tables


def test_every_ledger_table_and_column_is_documented():
    problems = []
    text = _text(RESULTS)
    for table in _ledger_tables():
        heading = f"### `{table.name}`"
        if heading not in text:
            problems.append(f"table {table.name} has no section {heading!r}")
            continue
        documented = _tables(_section(RESULTS, heading))
        columns = [c.name for c in table.columns]
        missing = [c for c in columns if not documented or c not in documented[0]]
        extra = [c for c in (documented[0] if documented else []) if c not in columns]
        if missing or extra:
            problems.append(f"{table.name}: not documented {missing}, documented but not in the code {extra}")
    assert not problems, "docs/results-and-ledger.md is out of date with jobs/ledger/models.py: " + "; ".join(problems)


# (d) Every relative link lands on a file, and on a heading of it when it names one.

def _links():
    for path in MARKDOWN:
        for m in _LINK.finditer(_prose(_text(path))):
            target = m[1]
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto: are not ours to check
                yield path, target


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_and_headings_that_exist(path):
    broken = []
    for source, target in _links():
        if source != path:
            continue
        file, _, fragment = target.partition("#")
        dest = (source.parent / file).resolve() if file else source
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.relative_to(ROOT)})")
    assert not broken, f"{path.relative_to(ROOT)} has broken links: " + "; ".join(broken)


def test_the_docs_pages_are_linked_from_the_readme():
    readme = _text(ROOT / "README.md")
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if f"](docs/{p.name}" not in readme]
    assert not unlinked, f"README.md links no docs page of its own for: {unlinked}"


# (e) Every `pipeline` command is in docs/running.md or the README.

def _commands():
    import click

    from cli import main
    for name, command in main.commands.items():
        if isinstance(command, click.Group):
            yield from (f"{name} {sub}" for sub in command.commands)
        else:
            yield name


def test_every_cli_command_is_documented():
    text = _text(DOCS / "running.md") + _text(ROOT / "README.md")
    missing = [c for c in _commands() if not re.search(rf"\bpipeline {re.escape(c)}\b", text)]
    assert not missing, "docs/running.md (its Commands table) or README.md does not name: " + \
        ", ".join(f"pipeline {c}" for c in missing)


# The input fields' tables list exactly what the checks take (docs/input-format.md says so).

INPUT = DOCS / "input-format.md"


def test_our_format_tables_list_the_fields_the_checks_take():
    from jobs.input import embedding_checks, line_checks
    generation, embedding = _tables(_section(INPUT, "## Our format"))[:2]
    _same_names("docs/input-format.md's table of our format's fields", "jobs.input.line_checks._PIPELINE_KEYS",
                sorted(line_checks._PIPELINE_KEYS), generation)
    _same_names("docs/input-format.md's table of an embedding line's fields",
                "jobs.input.embedding_checks.PIPELINE_EMBEDDING_KEYS",
                sorted(embedding_checks.PIPELINE_EMBEDDING_KEYS), embedding)


def test_the_sampling_table_has_every_setting_and_its_default():
    from jobs.input.field_checks import SAMPLING_CHECKS, SAMPLING_DEFAULTS
    section = _section(INPUT, "## Sampling settings")
    _same_names("docs/input-format.md's table of sampling settings", "jobs.input.field_checks.SAMPLING_CHECKS",
                list(SAMPLING_CHECKS), _tables(section)[0])
    defaults = dict(re.findall(r"^\|\s*`(\w+)`\s*\|\s*`([^`]*)`\s*\|", section, re.M))
    wrong = {name: (defaults.get(name), json.dumps(value)) for name, value in SAMPLING_DEFAULTS.items()
             if name in defaults and json.loads(defaults[name]) != value}
    assert not wrong, f"docs/input-format.md's sampling defaults differ from the code's (doc, code): {wrong}"


def test_the_embedding_body_table_lists_the_fields_the_checks_take():
    from jobs.input.embedding_checks import OPENAI_EMBEDDING_KEYS
    _same_names("docs/input-format.md's table of /v1/embeddings body fields",
                "jobs.input.embedding_checks.OPENAI_EMBEDDING_KEYS",
                sorted(OPENAI_EMBEDDING_KEYS), _tables(_section(INPUT, "## Embeddings"))[0])


def test_the_limits_table_has_every_limit_and_its_default():
    from jobs.input.validation import Limits
    section = _section(INPUT, "## How a file is checked")
    limits = dataclasses.fields(Limits)
    _same_names("docs/input-format.md's table of a file's limits", "jobs.input.validation.Limits",
                [f.name for f in limits], _tables(section)[0])
    defaults = dict(re.findall(r"^\|\s*`(\w+)`\s*\|\s*`([^`]*)`", section, re.M))
    wrong = {f.name: (defaults.get(f.name), json.dumps(f.default)) for f in limits
             if f.name in defaults and json.loads(defaults[f.name]) != f.default}
    assert not wrong, f"docs/input-format.md's limits differ from the code's (doc, code): {wrong}"


# Every PIPELINE_* variable the code reads is in docs/running.md's settings table.

def test_every_setting_is_in_the_settings_table():
    read = set()
    for package in ("cli", "api", "workers", "jobs", "pipeline"):
        for path in (ROOT / package).rglob("*.py"):
            read |= set(re.findall(r"[\"'](PIPELINE_[A-Z0-9_]+)[\"']", _text(path)))
    documented = _tables(_section(DOCS / "running.md", "## Settings"))[0]
    _same_names("docs/running.md's settings table", "the PIPELINE_* variables the code reads",
                sorted(read), documented)


# Every file and module the docs name in backticks is where they say (no path from before a move).

_PACKAGES = ("cli", "api", "workers", "jobs", "pipeline", "migrations")
_PATH = re.compile(rf"`((?:{'|'.join(_PACKAGES)}|benchmarks|tests|monitoring|examples|docs)/[^`\s]*)")
_DOTTED = re.compile(rf"`((?:{'|'.join(_PACKAGES)})(?:\.\w+)+)`")


def _module_and_rest(dotted: str) -> tuple[Path | None, list[str]]:
    """The source file of the longest module prefix of a dotted name, and the names after it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        for source in (base.with_suffix(".py"), base / "__init__.py"):
            if source.is_file():
                return source, parts[i:]
    return None, parts


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_files_and_modules_named_exist(path):
    text = _text(path)
    missing = [p for p in _PATH.findall(text) if not (ROOT / p).exists()]
    for dotted in _DOTTED.findall(text):
        source, rest = _module_and_rest(dotted)
        if source is None:
            missing.append(dotted)
        elif rest and not re.search(rf"\b{re.escape(rest[0])}\b", _text(source)):
            missing.append(f"{dotted} ({rest[0]} is not in {source.relative_to(ROOT)})")
    assert not missing, f"{path.relative_to(ROOT)} names what is not there (moved or renamed?): {missing}"
