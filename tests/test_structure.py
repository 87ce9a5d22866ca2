"""The code's shape: packages import each other one way (no cycle), and no source file is over 300 lines."""
import ast
from pathlib import Path

import mtpserve

ROOT = Path(mtpserve.__file__).parent


def package_imports() -> dict[str, set[str]]:
    """{package or top-level module: the others it imports} (mtpserve/engine/x.py -> "engine"; config.py ->
    "config")."""
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        src = parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("mtpserve.") and name.split(".")[1] != src:
                    edges.setdefault(src, set()).add(name.split(".")[1])
    return edges


def cycle_through(edges: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in edges.get(node, ()):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_import_cycle_between_packages():
    edges = package_imports()
    assert {"engine", "runner", "spec_decode", "serve", "disagg", "executor"} <= set(edges)   # (the scan works)
    cycles = [c for c in (cycle_through(edges, p) for p in sorted(edges)) if c]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    assert cycle_through({"a": {"b"}, "b": {"c"}, "c": {"a"}}, "a") == ["a", "b", "c", "a"]
    assert cycle_through({"a": {"b"}, "b": {"c"}}, "a") is None


def test_no_source_file_over_300_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 300}
    assert not long, long
