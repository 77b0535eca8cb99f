"""The house reads in data-flow order: no module of ``opengem`` imports one that the README's
layout lists below it (lazy imports inside functions included), and nothing imports
the instruments."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "opengem"


def layout_order() -> list[str]:
    """The README's layout block, top to bottom: ``features/schema.py`` → ``features``."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    units = []
    for line in block.splitlines():
        m = re.match(r"^  (\S+?)(?:/|\.py)?(?:/\S*)?\s", line + " ")
        if m and not line.startswith("   "):
            units.append(m.group(1).split("/")[0])
    return units


def unit_of(module: str) -> str:
    """``opengem.world.oracle`` → ``world``; ``opengem.cli`` → ``cli``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_layout_lists_every_room():
    order = layout_order()
    rooms = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__")
             or (p.is_dir() and (p / "__init__.py").exists())}
    missing = rooms - {"__main__"} - set(order)
    assert not missing, f"rooms missing from the README's layout: {missing}"


def test_no_module_imports_one_listed_below_it():
    rank = {u: i for i, u in enumerate(layout_order())}
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = unit_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for mod in imports_of(path):
            if mod.split(".")[0] == "instruments":
                upward.append(f"{path.relative_to(ROOT)} imports the instruments ({mod})")
            if not mod.startswith("opengem."):
                continue
            there = unit_of(mod)
            if there != here and there in rank and here in rank and rank[there] > rank[here]:
                upward.append(f"{path.relative_to(ROOT)} ({here}) imports {mod} ({there}, "
                              f"listed below it)")
    assert not upward, "\n".join(upward)
