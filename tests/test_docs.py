"""The docs' map of the package matches the package.

Every module path README.md and docs/*.md name (``hsdp_runner/...``, ``hsdp_runner.x.y``,
``package/module.py``) exists, and every module under ``hsdp_runner/`` is named where a newcomer
looks for it: in docs/architecture.md's package diagram and table, and in the README's tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hsdp_runner"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
# docs/add_a_model.md walks through adding a family the package does not have.
EXAMPLES = {"models/mamba.py", "hsdp_runner.models.mamba.MambaConfig"}

SLASH_PATH = re.compile(r"(?<![\w./~-])hsdp_runner/[\w/]*(?:\.py)?")
DOTTED_PATH = re.compile(r"(?<![\w./~-])hsdp_runner(?:\.\w+)+")
PACKAGE_PATH = re.compile(rf"(?<![\w./~-])(?:{'|'.join(SUBPACKAGES)})/[\w/]*\.py\b")


def modules() -> list[str]:
    """Every module of the package as a path relative to it ('core/choices.py', 'plan.py'),
    packages' __init__.py left out."""
    return sorted(
        p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
    )


def _package_of(module: str) -> str:
    """'core' for 'core/choices.py'; '' for an entry point at the package's top."""
    return module.split("/")[0] if "/" in module else ""


def _top_level_names(path: Path) -> set[str]:
    """The names a module defines or imports at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _dotted_exists(name: str) -> bool:
    """Whether ``hsdp_runner.a.b[.attr]`` is a module or package of ours, or a name defined at
    the top level of one."""
    parts = name.split(".")[1:]
    for cut in range(len(parts), 0, -1):
        base = PACKAGE.joinpath(*parts[:cut])
        found = [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()]
        if found:
            rest = parts[cut:]
            return not rest or len(rest) == 1 and rest[0] in _top_level_names(found[0])
    return False


def missing_paths(text: str) -> list[str]:
    """The module paths ``text`` names that do not exist in the package."""
    missing = []
    for match in SLASH_PATH.findall(text):
        if not (ROOT / match).exists():
            missing.append(match)
    for match in DOTTED_PATH.findall(text):
        if match not in EXAMPLES and not _dotted_exists(match):
            missing.append(match)
    for match in PACKAGE_PATH.findall(text):
        if match not in EXAMPLES and not (PACKAGE / match).is_file():
            missing.append(match)
    return missing


def test_every_module_path_the_docs_name_exists():
    found = [f"{doc.name}: {p}" for doc in DOCS for p in missing_paths(doc.read_text())]
    assert not found, "the docs name modules the package does not have:\n" + "\n".join(found)


def _code_block_after(text: str, heading: str) -> list[str]:
    """The lines of the first ``` block after the line ``heading``."""
    after = text.split(heading + "\n", 1)[1]
    return after.split("```", 2)[1].splitlines()[1:]


def _names_per_package(lines: list[str], entry_line: re.Pattern) -> dict[str, set[str]]:
    """{package ('' for the entry points): every identifier on its line(s) of a tree}: a line
    opens with the package's name ('core', 'core/', 'entry points', or the entry points' own
    files) and may go on in lines that open with spaces only."""
    names: dict[str, set[str]] = {}
    current = None
    for line in lines:
        head = line.strip().split(" ", 1)[0].rstrip("/")
        if head in SUBPACKAGES:
            current, line = head, line.strip()[len(head) :]
        elif entry_line.match(line.strip()):
            current = ""
        elif not line.strip() or line.strip() in ("^", "hsdp_runner/"):
            current = None if line.strip() == "^" else current
            continue
        elif current is None:
            continue
        names.setdefault(current, set()).update(re.findall(r"\w+", line))
    return names


def _unnamed(names: dict[str, set[str]]) -> list[str]:
    """The modules whose name is not on their package's line of a tree."""
    return [m for m in modules() if Path(m).stem not in names.get(_package_of(m), set())]


def test_the_architecture_diagram_names_every_module():
    lines = _code_block_after(ARCHITECTURE.read_text(), "## The packages, bottom to top")
    names = _names_per_package(lines, re.compile(r"entry points\b"))
    missing = _unnamed(names)
    assert not missing, "docs/architecture.md's diagram leaves out:\n" + "\n".join(missing)


def _table_rows(text: str) -> dict[str, str]:
    """{package ('' for the entry points): its row} of architecture.md's package table."""
    rows = {}
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) < 4:
            continue
        key = cells[1].strip()
        if key.startswith("entry points"):
            rows[""] = cells[2]
        elif key.strip("`").rstrip("/") in SUBPACKAGES:
            rows[key.strip("`").rstrip("/")] = cells[2]
    return rows


def test_the_architecture_table_names_every_module_in_its_package_row():
    rows = _table_rows(ARCHITECTURE.read_text())
    missing = []
    for module in modules():
        package = _package_of(module)
        inside = module.removeprefix(package + "/") if package else module
        named = re.findall(r"`([\w/]+\.py)`", rows.get(package, ""))
        if inside not in named and module not in named:
            missing.append(module)
    assert not missing, "docs/architecture.md's table leaves out:\n" + "\n".join(missing)


def test_the_architecture_table_names_only_files_that_exist():
    wrong = []
    for package, row in _table_rows(ARCHITECTURE.read_text()).items():
        for name in re.findall(r"`([\w/]+\.py)`", row):
            elsewhere = name.split("/")[0] in SUBPACKAGES
            path = PACKAGE / name if elsewhere else PACKAGE / package / name
            if not path.is_file():
                wrong.append(f"{package or 'entry points'}: {name}")
    assert not wrong, "docs/architecture.md's table names files that do not exist:\n" + "\n".join(
        wrong
    )


def test_the_readme_tree_names_every_module():
    lines = _code_block_after((ROOT / "README.md").read_text(), "## How it is built")
    names = _names_per_package(lines, re.compile(r"__main__\.py\b"))
    missing = _unnamed(names)
    assert not missing, "README.md's tree leaves out:\n" + "\n".join(missing)


def test_missing_paths_sees_a_module_that_does_not_exist():
    """The check above can fail: old module names in each of its three forms are caught."""
    text = "`hsdp_runner/distributed/sharding.py`, `hsdp_runner.distributed.comm`, `runtime/interrupt.py`"
    assert missing_paths(text) == [
        "hsdp_runner/distributed/sharding.py",
        "hsdp_runner.distributed.comm",
        "runtime/interrupt.py",
    ]
    assert (
        missing_paths("`hsdp_runner.plan`, `hsdp_runner.parity.main`, ~/.cache/hsdp_runner/x") == []
    )
