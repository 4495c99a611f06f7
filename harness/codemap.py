"""The module map, ``docs/code-map.md``, generated from the tree: every package and module with the first
paragraph of its own docstring, the engine's folders in the order their imports stack them.

``python -m harness.codemap`` writes it; ``tests/test_docs.py`` fails when the committed map is not what the
tree generates now, so a module added, moved or re-described shows up in the map in the same commit, and
when a docstring, a comment or a doc names a module or a name that no longer exists (:func:`dangling`).
The floors come from the imports themselves (a folder sits above everything it imports), so the map's
order is the data's way down: the HTTP edge at the top, the layer kinds and the ground at the bottom.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "code-map.md"
PACKAGES = ("semantic", "harness")

HEADER = """# Where things are

Generated from the tree by `python -m harness.codemap` (`make code-map`); `tests/test_docs.py` fails when it
is stale. Each line is the first paragraph of the module's own docstring. The engine's folders stand in the order
their imports stack them: each imports only what stands below it (nothing in `semantic` imports `harness`),
so a turn's data travels down the page: HTTP edge → one request type → scheduler plan → step loop → pool →
disk.
"""


def first_line(path: Path) -> str:
    """The first paragraph of a module's docstring on one line (a package's: its ``__init__.py``'s), or ''."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    except (OSError, SyntaxError):
        return ""
    if not doc:
        return ""
    text = " ".join(doc.strip().split("\n\n")[0].split()).removesuffix("::").rstrip(":")
    if len(text) > 160 and ". " in text:  # a long first paragraph: its first sentence
        text = text[: text.index(". ") + 1]
    return text


def _unit(package: str, module: str) -> str | None:
    """The top-level unit of ``package`` a dotted module name falls in: a subpackage or a top module."""
    parts = module.split(".")
    if parts[0] != package or len(parts) < 2:
        return None
    return parts[1]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def units(package: str) -> dict[str, list[Path]]:
    """``package``'s top-level units (subpackages and top modules) and their files."""
    base = ROOT / package
    out: dict[str, list[Path]] = {}
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        name = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if name in ("__init__", "__main__"):
            continue
        out.setdefault(name, []).append(path)
    return out


def floors(package: str) -> dict[str, int]:
    """Each unit's floor: 1 + the highest floor it imports (1: it imports no other unit)."""
    members = units(package)
    deps = {u: {d for p in files for m in _imports(p) if (d := _unit(package, m)) in members and d != u}
            for u, files in members.items()}
    memo: dict[str, int] = {}

    def floor(u: str, seen: tuple = ()) -> int:
        assert u not in seen, f"an import circle: {' -> '.join(seen + (u,))}"
        if u not in memo:
            memo[u] = 1 + max((floor(d, seen + (u,)) for d in deps[u]), default=0)
        return memo[u]

    return {u: floor(u) for u in members}


def _rows(package: str, unit: str, files: list[Path]) -> list[str]:
    base = ROOT / package
    rows = []
    for path in files:
        rel = path.relative_to(base)
        if path.name == "__main__.py" or (path.name == "__init__.py" and len(rel.parts) == 2):
            continue  # the unit's own docstring heads its section
        shown = str(rel.parent) + "/" if path.name == "__init__.py" else str(rel)
        rows.append(f"| `{shown}` | {first_line(path)} |")
    return rows


def render() -> str:
    out = [HEADER]
    for package in PACKAGES:
        out.append(f"## `{package}/`: {first_line(ROOT / package / '__init__.py')}\n")
        members = units(package)
        order = floors(package) if package == "semantic" else {u: 0 for u in members}
        for unit in sorted(members, key=lambda u: (-order[u], u)):
            files = members[unit]
            is_folder = (ROOT / package / unit).is_dir()
            head = first_line(ROOT / package / unit / "__init__.py") if is_folder else first_line(files[0])
            floor = f" (floor {order[unit]})" if package == "semantic" else ""
            name = f"{unit}/" if is_folder else f"{unit}.py"
            out.append(f"### `{package}/{name}`{floor}\n\n{head}\n")
            if is_folder:
                out += ["| module | what it is |", "|---|---|", *_rows(package, unit, files), ""]
    return "\n".join(out).rstrip() + "\n"


# names the docs and docstrings mention that live outside this tree and outside the packages scanned below:
# other projects' files and shared libraries, C functions, a client's config file, formula symbols, a jinja filter
EXTERNAL = frozenset({"block_manager.py", "libblas", "libmlx.so", "mlx_cpu.libs", "malloc", "opencode.json",
                      "finally", "p_i", "q2", "tojson"})
# the libraries whose names the docs quote (their modules and the functions and classes they define)
LIBRARIES = ("mlx", "mlx_lm", "fastapi", "starlette", "pydantic", "llguidance", "prometheus_client", "redis")
METHODS = {"to_markdown", "groupby"}  # pandas', which the harness's tables call


def _known_names() -> set[str]:
    """Every name the tree's code uses or defines, its modules' and folders' names (the libraries':
    :func:`_library_names`)."""
    known: set[str] = set(EXTERNAL) | METHODS
    for path in _sources():
        known.add(path.stem)
        known.update(path.relative_to(ROOT).parts)
        for n in ast.walk(ast.parse(path.read_text())):
            for attr in ("id", "attr", "name", "arg"):
                value = getattr(n, attr, None)
                if isinstance(value, str):
                    known.add(value)
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for a in n.names:
                    known.update(a.name.split("."))
                if isinstance(n, ast.ImportFrom) and n.module:
                    known.update(n.module.split("."))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"[\w.\-/]+", n.value):
                known.update(re.split(r"[./\-]", n.value))
                known.add(n.value)
                known.add(f"semantic_{n.value}")  # a Prometheus metric, named from its short name
    return known


@functools.cache
def _library_names() -> frozenset[str]:
    """The modules, functions and classes of :data:`LIBRARIES` and MLX's names: parsing them takes seconds, so
    only a mention the tree does not explain looks here, once a process."""
    known = set()
    for lib in LIBRARIES:
        spec = importlib.util.find_spec(lib)
        if spec is None or not spec.submodule_search_locations:
            continue
        for path in Path(list(spec.submodule_search_locations)[0]).rglob("*.py"):
            known.add(path.stem)
            try:
                known.update(n.name for n in ast.walk(ast.parse(path.read_text()))
                             if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
    import mlx.core as mx

    known.update(dir(mx))
    return frozenset(known)


def _sources() -> list[Path]:
    return [p for pkg in (*PACKAGES, "tests") for p in sorted((ROOT / pkg).rglob("*.py"))] + [ROOT / "conftest.py"]


def _mentions():
    """``(where, name)`` for every module-like name in the engine's and harness's docstrings and comments
    (between double backquotes) and in the docs (between backquotes)."""
    for path in _sources():
        if path.parts[len(ROOT.parts)] == "tests":
            continue
        where = str(path.relative_to(ROOT))
        source = path.read_text()
        for n in ast.walk(ast.parse(source)):
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for name in re.findall(r"``([^`]+)``", ast.get_docstring(n) or ""):
                    yield where, name
        for line in source.splitlines():
            if "#" in line:
                for name in re.findall(r"``([^`]+)``", line.split("#", 1)[1]):
                    yield where, name
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        for name in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", path.read_text()):
            yield str(path.relative_to(ROOT)), name


def dangling() -> list[tuple[str, str]]:
    """The docstrings', comments' and docs' mentions of a module, file or name that does not exist:
    a dotted ``semantic...`` name that imports nothing, a path ending in ``.py`` that is no file, a lowercase name that nothing in the
    tree or its libraries defines or uses (a module renamed or removed since)."""
    known = _known_names()
    files = _files()
    bad = set()
    for where, raw in _mentions():
        name = raw.strip().split("(")[0]
        if re.fullmatch(r"[0-9a-f]{7,40}", name) and re.search(r"\d", name):
            continue  # a commit's id
        if re.fullmatch(r"(semantic|harness|tests)(\.\w+)+", name):
            ok = _resolves(name, known) or _resolves(name, known | _library_names())
        elif re.fullmatch(r"[\w/.\-]+\.py", name):
            ok = name in known or any(f == name or f.endswith("/" + name) for f in files) or name in _library_names()
        elif re.fullmatch(r"[a-z][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*", name):
            ok = all(part in known or part in _library_names() for part in name.split("."))
        else:
            continue
        if not ok:
            bad.add((where, name))
    return sorted(bad)


def _files() -> set[str]:
    """The checkout's files, tracked or new, as git lists them: not what a run left beside them (the
    compared commits' worktrees under ``.peers/``, the venvs), which a clean clone lacks."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return {str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if not {".venv", ".git"} & set(p.parts)}
    return set(out.splitlines())


def _resolves(dotted: str, known: set[str]) -> bool:
    """A dotted name is a module of the tree, or a module's attribute the code knows."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return all(p in known for p in parts[i:])
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="write docs/code-map.md from the tree (--check: only compare)")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        same = MAP.exists() and MAP.read_text() == text
        print("docs/code-map.md is current" if same else "docs/code-map.md is stale: run python -m harness.codemap")
        bad = dangling()
        for where, name in bad:
            print(f"{where}: names {name!r}, which does not exist")
        return 0 if same and not bad else 1
    MAP.write_text(text)
    print(f"wrote {MAP.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
