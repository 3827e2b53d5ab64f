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


# -- the replica's machine decides; nobody else decides again ------------------------------------
DECIDERS = {"runtime/replica/decide.py", "runtime/replica/orders.py", "runtime/replica/steps.py",
            "runtime/replica/machine.py", "runtime/replica/strategy.py"}
MACHINE_ENUMS = {"State", "S", "Strategy"}  # the replica's own states (not the coarse RuntimeState), strategies
MAPPINGS = {"dict", "Dict", "Mapping", "MutableMapping", "defaultdict", "OrderedDict"}
# What `decide` keeps between two looks and nobody else reads: a recycle under way, one wanted,
# why it waits, how the current generation ends, the last death, the backoff's count.
MACHINE_DECISIONS = {"recycle", "wanted", "deferred", "end_reason", "last_death", "consecutive"}
SLOTS = {"current", "successor"}  # the driver's slots: which are filled is the state, said twice
# The carriers of decide's effects on the proxy's admission (a hold's rejections, the count limit).
ADMISSION_CARRIERS = {"runtime/replica/driver.py"}
# machine.py's functions that only present a state (the coarse one, the final one, the aggregate);
# its other functions are rules, applied by `decide` alone.
PRESENTATION = {"aggregate", "coarse", "final"}


def _machine_functions() -> set[str]:
    tree = ast.parse((ROOT / "runtime/replica/machine.py").read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} - PRESENTATION


def _state_values() -> set[str]:
    tree = ast.parse((ROOT / "runtime/replica/machine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "State")
    return {a.value.value for a in cls.body if isinstance(a, ast.Assign) and isinstance(a.value, ast.Constant)}


def _annotations(tree: ast.AST) -> list[ast.expr]:
    out: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            out += [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
                                           *([a.kwarg] if a.kwarg else [])) if x.annotation is not None]
            out += [node.returns] if node.returns is not None else []
        elif isinstance(node, ast.AnnAssign):
            out.append(node.annotation)
    return out


def _keyed_by_state(ann: ast.expr) -> bool:
    """`dict[State, ...]` and its kin, anywhere inside an annotation."""
    for sub in ast.walk(ann):
        if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Tuple) and sub.slice.elts:
            base = sub.value.attr if isinstance(sub.value, ast.Attribute) else getattr(sub.value, "id", "")
            key = sub.slice.elts[0]
            if base in MAPPINGS and isinstance(key, ast.Name) and key.id in MACHINE_ENUMS:
                return True
    return False


def _none_test(node: ast.Compare) -> bool:
    return any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) and any(
        isinstance(c, ast.Constant) and c.value is None for c in (node.left, *node.comparators))


def _reads_machine(node: ast.AST) -> str | None:
    """`<x>.machine.<field>`: the field read, or None."""
    if isinstance(node, ast.Attribute):
        inner = node.value
        if (isinstance(inner, ast.Attribute) and inner.attr == "machine") or \
                (isinstance(inner, ast.Name) and inner.id == "machine"):
            return node.attr
    return None


def _slot(node: ast.AST) -> str | None:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return name if name in SLOTS else None


def _branches_on_machine(node: ast.AST) -> bool:
    """A comparison that looks at a replica state or a recycle strategy (or a state's value)."""
    if not isinstance(node, ast.Compare):
        return False
    sides = (node.left, *node.comparators)
    for side in sides:
        for sub in ast.walk(side):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in MACHINE_ENUMS:
                return True
            if isinstance(sub, ast.Attribute) and sub.attr in ("strategy", "recycle_strategy"):
                return True
    states = _state_values()
    said = [s for s in sides if isinstance(s, ast.Constant) and s.value in states]
    looked = [s for s in sides if isinstance(s, ast.Attribute) and (
        s.attr == "state" or (s.attr == "value" and isinstance(s.value, ast.Attribute) and s.value.attr == "state"))]
    return bool(said and looked)


def second_decisions(rel: str, source: str) -> list[str]:
    """Every place in `source` (the file `rel`) that decides what `decide` decides, in any of
    its forms: a comparison on a replica state or strategy; the state enums named outside an
    annotation (a member, a dict keyed by one, a loop over them); a mapping keyed by State; a
    read of what the machine keeps for `decide` (`machine.recycle is not None`) or a None test
    on any machine field; the state told from which slots are filled; the proxy's admission
    set outside the driver that carries out decide's effects; machine.py's rules applied."""
    if rel in DECIDERS:
        return []
    tree = ast.parse(source, rel)
    anns = _annotations(tree)
    in_ann = {id(sub) for a in anns for sub in ast.walk(a)}
    rules = _machine_functions()
    bad: list[tuple[int, str, str]] = []

    def flag(node: ast.AST, why: str) -> None:
        bad.append((getattr(node, "lineno", 0), why, ast.unparse(node)[:100]))

    for a in anns:
        if _keyed_by_state(a):
            flag(a, "a mapping keyed by State")
    for node in ast.walk(tree):
        if _branches_on_machine(node) or isinstance(node, ast.Match):
            flag(node, "branches on a state or strategy")
        elif isinstance(node, ast.Name) and node.id in MACHINE_ENUMS and id(node) not in in_ann:
            flag(node, "names the machine's states or strategies")
        elif (field := _reads_machine(node)) in MACHINE_DECISIONS:
            flag(node, f"reads the machine's {field}")
        elif isinstance(node, ast.Compare) and _none_test(node) and any(
                _reads_machine(s) for s in (node.left, *node.comparators)):
            flag(node, "tests a machine field for None")
        elif isinstance(node, ast.BoolOp):
            tested = {s for c in node.values if isinstance(c, ast.Compare) and _none_test(c)
                      for s in map(_slot, (c.left, *c.comparators)) if s is not None}
            if tested == SLOTS:
                flag(node, "tells the state from which slots are filled")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in rules:
            flag(node, f"applies machine.{node.func.id}, a rule of decide's")
        if rel not in ADMISSION_CARRIERS and not rel.startswith("runtime/frontdoor/"):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "set_reject":
                flag(node, "sets the proxy's rejection itself")
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "enforce_limit" for t in targets):
                flag(node, "sets the proxy's count limit itself")
    return [f"{rel}:{n}: {why}: {text}" for n, why, text in sorted(set(bad))]


def test_only_decide_decides_what_a_replica_does() -> None:
    bad = []
    for f in sorted((ROOT / "runtime").rglob("*.py")):
        rel = str(f.relative_to(ROOT))
        bad += second_decisions(rel, f.read_text())
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("code, why", [
    ("rep.state is State.SERVING", "branches on a state"),
    ("rec.strategy == 'gated'", "branches on a state or strategy"),
    ("_PAST: dict[State, str] = {}", "a mapping keyed by State"),
    ("_PAST = {State.PAST_GATE: 'past_gate'}", "names the machine's states"),
    ("phase = PHASES.get(State.PAST_GATE)", "names the machine's states"),
    ("names = [s.value for s in State]", "names the machine's states"),
    ("busy = [x.machine.recycle is not None for x in drivers]", "reads the machine's recycle"),
    ("w = d.machine.wanted", "reads the machine's wanted"),
    ("late = d.machine.deadline is None", "tests a machine field for None"),
    ("wants = self.successor is not None and self.successor.gate is not None and self.current is None",
     "tells the state from which slots are filled"),
    ("why = rolling(0, states, busy)", "applies machine.rolling"),
    ("d.state.value == 'past_gate'", "branches on a state"),
    ("async def f(self):\n    await self.proxy.set_reject('held: x')", "sets the proxy's rejection itself"),
    ("def f(self):\n    self.proxy.enforce_limit = False", "sets the proxy's count limit itself"),
])
def test_the_decision_check_sees_every_form(code: str, why: str) -> None:
    found = second_decisions("runtime/somewhere.py", code)
    assert found and why in found[0], found


def test_the_decision_check_lets_readers_read() -> None:
    code = ("st.state is RuntimeState.SERVING\n"
            "def state(self) -> State:\n    return self.machine.state\n"
            "rec = books.recycle_of(d.index)\n"
            "coarse(d.state).value\n"
            "for g in (self.current, self.successor):\n    g is not None\n")
    assert second_decisions("runtime/somewhere.py", code) == []
    assert second_decisions("runtime/replica/driver.py", "def f(self):\n    self.door.enforce_limit = False") == []


def test_the_deciders_and_the_driver_hold_no_assert() -> None:
    """`python -O` drops asserts: a precondition of `decide` is a narrowing that raises
    (`steps.ViewMismatch`) or a type that guarantees it."""
    bad = [f"{rel}:{n.lineno}: {ast.unparse(n)[:80]}" for rel in sorted(DECIDERS | ADMISSION_CARRIERS)
           for n in ast.walk(ast.parse((ROOT / rel).read_text())) if isinstance(n, ast.Assert)]
    assert not bad, "\n".join(bad)


# -- rules named once ------------------------------------------------------------------------------
ONE_HOME = {"RESTARTABLE": "core/protocol.py", "RECYCLABLE": "core/protocol.py"}


def _module_sets(f: Path) -> list[tuple[str, int, set[str]]]:
    """(name, line, names used) of every module-level assignment."""
    out = []
    for node in ast.parse(f.read_text(), str(f)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        value = getattr(node, "value", None)
        for t in targets:
            if isinstance(t, ast.Name) and value is not None:
                used = {f"{s.value.id}.{s.attr}" for s in ast.walk(value)
                        if isinstance(s, ast.Attribute) and isinstance(s.value, ast.Name)}
                out.append((t.id, node.lineno, used))
    return out


def test_each_rule_has_one_home() -> None:
    """supervisord's way: `RESTARTABLE` and `RECYCLABLE` are named once (core/protocol.py, the
    watchdog reads them too), and every set or table of replica states once, beside the states
    (runtime/replica/machine.py); everyone else imports them."""
    bad = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            for name, line, used in _module_sets(f):
                if name in ONE_HOME and rel != ONE_HOME[name]:
                    bad.append(f"{rel}:{line}: {name} is defined in {ONE_HOME[name]}")
                elif rel != "runtime/replica/machine.py" and any(u.split(".")[0] in ("State", "S") for u in used):
                    bad.append(f"{rel}:{line}: {name} lists replica states (their home is runtime/replica/machine.py)")
    assert not bad, "\n".join(bad)


# -- the runtime's floors: dependencies run one way -------------------------------------------------
# Lowest first. A floor imports only the floors below it (and the core); the runtime's top-level
# modules (supervisor, commands, cli, ...) compose them all. The replica never imports the
# records, the status or the servers: what its driver needs of them is a Protocol in replica/ports.
FLOORS = ("child", "frontdoor", "replica", "records", "status", "servers")
FLOOR_EXCEPTIONS = {
    # the state dir's layout has one home, runtime/statedir.py, above the floors
    ("vllm_guard.runtime.child.backend", "vllm_guard.runtime.statedir"),
}


def _floor(mod: str) -> int | None:
    """The floor of a runtime module; len(FLOORS) for the top-level ones; None outside the runtime."""
    parts = mod.split(".")
    if parts[:2] != ["vllm_guard", "runtime"] or len(parts) < 3:
        return None
    return FLOORS.index(parts[2]) if parts[2] in FLOORS else len(FLOORS)


def floor_violations() -> tuple[list[str], set[tuple[str, str]]]:
    bad, used = [], set()
    for me, deps in import_graph().items():
        mine = _floor(me)
        if mine is None:
            continue
        for d in deps:
            theirs = _floor(d)
            if theirs is None or theirs <= mine or d.split(".")[2] == me.split(".")[2]:
                continue
            if (me, d) in FLOOR_EXCEPTIONS:
                used.add((me, d))
            else:
                bad.append(f"{me} imports {d} (a higher floor)")
    return sorted(bad), used


def test_the_runtimes_floors_import_only_downward() -> None:
    bad, _ = floor_violations()
    assert not bad, "\n".join(bad)


def test_every_floor_exception_is_still_needed() -> None:
    _, used = floor_violations()
    assert used == FLOOR_EXCEPTIONS, f"no longer needed: {sorted(FLOOR_EXCEPTIONS - used)}"


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
