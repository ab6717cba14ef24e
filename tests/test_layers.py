"""House rules that keep the layers apart, checked on the syntax tree (so an import inside a function
or under ``TYPE_CHECKING`` counts too):

- core/ never imports Qt; app/ never imports llama_cpp or ctypes;
- product code (core/ outside core/diagnostics, app/) never imports core/diagnostics: what the
  harness needs comes through core/observe.py;
- no installed module (core/, app/, timeshare/) imports the lab (scripts/lab: probes and the
  experiments that did not pay), by name or by path;
- core/ has no import cycles between its modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: source folder -> installed package (pyproject's package-dir)
PACKAGES = {"core": "timeshare.core", "app": "timeshare.app", "timeshare": "timeshare"}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of the absolute imports of a file (``import x.y``, ``from x import``,
    ``importlib.import_module("x")``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value.split(".")[0])
    return names


def offenders(folder: str, forbidden: set[str]) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        hits = imported_modules(path) & forbidden
        if hits:
            bad.append(f"{path.relative_to(ROOT)} imports {', '.join(sorted(hits))}")
    return bad


QT = {"PySide6", "PyQt5", "PyQt6", "shiboken6", "PySide2"}


def test_core_never_imports_qt() -> None:
    assert offenders("core", QT) == []


def test_app_never_imports_llama_cpp_or_ctypes() -> None:
    assert offenders("app", {"llama_cpp", "ctypes"}) == []


@pytest.mark.parametrize(
    ("source", "forbidden", "expected"),
    [
        ("from PySide6.QtCore import QObject\n", QT, {"PySide6"}),
        ("def f():\n    import llama_cpp\n", {"llama_cpp"}, {"llama_cpp"}),
        ("import importlib\nimportlib.import_module('ctypes.util')\n", {"ctypes"}, {"ctypes"}),
        ("from . import ctypes_free\n", {"ctypes"}, set()),
    ],
)
def test_checker_sees_imports(tmp_path: Path, source: str, forbidden: set[str], expected: set[str]) -> None:
    # the checker itself must catch what it is for, or the two tests above prove nothing
    mod = tmp_path / "m.py"
    mod.write_text(source)
    assert imported_modules(mod) & forbidden == expected


# ---- the module graph ------------------------------------------------------------------------


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules(
    root: Path = ROOT, folders: tuple[str, ...] = ("core", "app", "timeshare")
) -> dict[str, Path]:
    return {module_name(p, root): p for folder in folders for p in sorted((root / folder).rglob("*.py"))}


def internal_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The Timeshare modules ``name`` imports, anywhere in the file: ``from .a import b`` is an edge to
    module ``a.b`` when that is a module, else to ``a``; relative imports are resolved."""
    is_package = path.name == "__init__.py"
    package = name.split(".") if is_package else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif target in known:
                    out.add(target)
    out.discard(name)
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    known = set(modules)
    return {name: internal_imports(name, path, known) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


DIAGNOSTICS = "timeshare.core.diagnostics"


def diagnostics_importers(graph: dict[str, set[str]]) -> list[str]:
    """Product modules that import diagnostics (the CLI's dispatch table names commands by string)."""
    return sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        if not name.startswith(DIAGNOSTICS)
        for target in targets
        if target.startswith(DIAGNOSTICS)
    )


def test_product_never_imports_diagnostics() -> None:
    assert diagnostics_importers(import_graph(source_modules())) == []


LAB = ROOT / "scripts" / "lab"


def lab_importers(modules: dict[str, Path], lab: Path = LAB) -> list[str]:
    """Modules that import a lab module: by its name (scripts/lab put on sys.path) or by its path
    (a string naming scripts/lab or one of its files passed to a call, e.g. importlib's
    ``spec_from_file_location``; docstrings that mention a probe are fine)."""
    files = {p.name for p in lab.glob("*.py")}
    names = {p.stem for p in lab.glob("*.py")}
    bad = []
    for name, path in sorted(modules.items()):
        hits = imported_modules(path) & names
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        text = arg.value.replace("\\", "/")
                        if "scripts/lab" in text or text.rsplit("/", 1)[-1] in files:
                            hits.add(arg.value)
        if hits:
            bad.append(f"{name} imports the lab: {', '.join(sorted(hits))}")
    return bad


def test_product_never_imports_the_lab() -> None:
    assert {p.name for p in LAB.glob("*.py")} >= {"copy_penalty_probe.py"}  # the lab was read at all
    assert lab_importers(source_modules()) == []


def test_lab_check_catches_what_it_is_for(tmp_path: Path) -> None:
    lab = tmp_path / "scripts" / "lab"
    lab.mkdir(parents=True)
    (lab / "probe.py").write_text('"""a probe"""\n')
    core = tmp_path / "core"
    core.mkdir()
    (core / "__init__.py").write_text('"""doc"""\n')
    (core / "by_name.py").write_text("def f():\n    import probe\n")
    (core / "by_path.py").write_text(
        "import importlib.util\nspec = importlib.util.spec_from_file_location('p', 'scripts/lab/probe.py')\n"
    )
    (core / "mentions.py").write_text('"""measured by scripts/lab/probe.py"""\n')
    found = lab_importers(source_modules(tmp_path, ("core",)), lab)
    assert found == [
        "timeshare.core.by_name imports the lab: probe",
        "timeshare.core.by_path imports the lab: scripts/lab/probe.py",
    ]


def test_core_has_no_import_cycles() -> None:
    graph = import_graph(source_modules(folders=("core",)))
    assert len(graph) > 30  # the graph was read at all
    assert cycles(graph) == []


def test_graph_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    # a late import (inside a function) closing a cycle, a TYPE_CHECKING import, and a product
    # module importing diagnostics: each must be seen, or the tests above prove nothing
    core = tmp_path / "core"
    (core / "diagnostics").mkdir(parents=True)
    (core / "config").mkdir()
    for init in (core, core / "diagnostics", core / "config"):
        (init / "__init__.py").write_text('"""doc"""\n')
    (core / "config" / "files.py").write_text("def f():\n    from . import demo\n")
    (core / "config" / "demo.py").write_text("from .files import f\n")
    (core / "state.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .pool import Pool\n"
    )
    (core / "pool.py").write_text("from .state import X\nfrom .diagnostics import bench\n")
    (core / "diagnostics" / "bench.py").write_text("from ..pool import Pool\n")
    graph = import_graph(source_modules(tmp_path, ("core",)))
    assert graph["timeshare.core.config.files"] == {"timeshare.core.config.demo"}
    assert sorted(map(tuple, cycles(graph))) == [
        ("timeshare.core.config.demo", "timeshare.core.config.files"),
        ("timeshare.core.diagnostics.bench", "timeshare.core.pool", "timeshare.core.state"),
    ]
    assert diagnostics_importers(graph) == ["timeshare.core.pool imports timeshare.core.diagnostics.bench"]


# ---- composition over class towers; private names stay home ------------------------------------


def resolved_imports(name: str, path: Path, known: set[str]) -> list[tuple[str, str]]:
    """(module, imported name) for every ``from X import n`` of a Timeshare module X (relative
    imports resolved); a name that is itself a module is ``(X.n, "")``."""
    is_package = path.name == "__init__.py"
    package = name.split(".") if is_package else name.split(".")[:-1]
    out: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target not in known and not target.startswith("timeshare"):
            continue
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            out.append((sub, "") if sub in known else (target, alias.name))
    return out


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_imports(modules: dict[str, Path]) -> list[str]:
    """Imports of another module's ``_private`` name, or of a ``_private`` module from outside its
    own package (``residency/_ggml`` is for residency/ only)."""
    known = set(modules)
    bad = []
    for name, path in modules.items():
        for module, imported in resolved_imports(name, path, known):
            if imported and _private(imported) and module != name:
                bad.append(f"{name} imports {module}.{imported}")
            parts = module.split(".")
            for i, part in enumerate(parts):
                package = ".".join(parts[:i])
                if _private(part) and not (name == package or name.startswith(package + ".")):
                    bad.append(f"{name} imports {module}, private to {package}")
                    break
    return bad


#: bases a class may take from another module: interfaces and plain data, not behaviour
ALLOWED_BASES = {"Protocol", "Exception", "TimeshareError"}


def cross_module_inheritance(modules: dict[str, Path]) -> list[str]:
    """Product classes that inherit from a product class defined in another module (a class spread
    over files); Protocols, exceptions and dataclass bases are allowed."""
    classes: dict[str, tuple[str, ast.ClassDef]] = {}  # "module.Class" -> definition
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in modules.items()}
    for name, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes[f"{name}.{node.name}"] = (name, node)
    known = set(modules)

    def is_allowed(definition: ast.ClassDef) -> bool:
        bases = {getattr(b, "id", getattr(b, "attr", "")) for b in definition.bases}
        dataclass = any(
            getattr(d, "id", getattr(getattr(d, "func", None), "id", "")) == "dataclass"
            for d in definition.decorator_list
        )
        return (
            dataclass
            or bool(bases & ALLOWED_BASES)
            or any(b.endswith(("Error", "Exception", "Protocol")) for b in bases)
        )

    bad = []
    for name, path in modules.items():
        imported = {
            alias: f"{module}.{alias}" for module, alias in resolved_imports(name, path, known) if alias
        }
        for node in trees[name].body:
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                base_name = getattr(base, "id", None)
                full = imported.get(base_name or "")
                if full is None or full not in classes:
                    continue
                _, definition = classes[full]
                if not is_allowed(definition):
                    bad.append(f"{name}.{node.name} inherits {full}")
    return bad


def test_no_private_names_cross_modules() -> None:
    assert private_imports(source_modules()) == []


def test_no_class_inherits_a_product_class_of_another_module() -> None:
    assert cross_module_inheritance(source_modules()) == []


def test_the_composition_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    pkg = tmp_path / "core" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "core" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "_raw.py").write_text("X = 1\n")
    (pkg / "inside.py").write_text("from ._raw import X\n")  # package-private module: fine here
    (pkg / "base.py").write_text(
        "from typing import Protocol\nclass Base:\n    pass\nclass Shape(Protocol):\n    pass\n"
        "def _helper() -> None:\n    pass\n"
    )
    (pkg / "tower.py").write_text(
        "from .base import Base, Shape, _helper\nclass Tower(Base):\n    pass\nclass Fine(Shape):\n    pass\n"
    )
    (tmp_path / "core" / "outside.py").write_text("from .pkg._raw import X\n")
    modules = source_modules(tmp_path, ("core",))
    assert private_imports(modules) == [
        "timeshare.core.outside imports timeshare.core.pkg._raw, private to timeshare.core.pkg",
        "timeshare.core.pkg.tower imports timeshare.core.pkg.base._helper",
    ]
    assert cross_module_inheritance(modules) == [
        "timeshare.core.pkg.tower.Tower inherits timeshare.core.pkg.base.Base"
    ]


# ---- every environment variable is declared once (core/envvars.py) -------------------------------

#: os's names that read or change the environment
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environment_reads(path: Path) -> list[int]:
    """Lines where a file touches the environment through ``os`` (``os.environ``, ``os.getenv``,
    ``from os import environ``...)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ENV_NAMES
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ) or (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(alias.name in ENV_NAMES for alias in node.names)
        ):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_the_registry_reads_the_environment() -> None:
    bad = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "core/envvars.py":
            continue
        bad += [f"{rel}:{line}" for line in environment_reads(path)]
    assert bad == [], "read the environment through core/envvars.py"


def test_the_environment_check_catches_what_it_is_for(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text(
        "import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\n"
        "c = {**os.environ}\nd = os.path.join('a')\n"
    )
    assert environment_reads(mod) == [2, 3, 4, 5]


def test_every_timeshare_variable_is_declared() -> None:
    # a TIMESHARE_* name written in the product is one the registry declares
    import re

    from timeshare.core import envvars

    declared = {var.name for var in envvars.REGISTRY}
    named: set[str] = set()
    for folder in ("core", "app", "timeshare"):
        for path in (ROOT / folder).rglob("*.py"):
            named.update(re.findall(r"\bTIMESHARE_[A-Z0-9_]+\b", path.read_text()))
    assert named - declared == set()
    assert len({var.name for var in envvars.REGISTRY}) == len(envvars.REGISTRY)
    assert all(var.kind in envvars.KINDS and var.help for var in envvars.REGISTRY)


def test_the_command_line_has_no_import_cycles() -> None:
    # timeshare/client.py (online verbs) and manage.py (offline ones) used to import each other;
    # both now reach a running instance through timeshare/connection.py
    graph = import_graph(source_modules(folders=("timeshare",)))
    assert "timeshare.connection" in graph
    assert cycles(graph) == []


# ---- objects are driven through their public members ---------------------------------------------


def private_member_uses(paths: list[Path]) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` or ``cls``: another object's private member."""
    bad = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            bad.append(f"{label}:{node.lineno} {ast.unparse(node)}")
    return bad


def test_the_pool_drives_generations_through_their_public_interface() -> None:
    # the pool thread is a Generation's producer (feed, add_embeddings, finish, fail): it used
    # to call gen._feed, gen._fail and keep its bookkeeping in gen._sent_at and the like
    paths = sorted((ROOT / "core" / "pool").rglob("*.py"))
    assert any(p.name == "supervisor.py" for p in paths)
    assert private_member_uses(paths) == []


def test_the_private_member_check_catches_what_it_is_for(tmp_path: Path) -> None:
    (tmp_path / "pool.py").write_text("def f(gen, self):\n    gen._feed('x')\n    self._ok = 1\n")
    found = private_member_uses([tmp_path / "pool.py"])
    assert [line.split(" ", 1)[1] for line in found] == ["gen._feed"]


# ---- the pool <-> worker wire lies below the rooms it joins ----------------------------------------

#: rooms that talk to a worker only over the wire (core/wire), never through the worker's room
ABOVE_THE_WIRE = (
    "timeshare.core.api",
    "timeshare.core.pool",
    "timeshare.core.conversations",
    "timeshare.app",
)
WORKER = "timeshare.core.worker"
WIRE = "timeshare.core.wire"
#: what the wire itself may import: plain data and its checks
WIRE_IMPORTS = (
    "timeshare.core.errors",
    "timeshare.core.sampling",
    "timeshare.core.state",
    "timeshare.core.config.schema",
)


def wire_offenders(graph: dict[str, set[str]]) -> list[str]:
    """Modules above the wire that import the worker's room, and wire modules that import more than
    plain data (the worker, the pool, llama.cpp's room...)."""
    bad = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if name.startswith(ABOVE_THE_WIRE) and (target == WORKER or target.startswith(WORKER + ".")):
                bad.append(f"{name} imports {target}")
            if name.startswith(WIRE + ".") and not target.startswith((WIRE, *WIRE_IMPORTS)):
                bad.append(f"{name} imports {target}")
    return bad


def test_the_wire_is_below_pool_api_worker_and_conversations() -> None:
    graph = import_graph(source_modules())
    assert f"{WIRE}.protocol" in graph and f"{WIRE}.spec" in graph
    assert any(WIRE + ".protocol" in targets for name, targets in graph.items() if name.startswith(WORKER))
    assert wire_offenders(graph) == []


def test_the_wire_check_catches_what_it_is_for() -> None:
    graph = {
        "timeshare.core.pool.supervisor": {"timeshare.core.worker.protocol", "timeshare.core.wire.protocol"},
        "timeshare.core.wire.protocol": {"timeshare.core.errors", "timeshare.core.worker.engine"},
        "timeshare.core.worker.loop": {"timeshare.core.wire.protocol"},
    }
    assert wire_offenders(graph) == [
        "timeshare.core.pool.supervisor imports timeshare.core.worker.protocol",
        "timeshare.core.wire.protocol imports timeshare.core.worker.engine",
    ]
