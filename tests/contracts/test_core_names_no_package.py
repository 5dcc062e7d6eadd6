"""asyncrl-core names none of asyncrl's other packages in its code: no import of them (under
`TYPE_CHECKING` neither) and no string holding one of their module names (a `module:attr` target, an
`importlib.import_module` argument). They reach core only through the plugin registry, by entry points
they declare; comments and docstrings may still name them, since they explain where a plugin comes from.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "packages" / "asyncrl-core" / "src" / "asyncrl_core"
OTHERS = sorted(
    path.name
    for path in ROOT.glob("packages/*/src/*")
    if path.is_dir() and (path / "__init__.py").exists() and path.name != "asyncrl_core"
)


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings: a string alone as a statement (a module's,
    class's or function's first statement, or the docstring under an attribute)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def named_packages(source: str) -> list[tuple[int, str]]:
    """`(line, text)` of each import of, and each code string naming, a module of `OTHERS`."""
    pattern = re.compile(rf"\b({'|'.join(OTHERS)})\b")
    tree = ast.parse(source)
    skipped = docstrings(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if pattern.match(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and pattern.match(node.module):
            found.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in skipped
            and pattern.search(node.value)
        ):
            found.append((node.lineno, node.value))
    return found


def test_the_other_packages_are_found() -> None:
    assert {"asyncrl_agents", "asyncrl_engine", "asyncrl_megatron", "asyncrl_sglang"} <= set(OTHERS)


def test_the_guard_sees_imports_and_strings_but_not_docstrings_or_comments() -> None:
    source = '''"""Module docstring naming asyncrl_agents."""
import asyncrl_sglang.client  # a comment naming asyncrl_megatron
TARGET = "asyncrl_agents.loop:MultiTurnAgentLoop"
"""An attribute docstring naming asyncrl_megatron."""
def f():
    """A function docstring naming asyncrl_sglang."""
    return f"asyncrl_megatron.{f.__name__}:x"
'''
    assert [line for line, _ in named_packages(source)] == [2, 3, 7]


def test_core_names_no_other_package() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in sorted(CORE.rglob("*.py"))
        for line, text in named_packages(path.read_text())
    ]
    assert not offenders, "asyncrl-core names another package; load it through `asyncrl_core.plugins`:\n" + (
        "\n".join(offenders)
    )
