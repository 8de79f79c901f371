"""The README's Layout tree names every module of the package, and only those.

The tree is the code block under "## Layout": one entry a line, nested by two
spaces, a folder ending in "/", a module in ".py", a description after it.
`__init__.py` files and the generated code (`gen/`) are left out of it. The
package root holds only `__init__.py`, `__main__.py` and folders.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "mlx_worker_svc"
_ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[\w./]+(?:/|\.py))(?:\s|$)")


def readme_tree(text: str) -> set[str]:
    """The modules the Layout block names, as paths from the repository root."""
    section = text.split("\n## Layout\n", 1)[1]
    block = section.split("```", 2)[1]
    named: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    for line in block.splitlines()[1:]:
        entry = _ENTRY.match(line)
        if entry is None:
            continue
        indent, name = len(entry["indent"]), entry["name"]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([folder for _, folder in stack] + [name.rstrip("/")])
        if name.endswith("/"):
            stack.append((indent, name.rstrip("/")))
        if path.startswith(PACKAGE + "/") or name.endswith("/"):
            named.add(path if name.endswith(".py") else path + "/")
    return {p for p in named if p.startswith(PACKAGE + "/") and p != PACKAGE + "/"}


def package_tree() -> set[str]:
    """The modules and folders of the package, as the Layout block would name them."""
    found: set[str] = set()
    for path in (REPO / PACKAGE).rglob("*"):
        relative = path.relative_to(REPO).as_posix()
        if "__pycache__" in relative or relative.startswith(f"{PACKAGE}/gen/"):
            continue
        if path.is_dir():
            found.add(relative + "/")
        elif path.suffix == ".py" and path.name != "__init__.py":
            found.add(relative)
    return found


def test_the_readme_layout_names_every_module_and_no_other() -> None:
    named = readme_tree((REPO / "README.md").read_text())
    actual = package_tree()
    assert sorted(named - actual) == [], "the README names modules that do not exist"
    assert sorted(actual - named) == [], "the README's Layout leaves these out"


def test_the_parser_nests_entries_by_their_indentation() -> None:
    text = "\n## Layout\n```\nmlx_worker_svc/\n  core/  shared\n    domain.py  types\n```\n"
    assert readme_tree(text) == {"mlx_worker_svc/core/", "mlx_worker_svc/core/domain.py"}


def test_the_package_root_holds_only_init_main_and_folders() -> None:
    root = REPO / PACKAGE
    files = sorted(p.name for p in root.iterdir() if p.is_file())
    assert files == ["__init__.py", "__main__.py"]
