"""The layers of docs/architecture.md, enforced on the source with an ``ast`` walk (no import runs).

- the runtime imports nothing from export, training, bench, the daemon, the clients or the CLI;
- the daemon and the clients do not import each other (they share llmd.protocol);
- the clients and the protocol reach no torch, the runtime no ZeroMQ, through any chain of imports;
- an llmd import inside a function is only one of ALLOWED_LOCAL, each with its reason.
"""
from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CLI = ("llmd.cli", "llmd.generate", "llmd.demo")
FORBIDDEN = {   # importer prefix -> imported prefixes it must not reach directly
    "llmd.runtime": ("llmd.export", "llmd.training", "llmd.bench", "llmd.daemon", "llmd.clients", *CLI),
    "llmd.daemon": ("llmd.clients", *CLI),
    "llmd.clients": ("llmd.daemon", "llmd.runtime", *CLI),
    "llmd.protocol": ("llmd.daemon", "llmd.clients", "llmd.runtime"),
}
NEVER_REACHES = {   # importer prefix -> third-party modules no chain of its imports may load
    "llmd.clients": ("torch",),
    "llmd.protocol": ("torch", "zmq"),
    "llmd.codec": ("torch", "zmq"),
    "llmd.runtime": ("zmq",),
}
# Imports of llmd modules inside functions, by (module, imported module), and why each is deferred.
ALLOWED_LOCAL = {
    ("llmd", "llmd.runtime.llm"): "`from llmd import LLM` loads torch on first use, so `import llmd.clients` stays light",
    ("llmd", "llmd.runtime"): "the same, for SamplingParams and Priority",
    ("llmd", "llmd.runtime.request"): "the same",
    ("llmd.daemon.serve", "llmd.runtime.engine"): "torch loads on the engine thread, after the socket is bound",
    ("llmd.runtime.loading", "llmd.runtime.execution.cuda.backend"): "the CUDA runner needs triton: imported "
        "only where a model runs on the GPU",
    **{("llmd.bench.bench_revisions", m): "it measures whichever revision of llmd the interpreter it is run "
       "with has installed; the process that drives the revisions imports none"
       for m in ("llmd", "llmd.runtime.models.random_model", "llmd.runtime.config")},
}


@dataclass(frozen=True)
class Import:
    module: str        # the importing module
    target: str        # the imported module (for `from a import b`, also a.b when that is a module)
    local: bool        # inside a function
    where: str         # file:line


def package_dirs(root: Path) -> dict[str, Path]:
    """llmd's subpackages and their folders, as pyproject.toml maps them."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: root / folder for name, folder in tool["package-dir"].items()}


def modules(root: Path) -> dict[str, Path]:
    """Every llmd module: dotted name -> file."""
    out = {}
    for pkg, folder in package_dirs(root).items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            out[".".join((pkg, *rel[:-1]) if rel[-1] == "__init__" else (pkg, *rel))] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
        else:
            continue
        where = f"{shown}:{node.lineno}"
        out += [Import(name, t, id(node) in local, where) for t in targets]
    return out


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(root: Path) -> list[str]:
    mods = modules(root)
    graph = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    found = []
    for name, edges in graph.items():
        for e in edges:
            for importer, banned in FORBIDDEN.items():
                if under(name, importer) and any(under(e.target, b) for b in banned):
                    found.append(f"{e.where}: {name} imports {e.target} (a layer {importer} must not import)")
            if e.local and e.target.startswith("llmd") and (name, e.target) not in ALLOWED_LOCAL:
                found.append(f"{e.where}: {name} imports {e.target} inside a function; import it at the top "
                             "(or, for an optional heavy dependency, list it in ALLOWED_LOCAL with the reason)")
    for importer, banned in NEVER_REACHES.items():
        for name in (m for m in graph if under(m, importer)):
            chain = reach(graph, name, banned)
            if chain:
                found.append(f"{name} reaches {chain[-1]}: {' -> '.join(chain)}")
    return found


def reach(graph: dict[str, list[Import]], start: str, banned: tuple[str, ...]) -> list[str] | None:
    """An import chain from ``start`` to a banned third-party module through llmd modules, or None. The
    deferred imports of ALLOWED_LOCAL are not followed: they run only when their function does."""
    seen, queue = {start}, [[start]]
    while queue:
        chain = queue.pop(0)
        for e in graph.get(chain[-1], []):
            if any(under(e.target, b) for b in banned):
                return chain + [e.target]
            if e.target in graph and e.target not in seen and (e.module, e.target) not in ALLOWED_LOCAL:
                seen.add(e.target)
                queue.append(chain + [e.target])
    return None


def test_the_layers_hold():
    found = violations(REPO)
    assert not found, "layer rules broken (docs/architecture.md, Layers):\n" + "\n".join(found)


def test_the_walk_sees_every_package():
    mods = modules(REPO)
    for name in ("llmd.cli", "llmd.protocol", "llmd.runtime.engine", "llmd.runtime.formats.engine_dir",
                 "llmd.export.cli", "llmd.training.train_demo", "llmd.daemon.server", "llmd.clients.client",
                 "llmd.bench.cli"):
        assert name in mods, name
    assert len(mods) > 100


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    """A copy of the package layout with the given files (and pyproject.toml) only."""
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    for folder in set(package_dirs(REPO).values()):
        (tmp_path / folder.relative_to(REPO)).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder.relative_to(REPO) / "__init__.py").write_text("")
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_the_walk_catches_each_kind_of_break(tmp_path):
    root = _plant(tmp_path, {
        "runtime/engine.py": "from llmd.export import quality\n",
        "runtime/loading.py": "def f():\n    from .engine import Engine\n",
        "clients/client.py": "from llmd.runtime import config\n",
        "runtime/config.py": "import torch\n",
        "llmd/protocol.py": "from llmd.sentences import x\n",
        "llmd/sentences.py": "import zmq\n",
    })
    found = "\n".join(violations(root))
    assert "llmd.runtime.engine imports llmd.export" in found
    assert "llmd.runtime.loading imports llmd.runtime.engine inside a function" in found
    assert "llmd.clients.client imports llmd.runtime" in found
    assert "llmd.clients.client reaches torch: llmd.clients.client -> llmd.runtime.config -> torch" in found
    assert "llmd.protocol reaches zmq: llmd.protocol -> llmd.sentences -> zmq" in found
