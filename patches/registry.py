"""The patch registry: what each patch fixes, which vLLM versions, which attributes it touches.

A patch applies only when the installed vLLM is in its version range AND every target has the
expected shape (class, method parameters, instance attributes). Shapes are read from the source
with `ast`, so `patches list` needs no torch and also works on an unpacked tree that cannot be
imported (the GPU build's 0.25.1); in a live process the method signatures are read from the
live classes as well, so a method wrapped by someone else is noticed too.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

ROLES = ("api_server", "engine_core", "worker")


@dataclass(frozen=True)
class Anchor:
    """Where a patch anchors in vLLM: one class (and optionally one method) it relies on; with
    `cls` empty, `method` is a module-level function."""

    module: str
    cls: str
    method: str | None = None
    params: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()  # instance attributes assigned as `self.<name> = ...` in the class
    calls: tuple[str, ...] = ()  # names `method` calls, the first call of each in this order
    # Names whose presence means the upstream fix is in this vLLM: the patch is then not needed.
    absent: tuple[str, ...] = ()

    def describe(self) -> str:
        name = f"{self.module}.{self.cls}" if self.cls else self.module
        if self.method:
            name += f".{self.method}({', '.join(self.params)})"
        if self.attrs:
            name += " [" + ", ".join(self.attrs) + "]"
        if self.calls:
            name += " calls " + " before ".join(self.calls)
        if self.absent:
            name += " [without " + ", ".join(self.absent) + "]"
        return name

    def fixed_reason(self, have: set[str]) -> str | None:
        """The skip reason when the class already has one of the `absent` names, else None."""
        found = [a for a in self.absent if a in have]
        return f"{self.cls} has {', '.join(found)}: this vLLM carries the upstream fix" if found else None


@dataclass(frozen=True)
class PatchDef:
    id: str
    fixes: str
    summary: str
    min_version: str
    max_version: str  # exclusive
    roles: tuple[str, ...]
    targets: tuple[Anchor, ...] = field(default=())


def version_tuple(text: str) -> tuple[int, ...]:
    """'0.32.0+cpu' -> (0, 32, 0); 'dev' -> ()."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def in_range(version: str, lo: str, hi: str) -> bool:
    v = version_tuple(version)
    return bool(v) and version_tuple(lo) <= v < version_tuple(hi)


# --- reading shapes from source -------------------------------------------------------------

def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _mro(classes: dict[str, ast.ClassDef], name: str) -> list[ast.ClassDef]:
    """The class and its bases that are defined in the same module (enough for our targets)."""
    out: list[ast.ClassDef] = []
    todo = [name]
    while todo:
        c = classes.get(todo.pop(0))
        if c is None or c in out:
            continue
        out.append(c)
        todo.extend(b.id for b in c.bases if isinstance(b, ast.Name))
    return out


def _method_params(cls_nodes: list[ast.ClassDef], method: str) -> list[str] | None:
    for c in cls_nodes:
        for n in c.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == method:
                a = n.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                return names[1:] if names and names[0] == "self" else names
    return None


def _method_node(cls_nodes: list[ast.ClassDef], method: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for c in cls_nodes:
        for n in c.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == method:
                return n
    return None


def call_order(fn: ast.AST, where: str, names: tuple[str, ...]) -> str | None:
    """None when `fn` calls each of `names` (a plain or attribute call) and the first call of each
    comes in the order given; else the reason. E.g. EngineCore.__init__ must load the general
    plugins before it builds the executor, or a plugin that waits there would hold the GPU."""
    first: dict[str, tuple[int, int]] = {}
    for n in ast.walk(fn):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name in names:
            pos = (n.lineno, n.col_offset)
            first[name] = min(first.get(name, pos), pos)
    missing = [x for x in names if x not in first]
    if missing:
        return f"{where} does not call {', '.join(missing)}"
    seen = sorted(names, key=lambda x: first[x])
    if seen != list(names):
        return f"{where} calls {' before '.join(seen)} (expected {' before '.join(names)})"
    return None


def _assigned_attrs(cls_nodes: list[ast.ClassDef]) -> set[str]:
    out: set[str] = set()
    for c in cls_nodes:
        for n in ast.walk(c):
            targets: list[ast.expr] = []
            if isinstance(n, ast.Assign):
                targets = list(n.targets)
            elif isinstance(n, (ast.AnnAssign, ast.AugAssign)):
                targets = [n.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.add(t.attr)
        for n in c.body:  # class-level names and properties count too
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.add(n.name)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                out.add(n.target.id)
    return out


@lru_cache(maxsize=64)
def _parse(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(), filename=path)


def module_file(root: Path, module: str) -> Path:
    """`vllm.v1.core.block_pool` under a vllm package dir `root`."""
    parts = module.split(".")[1:]
    f = root.joinpath(*parts).with_suffix(".py")
    return f if f.exists() else root.joinpath(*parts, "__init__.py")


def _function_check(fn: ast.AST | None, t: Anchor, params: list[str] | None) -> str | None:
    """A module-level function target (`cls` empty): it exists, takes `params`, makes `calls`."""
    where = f"{t.module}.{t.method}"
    if fn is None or params is None:
        return f"function {where} not found"
    missing = [p for p in t.params if p not in params]
    if missing:
        return f"{where}({', '.join(params)}) lacks parameter(s) {', '.join(missing)}"
    return call_order(fn, where, t.calls) if t.calls else None


def _module_function(tree: ast.Module, name: str | None) -> ast.FunctionDef | None:
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def static_check(root: Path, t: Anchor) -> str | None:
    """None when the target has the expected shape in the tree at `root`, else the reason."""
    f = module_file(root, t.module)
    if not f.exists():
        return f"module {t.module} not found"
    try:
        tree = _parse(str(f))
    except SyntaxError as e:
        return f"module {t.module} does not parse: {e}"
    if not t.cls:
        fn = _module_function(tree, t.method)
        a = fn.args if fn is not None else None
        return _function_check(fn, t, None if a is None else [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)])
    classes = _classes(tree)
    nodes = _mro(classes, t.cls)
    if not nodes:
        return f"class {t.module}.{t.cls} not found"
    if t.method:
        params = _method_params(nodes, t.method)
        if params is None:
            return f"{t.cls}.{t.method} not found"
        missing = [p for p in t.params if p not in params]
        if missing:
            return f"{t.cls}.{t.method}({', '.join(params)}) lacks parameter(s) {', '.join(missing)}"
        node = _method_node(nodes, t.method)
        if t.calls and node is not None and (why := call_order(node, f"{t.cls}.{t.method}", t.calls)):
            return why
    if t.attrs or t.absent:
        have = _assigned_attrs(nodes)
        missing = [a for a in t.attrs if a not in have]
        if missing:
            return f"{t.cls} has no attribute(s) {', '.join(missing)}"
        return t.fixed_reason(have)
    return None


def live_check(t: Anchor) -> str | None:
    """Like `static_check`, on the imported class: its source file and its live method signature."""
    try:
        mod = importlib.import_module(t.module)
    except Exception as e:  # noqa: BLE001 - any import failure means: skip with the reason
        return f"import {t.module} failed: {type(e).__name__}: {e}"
    if not t.cls:
        return _live_function(mod, t)
    cls = getattr(mod, t.cls, None)
    if not inspect.isclass(cls):
        return f"class {t.module}.{t.cls} not found"
    if t.method:
        fn = getattr(cls, t.method, None)
        if not callable(fn):
            return f"{t.cls}.{t.method} not found"
        try:
            params = [p for p in inspect.signature(fn, follow_wrapped=False).parameters if p != "self"]
        except (TypeError, ValueError) as e:
            return f"{t.cls}.{t.method}: no signature ({e})"
        missing = [p for p in t.params if p not in params]
        if missing:
            return f"{t.cls}.{t.method}({', '.join(params)}) lacks parameter(s) {', '.join(missing)}"
        if t.calls:
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
            except (OSError, TypeError, SyntaxError) as e:
                return f"{t.cls}.{t.method}: source not readable, cannot check its calls ({e})"
            if why := call_order(tree, f"{t.cls}.{t.method}", t.calls):
                return why
    if t.attrs or t.absent:
        try:
            src = inspect.getsourcefile(cls)
        except TypeError:
            src = None
        if not src:
            return f"{t.cls}: source not readable, cannot check attributes"
        nodes = _mro(_classes(_parse(src)), cls.__name__)
        have = _assigned_attrs(nodes) | set(dir(cls))
        missing = [a for a in t.attrs if a not in have]
        if missing:
            return f"{t.cls} has no attribute(s) {', '.join(missing)}"
        return t.fixed_reason(have)
    return None


def _live_function(mod: object, t: Anchor) -> str | None:
    """`live_check` of a module-level function: the live object's signature and source."""
    fn = getattr(mod, t.method or "", None)
    if not callable(fn):
        return f"function {t.module}.{t.method} not found"
    try:
        params = list(inspect.signature(fn, follow_wrapped=False).parameters)
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))) if t.calls else None
    except (OSError, TypeError, ValueError, SyntaxError) as e:
        return f"{t.module}.{t.method}: signature or source not readable ({e})"
    return _function_check(tree if tree is not None else ast.Module(body=[], type_ignores=[]), t, params)


def vllm_root() -> Path | None:
    """The installed vllm package dir, found without importing vllm (no torch)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def tree_version(root: Path) -> str:
    """`__version__` from vllm/_version.py without importing it."""
    f = root / "_version.py"
    try:
        m = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", f.read_text(), re.M)
    except OSError:
        return "unknown"
    return m.group(1) if m else "unknown"


def evaluate(defn: PatchDef, version: str, check: Callable[[Anchor], str | None]) -> str | None:
    """The skip reason for one patch (version, then every target), or None if it would apply."""
    if not in_range(version, defn.min_version, defn.max_version):
        return f"vLLM {version} outside [{defn.min_version}, {defn.max_version})"
    for t in defn.targets:
        why = check(t)
        if why is not None:
            return why
    return None
