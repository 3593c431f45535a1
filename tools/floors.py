"""The floors of the house: kvserve's rooms (its subpackages and top-level modules) and
the imports between them, read from the source.

A room's floor is one above the highest room it imports, so every arrow points down and
a circle has no floor at all. ``python -m tools.floors`` prints the picture;
``--write`` puts it into docs/architecture.md between its markers (a test keeps the two
in step).
"""
from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kvserve"
FRONT_DOOR = "kvserve"  # kvserve/__init__.py: what `from kvserve import ...` reaches
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- floors:begin -->", "<!-- floors:end -->"


def _module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _room(module: str, package_dir: Path) -> str:
    """The room a dotted module (or a name imported from a package) belongs to."""
    parts = module.split(".")
    if len(parts) == 1:
        return FRONT_DOOR
    first = parts[1]
    if (package_dir / first).is_dir() or (package_dir / f"{first}.py").is_file():
        return first
    return FRONT_DOOR  # a name kvserve/__init__.py exports


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement reaches, relative imports resolved."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [f"{source}.{alias.name}" for alias in node.names]


def room_graph(package_dir: Path = ROOT / PACKAGE) -> dict[str, set[str]]:
    """Each room and the rooms it imports (at module level or inside a function; an
    import under ``if TYPE_CHECKING:`` is for annotations only and not counted)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted(package_dir.rglob("*.py")):
        module = _module_name(path, package_dir)
        source = _room(module, package_dir)
        graph[source]  # a room that imports nothing is still a room
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                       for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            for name in _imported(node, module, path.name == "__init__.py"):
                if name == PACKAGE or name.startswith(PACKAGE + "."):
                    target = _room(name, package_dir)
                    if target != source:
                        graph[source].add(target)
    return dict(graph)


def _is_type_checking(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING")


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of rooms that import each other round a circle (Tarjan's components of
    more than one room)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(room: str) -> None:
        index[room] = low[room] = len(index)
        stack.append(room)
        for other in sorted(graph.get(room, ())):
            if other not in index:
                visit(other)
                low[room] = min(low[room], low[other])
            elif other in stack:
                low[room] = min(low[room], index[other])
        if low[room] == index[room]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == room:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for room in sorted(graph):
        if room not in index:
            visit(room)
    return found


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each room's floor: 0 for a room importing no other, else one above the highest
    room it imports. Raises ValueError naming the circles if there are any."""
    found = circles(graph)
    if found:
        raise ValueError(f"rooms that import each other round a circle: {found}")
    floor: dict[str, int] = {}

    def of(room: str) -> int:
        if room not in floor:
            floor[room] = 1 + max((of(other) for other in graph.get(room, ())), default=-1)
        return floor[room]
    for room in graph:
        of(room)
    return floor


def _label(room: str, package_dir: Path) -> str:
    return f"{room}/" if (package_dir / room).is_dir() else f"{room}.py" \
        if room != FRONT_DOOR else f"{PACKAGE}/__init__.py"


def picture(graph: dict[str, set[str]], package_dir: Path = ROOT / PACKAGE) -> str:
    """The floors top to bottom, each room with the rooms it imports."""
    floor = floors(graph)
    arrows = sum(len(targets) for targets in graph.values())
    lines = [f"{len(graph)} rooms on {max(floor.values()) + 1} floors, {arrows} arrows, "
             "every one pointing down (generated by `python -m tools.floors`)", "", "```"]
    width = max(len(_label(room, package_dir)) for room in graph)
    for level in range(max(floor.values()), -1, -1):
        rooms = sorted(room for room in graph if floor[room] == level)
        for i, room in enumerate(rooms):
            head = f"{level:>2}  " if i == 0 else "    "
            targets = ", ".join(sorted(graph[room])) or "-"
            lines.append(f"{head}{_label(room, package_dir):<{width}}  -> {targets}")
    lines.append("```")
    return "\n".join(lines)


def with_picture(doc: str, drawn: str) -> str:
    """``doc`` with the text between the markers replaced by ``drawn``."""
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"the document has no {BEGIN} ... {END} block")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{drawn}\n{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"update {DOC.name}")
    args = parser.parse_args()
    drawn = picture(room_graph())
    if args.write:
        DOC.write_text(with_picture(DOC.read_text(), drawn))
    else:
        print(drawn)


if __name__ == "__main__":
    main()
