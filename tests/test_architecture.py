"""What the import contracts cannot say of the code's shape, checked on its
source: no module of tierd over 300 lines (generated code aside), no class
in tierd/core built on another tierd class (Protocols, exceptions, enums and
plain data aside: components receive their collaborators), and no tier
named in the core or policy (they ask the tiers' roles, tierd/core/roles.py)."""

import ast
from pathlib import Path

from tierd.testing import ROOT

TIERD = ROOT / "tierd"
GENERATED = {TIERD / "v1" / "tierd_pb2.py", TIERD / "v1" / "tierd_pb2_grpc.py"}
TIER_NAMES = {"HOST", "DEVICE", "DISK", "REMOTE"}  # the registered tiers' constants (tierd/tiers/__init__.py)
TIER_WORDS = {"host", "device", "disk", "remote"}  # and their names
ALLOWED_BASES = {"Protocol", "Exception", "Enum", "IntEnum", "NamedTuple", "TierdError"}


def modules(*under: str) -> list[Path]:
    return sorted(p for d in under for p in (TIERD / d).rglob("*.py") if p not in GENERATED)


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_no_module_is_over_300_lines():
    lines = {shown(p): len(p.read_text().splitlines()) for p in modules(".")}
    long = {p: n for p, n in lines.items() if n > 300}
    assert long == {}, "split these modules (at most 300 lines each)"


def _tierd_names(tree: ast.Module) -> set[str]:
    """The names a module imports from tierd."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tierd"):
            names.update(a.asname or a.name for a in node.names)
    return names


def _built_on(path: Path) -> list[str]:
    """Each class of the module built on a tierd class (or on one of its own
    module's classes, a chain kept in one file)."""
    tree = ast.parse(path.read_text())
    tierd = _tierd_names(tree) | {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and not _is_data(node):
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                if name in tierd and name not in ALLOWED_BASES and not name.endswith(("Error", "Protocol")) and \
                        not _is_exception(tree, name):
                    found.append(f"{shown(path)}: {node.name}({name})")
    return found


def _is_data(node: ast.ClassDef) -> bool:
    """Plain data: a dataclass (records built on records hold no behaviour)."""
    return any("dataclass" in ast.unparse(d) for d in node.decorator_list)


def _is_exception(tree: ast.Module, name: str) -> bool:
    """Whether the module's own class `name` is an exception (built on Exception or an error)."""
    return any(isinstance(n, ast.ClassDef) and n.name == name and
               any(getattr(b, "id", "").endswith(("Exception", "Error")) for b in n.bases) for n in ast.walk(tree))


def test_no_class_in_the_core_is_built_on_another_tierd_class():
    found = {f for path in modules("core") for f in _built_on(path)}
    assert found == set(), "hand collaborators in through the constructor instead"


def test_the_checks_find_what_they_look_for(tmp_path):
    """The AST checks are not blind: a module built as the store is, and one
    that names a tier, are found."""
    chained = tmp_path / "chained.py"
    chained.write_text("from tierd.core.store.table import SessionTable\nclass Mine(SessionTable):\n    pass\n"
                       "class Other(Mine):\n    pass\n@dataclass\nclass Data(Mine):\n    x: int\nclass Fine(ValueError):\n    pass\nclass Also(Fine):\n    pass\n")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert _built_on(chained) == ["chained.py: Mine(SessionTable)", "chained.py: Other(Mine)"]
        naming = tmp_path / "naming.py"
        naming.write_text("from tierd.tiers import HOST\nx = 'disk'\ny = HOST\n")
        assert _names_a_tier(naming) == ["naming.py:1", "naming.py:2", "naming.py:3"]
    finally:
        ROOT = root


def _names_a_tier(path: Path) -> list[str]:
    named = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name) and node.id in TIER_NAMES or \
                isinstance(node, ast.ImportFrom) and any(a.name in TIER_NAMES for a in node.names) or \
                isinstance(node, ast.Constant) and node.value in TIER_WORDS:
            named.append(f"{shown(path)}:{node.lineno}")
    return sorted(set(named), key=lambda s: int(s.rpartition(":")[2]))


def test_no_module_of_the_core_or_policy_names_a_tier():
    assert [n for path in modules("core", "policy") for n in _names_a_tier(path)] == []


def test_a_daemon_that_codes_nothing_lossily_loads_no_torch():
    """torch takes seconds to load: the daemon, its CLI and the lossless codec
    start without it (the lossy codecs and the device tier load it when used)."""
    import subprocess
    import sys

    probe = "import sys, tierd.machine, tierd.cli, tierd.codecs; tierd.codecs.get('lossless'); " \
            "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
    probe = "import sys, tierd.codecs; tierd.codecs.get('fp8'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr  # (the probe can tell)
