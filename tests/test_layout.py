"""The README names every module of the package (and only those) and every make target.

The tree is the code block under "## Layout": a line may open a folder (a name
ending in "/", nested by its indentation) and name modules (".py") of the folder
it is in; a line that opens no folder continues the last one; "#" starts a
comment. `__init__.py` files and the generated code (`gen/`) are left out of it.
The package root holds only `__init__.py`, `__main__.py` and folders.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "mlx_worker_svc"
_NAME = re.compile(r"[\w.]+(?:/|\.py)")


def readme_tree(text: str) -> set[str]:
    """The folders and modules the Layout block names, as paths from the repository root."""
    section = text.split("\n## Layout\n", 1)[1]
    block = section.split("```", 2)[1]
    named: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    for raw in block.splitlines()[1:]:
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        tokens = line.split()
        if tokens[0].endswith("/"):
            parent = stack[-1][1] + "/" if stack else ""
            stack.append((indent, parent + tokens[0].rstrip("/")))
            named.add(stack[-1][1] + "/")
            tokens = tokens[1:]
        # Otherwise a continuation: deeper than its folder, which stays on the stack.
        for name in tokens:
            assert _NAME.fullmatch(name), f"not a module name in the Layout: {name!r}"
            named.add(f"{stack[-1][1]}/{name}")
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
    text = (
        "\n## Layout\n```\nmlx_worker_svc/  __main__.py  # the root\n"
        "  core/  domain.py\n         errors.py\n    sub/  a.py\n  cli/  main.py\n```\n"
    )
    assert readme_tree(text) == {
        "mlx_worker_svc/__main__.py",
        "mlx_worker_svc/core/",
        "mlx_worker_svc/core/domain.py",
        "mlx_worker_svc/core/errors.py",
        "mlx_worker_svc/core/sub/",
        "mlx_worker_svc/core/sub/a.py",
        "mlx_worker_svc/cli/",
        "mlx_worker_svc/cli/main.py",
    }


def test_the_package_root_holds_only_init_main_and_folders() -> None:
    root = REPO / PACKAGE
    files = sorted(p.name for p in root.iterdir() if p.is_file())
    assert files == ["__init__.py", "__main__.py"]


def test_the_readme_lists_every_make_target() -> None:
    """The README's "Make targets" table names each target of the Makefile's .PHONY."""
    phony = re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), re.M)
    assert phony is not None
    section = (REPO / "README.md").read_text().split("\n## Make targets\n", 1)[1]
    rows = [row for row in section.split("\n## ", 1)[0].splitlines() if row.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([\w-]+)`", row.split("|")[1])}
    assert set(phony.group(1).split()) <= listed, sorted(set(phony.group(1).split()) - listed)
