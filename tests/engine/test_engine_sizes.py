"""The engine wing stays split by concern: no class over 600 lines, no module over 900."""

from __future__ import annotations

import ast
from pathlib import Path

import hicache_storage.engine as engine

ENGINE = Path(engine.__file__).parent


def test_no_engine_class_passes_600_lines_nor_module_900() -> None:
    modules = sorted(ENGINE.glob("*.py"))
    assert len(modules) > 10, "the engine's modules were found"
    too_long = []
    for path in modules:
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > 900:
            too_long.append(f"{path.name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                span = node.end_lineno - node.lineno + 1
                if span > 600:
                    too_long.append(f"{path.name}: class {node.name}, {span} lines")
    assert not too_long, "split these by concern: " + "; ".join(too_long)
