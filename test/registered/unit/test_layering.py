"""The package's imports against its declared layers (docs/architecture.md), read with `ast`.

Layers, top to bottom; a module may import its own layer's and every lower layer's modules, never
a higher one's. Every import counts: at module level, inside functions, and under TYPE_CHECKING.

    9  entrypoints   sglang (the package face), sglang.launch_server, sglang.bench_*, srt/entrypoints, srt/server_args*, srt/server_configs, srt/tools
    8  managers      srt/managers
    7  executor      srt/model_executor
    6  lora, models  srt/lora, srt/models (side by side; models never import lora)
    5  layers        srt/layers
    4  services      srt/distributed, srt/mem_cache, srt/model_loader, srt/constrained
    3  configs       srt/configs, srt/sampling (plain data)
    2  utils         srt/utils, sglang.sse

The test also fails on import circles between modules (type-only imports included).
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict

PKG_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                        "python")

LAYERS = [  # (layer, module prefixes), top first
    (9, ["sglang", "sglang.srt", "sglang.launch_server", "sglang.bench_one_batch", "sglang.bench_serving", "sglang.bench_workload", "sglang.srt.entrypoints",
         "sglang.srt.server_args", "sglang.srt.server_args_cli", "sglang.srt.server_configs", "sglang.srt.tools"]),
    (8, ["sglang.srt.managers"]),
    (7, ["sglang.srt.model_executor"]),
    (6, ["sglang.srt.lora", "sglang.srt.models"]),
    (5, ["sglang.srt.layers"]),
    (4, ["sglang.srt.distributed", "sglang.srt.mem_cache", "sglang.srt.model_loader", "sglang.srt.constrained"]),
    (3, ["sglang.srt.configs", "sglang.srt.sampling"]),
    (2, ["sglang.srt.utils", "sglang.sse"]),
]
FORBIDDEN = [("sglang.srt.models", "sglang.srt.lora")]  # side by side, but never this way


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(os.path.join(PKG_ROOT, "sglang")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, PKG_ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _layer(module: str) -> int:
    best = None
    for layer, prefixes in LAYERS:
        for p in prefixes:
            if module == p or (p not in ("sglang", "sglang.srt") and module.startswith(p + ".")):
                if best is None or len(p) > best[0]:
                    best = (len(p), layer)
    assert best is not None, f"{module} has no layer: add it to LAYERS"
    return best[1]


def _imports(path: str, module: str, modules: dict[str, str]) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            # The longest known module the name points into (a `from pkg import submodule` too).
            while name and name not in modules:
                name = name.rsplit(".", 1)[0] if "." in name else ""
            if name and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, m, modules) for m, p in modules.items()}


def test_every_import_points_down() -> None:
    graph = import_graph()
    upward = []
    for src, dsts in sorted(graph.items()):
        for dst in sorted(dsts):
            if _layer(dst) > _layer(src) or any(src.startswith(a) and dst.startswith(b) for a, b in FORBIDDEN):
                upward.append(f"{src} ({_layer(src)}) -> {dst} ({_layer(dst)})")
    assert not upward, f"{len(upward)} import(s) point up or sideways:\n  " + "\n  ".join(upward)


def test_no_import_circles() -> None:
    graph = import_graph()
    # Tarjan's strongly connected components: a component of more than one module is a circle.
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in circles)


def test_the_layers_cover_every_module() -> None:
    layers = defaultdict(list)
    for m in import_graph():
        layers[_layer(m)].append(m)
    assert set(layers) <= {layer for layer, _ in LAYERS}
