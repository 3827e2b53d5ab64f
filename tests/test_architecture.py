"""The package contract: every product package imports only `vllm_guard.core` (and itself);
the core imports none of them; only the CLI composition root imports them all. Checked on the
source (every import statement, top level or inside a function), so a lazy import cannot
hide a dependency. Also: the watchdog and the core never import vLLM or torch, and
`vllm-guard --help` / `--version` do not pull heavy modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "cli", "runtime", "patches", "watchdog", "loadgen", "report", "systemd")
HEAVY = ("vllm", "torch")


def _imports(pkg: str) -> list[tuple[str, int, str]]:
    """(file, line, imported module) for every import in a package, relative ones resolved."""
    out = []
    for f in sorted((ROOT / pkg).rglob("*.py")):
        tree = ast.parse(f.read_text(), str(f))
        rel = f.relative_to(ROOT / pkg).with_suffix("")
        here = ["vllm_guard", pkg, *rel.parts[:-1]]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out += [(str(f.relative_to(ROOT)), node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                out.append((str(f.relative_to(ROOT)), node.lineno, mod))
    return out


def _sibling(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "vllm_guard" else None


@pytest.mark.parametrize("pkg", [p for p in PACKAGES if p != "cli"])
def test_a_package_imports_only_the_core_and_itself(pkg: str) -> None:
    allowed = {pkg} if pkg == "core" else {pkg, "core"}
    bad = [f"{f}:{n} imports {m}" for f, n, m in _imports(pkg)
           if (s := _sibling(m)) is not None and s not in allowed]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("pkg", ["core", "watchdog", "report", "loadgen", "systemd", "cli"])
def test_light_packages_never_import_vllm_or_torch(pkg: str) -> None:
    bad = [f"{f}:{n} imports {m}" for f, n, m in _imports(pkg) if m.split(".")[0] in HEAVY]
    assert not bad, "\n".join(bad)


def test_every_package_folder_is_declared_and_checked() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    for pkg in PACKAGES:
        assert f'"vllm_guard.{pkg}" = "{pkg}"' in text, pkg


def test_help_and_version_are_fast_and_import_nothing_heavy() -> None:
    code = ("import sys, io, contextlib\n"
            "from vllm_guard.cli import main\n"
            "for argv in (['--help'], ['--version'], ['serve', '--help'], ['report', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n"
            "            main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "heavy = sorted(m for m in ('vllm', 'torch', 'numpy', 'scipy', 'matplotlib', 'aiohttp', 'pydantic', 'psutil')\n"
            "               if m in sys.modules)\n"
            "print(','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"--help imported: {out.stdout.strip()}"


def test_version_flag_prints_the_version() -> None:
    from vllm_guard.core import __version__

    out = subprocess.run([sys.executable, "-m", "vllm_guard.cli", "--version"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0
    assert out.stdout.strip() == f"vllm-guard {__version__}"


# -- no import cycle inside any package ---------------------------------------------------------
def _module(pkg: str, f: Path) -> str:
    parts = [p for p in f.relative_to(ROOT / pkg).with_suffix("").parts if p != "__init__"]
    return ".".join(["vllm_guard", pkg, *parts])


def import_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports (every import statement: top level, inside a
    function, under TYPE_CHECKING). `from pkg import mod` is an edge to the submodule."""
    files = {_module(pkg, f): f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for me, f in files.items():
        here = me.split(".") if f.name == "__init__.py" else me.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files}
                deps |= subs if len(subs) == len(node.names) else subs | {base}
        graph[me] = {d for d in deps if d in files and d != me}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_inside_any_package() -> None:
    assert not cycles(import_graph())


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# -- the replica's machine decides; nobody else branches on its state ------------------------------
DECIDERS = {"runtime/replica/decide.py", "runtime/replica/machine.py", "runtime/replica/strategy.py"}
MACHINE_ENUMS = {"State", "S", "Strategy"}  # the replica's own states (not the coarse RuntimeState), strategies


def _branches_on_machine(node: ast.AST) -> bool:
    """A comparison that looks at a replica state or a recycle strategy."""
    if not isinstance(node, ast.Compare):
        return False
    for side in (node.left, *node.comparators):
        for sub in ast.walk(side):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in MACHINE_ENUMS:
                return True
            if isinstance(sub, ast.Attribute) and sub.attr in ("strategy", "recycle_strategy"):
                return True
    return False


def test_only_decide_branches_on_a_replicas_state_or_strategy() -> None:
    bad = []
    for f in sorted((ROOT / "runtime").rglob("*.py")):
        rel = str(f.relative_to(ROOT))
        if rel in DECIDERS:
            continue
        for node in ast.walk(ast.parse(f.read_text(), rel)):
            if _branches_on_machine(node) or isinstance(node, ast.Match):
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert not bad, "\n".join(bad)


def test_the_branch_check_sees_one() -> None:
    assert _branches_on_machine(ast.parse("rep.state is State.SERVING", mode="eval").body)
    assert _branches_on_machine(ast.parse("rec.strategy == 'gated'", mode="eval").body)
    assert not _branches_on_machine(ast.parse("st.state is RuntimeState.SERVING", mode="eval").body)


# -- nobody assigns to what is not theirs ---------------------------------------------------------
def foreign_assignments(root: Path) -> list[str]:
    """Attribute assignments (=, +=, annotated) inside functions whose object is neither `self`
    (or something reached through it) nor a local variable: a function must not change an
    object it was handed (a supervisor, a replica, a generation) by assigning to it."""
    bad = []
    for f in sorted(root.rglob("*.py")):
        for fn in ast.walk(ast.parse(f.read_text(), str(f))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = fn.args
            params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
                                      *([a.kwarg] if a.kwarg else []))} - {"self"}
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    for tt in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if not isinstance(tt, ast.Attribute):
                            continue
                        base = tt.value
                        while isinstance(base, ast.Attribute):
                            base = base.value
                        if not isinstance(base, ast.Name) or base.id in params:
                            bad.append(f"{f.relative_to(ROOT)}:{tt.lineno}: {ast.unparse(tt)}")
    return bad


# the one exception, and why: aiohttp's own bookkeeping of a response it did not write
FOREIGN_OK = {"request.writer.output_size"}  # the proxy answers `Expect: 100-continue` itself


def test_nobody_in_the_runtime_assigns_to_an_object_it_was_handed() -> None:
    bad = [b for b in foreign_assignments(ROOT / "runtime") if b.split(": ", 1)[1] not in FOREIGN_OK]
    assert not bad, "\n".join(bad)


def test_the_assignment_check_sees_one(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("def f(sup, x):\n    sup.gen.next = x\n    y = x\n    y.z = 1\n"
                                   "class C:\n    def g(self, rep):\n        self.a.b = rep\n        rep.n += 1\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        found = foreign_assignments(tmp_path)
    finally:
        ROOT = old
    assert [b.split(": ", 1)[1] for b in found] == ["sup.gen.next", "rep.n"]
