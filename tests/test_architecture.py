"""The package's module graph has no import circle (set-up flows one way: load, resolve, build, train), and the
training loop never imports the cluster commands, the plotting command or the recipe helpers.

Function-level imports count too: a lazy import that climbs back up the order is still a circle to a reader. So does
an import by name (importlib): a string constant that is exactly a module's dotted name (cli.py's COMMANDS).
Modules are named by their dotted path below accel_trainer/ (`trainer`, `cluster.launch`); a subpackage's
`__init__` is named by the subpackage and counts only when it imports something.
"""

import ast
import io
import os
import re
import subprocess
import sys
import tokenize

import pytest
from helpers import ROOT, env

PACKAGE = os.path.join(ROOT, "accel_trainer")
# The products that are not the loop: the cluster commands, the plotting command, the recipe helpers. The loop is
# every other module; cli.py, the console script, dispatches to all of them and nothing imports it.
CLUSTER, TOOLS, KIT = "cluster", "tools", "kit"
CLI = "cli"


def modules() -> dict[str, str]:
    """{dotted name: file} of every module in the package but its own __init__."""
    found = {}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
        package = os.path.relpath(folder, PACKAGE).replace(os.sep, ".")
        for f in files:
            if not f.endswith(".py"):
                continue
            if f == "__init__.py":
                if package != ".":
                    found[package] = os.path.join(folder, f)
            else:
                found[f[:-3] if package == "." else f"{package}.{f[:-3]}"] = os.path.join(folder, f)
    return found


def imports_of(name: str, path: str, mods: set[str]) -> set[str]:
    """The package's modules that module `name` (in file `path`) imports."""
    is_package = os.path.basename(path) == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]  # the package the module is in
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()

    def add(dotted: list[str], names=()):
        target = ".".join(dotted)
        for n in names:  # from X import a: a submodule of X, or a name defined in X
            if f"{target}.{n}".strip(".") in mods:
                found.add(f"{target}.{n}".strip("."))
            elif target in mods:
                found.add(target)
        if not names and target in mods:
            found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                add(base + (node.module.split(".") if node.module else []), [a.name for a in node.names])
            elif (node.module or "").split(".")[0] == "accel_trainer":
                add(node.module.split(".")[1:], [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "accel_trainer":
                    add(a.name.split(".")[1:])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("accel_trainer.") and node.value[len("accel_trainer.") :] in mods:
                found.add(node.value[len("accel_trainer.") :])  # an import by name (importlib)
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    files = modules()
    graph = {m: imports_of(m, f, set(files)) for m, f in files.items()}
    imported = set().union(*graph.values())
    # A subpackage's __init__ that imports nothing (a docstring) is no module a reader needs in the graph.
    return {m: deps for m, deps in graph.items() if deps or m in imported or not files[m].endswith("__init__.py")}


def product(module: str) -> str:
    """Which product a module belongs to: 'cluster', 'tools', 'kit', 'cli' or 'loop'."""
    top = module.split(".")[0]
    return top if top in (CLUSTER, TOOLS, KIT, CLI) else "loop"


def circles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    found = set()

    def walk(start, node, path):
        for nxt in graph[node]:
            if nxt == start:
                found.add(tuple(path))
            elif nxt not in path:
                walk(start, nxt, path + [nxt])

    for m in graph:
        walk(m, m, [m])
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {
        ("a", "b", "c"),
        ("b", "c", "a"),
        ("c", "a", "b"),
    }


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert {"trainer", "world", "args", "accel", "cluster.launch", "tools.report"} <= set(graph)  # the graph was read
    assert {"cluster.cluster_config", "cluster.network", "errors"} <= graph["cluster.launch"]
    assert "tools.report" in graph["cli"] and "cluster.wizard" in graph["cli"]  # imports by name count
    assert not circles(graph), sorted(circles(graph))


def test_the_import_reader_resolves_relative_absolute_and_by_name_imports(tmp_path):
    pkg = tmp_path / "sub"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text(
        "from . import n\nfrom ..top import x\nfrom accel_trainer.sub.n import y\nimport accel_trainer.top\n"
        "NAMED = 'accel_trainer.other'\n"
    )
    mods = {"sub", "sub.m", "sub.n", "top", "other"}
    assert imports_of("sub.m", str(pkg / "m.py"), mods) == {"sub.n", "top", "other"}


def test_the_loop_never_imports_the_cluster_commands_plotting_or_recipe_helpers():
    """What makes the folders an architecture: a reader of the loop can ignore cluster/, tools/ and kit/, and an
    install without the [report] extra trains. cli.py (the console script) is the one module that reaches them all;
    kit/ (recipe helpers) may use the loop but not the commands."""
    graph = import_graph()
    assert {product(m) for m in graph} == {"loop", CLUSTER, TOOLS, KIT, CLI}, sorted(graph)
    allowed = {"loop": {"loop"}, KIT: {"loop", KIT}, CLUSTER: {"loop", CLUSTER}, TOOLS: {"loop", TOOLS}}
    wrong = {
        f"{m} -> {d}"
        for m, deps in graph.items()
        if product(m) != CLI
        for d in deps
        if product(d) not in allowed[product(m)]
    }
    assert not wrong, sorted(wrong)
    # The package's own __init__ (what `import accel_trainer` runs) re-exports kit.metrics.load_metric, nothing else.
    init = imports_of("", os.path.join(PACKAGE, "__init__.py"), set(modules()))
    assert {product(d) for d in init} <= {"loop", KIT} and {d for d in init if product(d) == KIT} <= {"kit.metrics"}


# A module of the loop a reader can hold in their head: over this, a part with its own state belongs in a component
# of its own (issue 30). The other products (cluster/, tools/, kit/) are not the loop.
LOOP_MODULE_LINES = 450


def test_no_module_of_the_loop_is_over_450_lines():
    over = {}
    for m, path in modules().items():
        if product(m) != "loop":
            continue
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > LOOP_MODULE_LINES:
            over[os.path.relpath(path, ROOT)] = n
    assert not over, f"modules of the loop over {LOOP_MODULE_LINES} lines: {over}"


# The same at run time, whatever the source says: importing every module of the loop and of kit/ loads neither the
# cluster commands nor the plotting command, nor matplotlib.
LOADED = """
import importlib, pkgutil, sys
import accel_trainer


def walk(path, prefix):  # pkgutil.walk_packages would import cluster/ and tools/ to list them
    for m in pkgutil.iter_modules(path, prefix):
        if m.name.split(".")[1] not in ("cluster", "tools", "cli"):
            module = importlib.import_module(m.name)
            if m.ispkg:
                walk(module.__path__, m.name + ".")


walk(accel_trainer.__path__, "accel_trainer.")
assert "accel_trainer.kit.metric_modules" in sys.modules and "accel_trainer.trainer" in sys.modules  # walked
print(sorted(n for n in sys.modules if n.startswith(("accel_trainer.cluster", "accel_trainer.tools", "matplotlib"))))
"""


@pytest.mark.slow
def test_importing_the_loop_loads_no_cluster_command_and_no_plotting():
    out = subprocess.run([sys.executable, "-c", LOADED], capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


# docs/architecture.md shows the module graph drawn from the code (mermaid, which GitHub renders), between these
# markers; `python tests/test_architecture.py` rewrites it, and the test below fails when it drifts.
BEGIN = "<!-- module graph: generated by `python tests/test_architecture.py`; do not edit by hand -->"
END = "<!-- end of module graph -->"
DOC = os.path.join(ROOT, "docs", "architecture.md")


def node(m: str) -> str:
    """A module as a mermaid node: a subpackage's module (a dot) gets an id without it and its dotted label."""
    return m if "." not in m else f'{m.replace(".", "_")}["{m}"]'


def mermaid(graph: dict[str, set[str]]) -> str:
    """The loop's modules at the top level, each subpackage's in a box named after its folder."""

    def node(m):  # mermaid ids take no dots
        return m.replace(".", "__")

    lines = ["```mermaid", "graph LR"]
    for package in sorted({m.split(".")[0] for m in graph if "." in m}):
        lines.append(f'    subgraph {package}_folder ["{package}/"]')
        lines += [f'        {node(m)}["{m.split(".", 1)[1]}"]' for m in sorted(graph) if m.startswith(package + ".")]
        lines.append("    end")
    lines += [f"    {node(m)} --> {node(dep)}" for m in sorted(graph) for dep in sorted(graph[m])]
    lines += [
        f"    {node(m)}"
        for m in sorted(graph)
        if "." not in m and not graph[m] and not any(m in deps for deps in graph.values())
    ]
    return "\n".join(lines + ["```"])


def generated_block() -> str:
    return f"{BEGIN}\n{mermaid(import_graph())}\n{END}"


def test_the_module_graph_in_the_docs_is_the_code_s():
    text = open(DOC).read()
    assert BEGIN in text and END in text, f"{DOC} lost its generated module graph"
    shown = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert shown == generated_block(), (
        "docs/architecture.md's module graph is stale: run python tests/test_architecture.py"
    )


# Comments say why; the numbers live in the docs (docs/benchmarks.md, each with its command and machine), where
# they are kept current. A figure with a unit in a comment or docstring of the package (~0.6 ms/step, 1.5-3%,
# 10x, ~0.7 s, 150 MB, 20K instructions) is a measurement that drifts from them. A figure that is no measurement (a library's
# default, a setting of ours, arithmetic) is listed here, by file, with why.
NOT_MEASURED = {
    "cluster/cluster_config.py": {
        "900 s": "torchrun's static rendezvous timeout, the default we bound tighter",
        "600 s": "torchrun's c10d join_timeout default",
        "60 s": "torchrun's c10d read_timeout default",
    },
    "cluster/launch.py": {"30 min": "torch's timeout for a process group created without one"},
    "peers.py": {"30 min": "torch's timeout for a process group created without one"},
    "cpu_allocator.py": {
        "128 KiB": "glibc's mmap threshold at start",
        "32 MiB": "glibc's largest mmap threshold",
        "4 KiB": "a page",
    },
    "checkpointing/state.py": {"8 bytes": "an 8-byte element viewed as two int32s"},
    "checkpointing/folder.py": {"1 MiB": "our floor for the room a write needs"},
    "flags.py": {"30%": "an example of a help text"},
}
_NUMBER = r"(?<![\w.])~?\d+(?:[.,]\d+)*(?:\s*[-–]\s*~?\d+(?:[.,]\d+)*)?"
FIGURE = re.compile(
    _NUMBER
    + r"(?:\s?(?:ns|us|µs|ms|s|sec|seconds?|min|minutes?|hours?)\b|\s[KMGT]i?B\b|\sbytes?\b|[KM]?\sinstructions\b|%|x\b)"
)


def comment_lines(source: str):
    """(line number, text) of every comment and every docstring line."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if ast.get_docstring(node, clean=False) is not None:
                doc = node.body[0]
                yield from enumerate(doc.value.value.splitlines(), start=doc.lineno)


def figures(source: str) -> list[tuple[int, str]]:
    """(line number, figure) of every figure with a unit in the comments and docstrings of `source`."""
    return sorted((n, m.group(0)) for n, line in comment_lines(source) for m in FIGURE.finditer(line))


def test_the_figure_finder_finds_measurements_and_passes_what_is_not_one():
    found = figures(
        '"""Costs ~0.7 s of start-up,\nthe step 1.5-3% slower."""\n'
        "x = 1  # ~0.6 ms/step on a small model\n"
        "y = 2  # 10x slower in bf16; 150 MB for train; 8 bytes; 30 min; ~20K instructions a row\n"
        "def f():\n    # 2x2 conv, 16 x 128 tokens, 169.254.x, step 3, A100-SXM4-80GB, issue #135712, 3 steps\n    pass\n"
    )
    assert found == [
        (1, "~0.7 s"),
        (2, "1.5-3%"),
        (3, "~0.6 ms"),
        (4, "10x"),
        (4, "150 MB"),
        (4, "30 min"),
        (4, "8 bytes"),
        (4, "~20K instructions"),
    ]


def test_no_measurement_in_the_package_s_comments():
    found, listed = {}, set()
    for path in modules().values():
        name = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
        with open(path) as f:
            for n, figure in figures(f.read()):
                if figure in NOT_MEASURED.get(name, {}):
                    listed.add((name, figure))
                else:
                    found.setdefault(f"accel_trainer/{name}:{n}", []).append(figure)
    assert not found, (
        f"figures in comments or docstrings: {found}. Say why in the comment and put the figure in docs/benchmarks.md "
        "(or the page about it) with its command and machine; a figure that is no measurement goes in NOT_MEASURED."
    )
    stale = {(name, figure) for name, why in NOT_MEASURED.items() for figure in why} - listed
    assert not stale, f"NOT_MEASURED lists figures no longer in those files: {sorted(stale)}"


if __name__ == "__main__":
    text = open(DOC).read()
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + generated_block() + text[text.index(END) + len(END) :]
    else:
        text = text.replace(
            "\n## One run from every entry point", f"\n{generated_block()}\n\n## One run from every entry point", 1
        )
    with open(DOC, "w") as f:
        f.write(text)
    print(f"wrote the module graph into {DOC}")


def unsafe_reads(source: str) -> list[str]:
    """The reads in `source` that bypass accel_trainer/safe_read.py: json.load/json.loads, and open() or os.open()
    of a file for reading (no mode, or a mode without w/a/x), unless the path is a literal under /proc/."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
        name = f.id if isinstance(f, ast.Name) else name
        if name in ("json.load", "json.loads"):
            found.append(f"line {node.lineno}: {name}")
        elif name in ("open", "os.open", "io.open") and node.args:
            path = node.args[0]
            if isinstance(path, ast.JoinedStr | ast.Constant) and "/proc/" in ast.unparse(path):
                continue  # the kernel's own files
            mode = (
                node.args[1]
                if len(node.args) > 1
                else next((k.value for k in node.keywords if k.arg in ("mode", "flags")), None)
            )
            text = ast.unparse(mode) if mode is not None else ""
            if name == "os.open":
                writes = len(node.args) > 2 or any(w in text for w in ("O_WRONLY", "O_RDWR", "O_CREAT"))  # 3rd: a mode
            else:
                writes = any(c in text for c in "wax")
            if not writes:
                found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_the_read_finder_finds_each_way_to_bypass_the_safe_reader():
    bad = "import json, os\njson.load(f)\njson.loads(s)\nopen(p)\nopen(p, 'rb')\nos.open(p, os.O_RDONLY)\n"
    assert len(unsafe_reads(bad)) == 5
    ok = "open(p, 'w')\nopen(p, mode='ab')\nos.open(p, os.O_WRONLY | os.O_CREAT)\nopen('/proc/self/maps')\n"
    assert unsafe_reads(ok) == []


def test_every_file_the_package_reads_goes_through_the_safe_reader():
    # Issue 39: best/best.json as a FIFO blocked a resume forever and as a link to /dev/zero read until the OOM
    # killer came; a lock record of nested brackets was a RecursionError traceback. Each was a read of its own, with
    # Python's open/json, beside the checkpoint's strict reader. One reader now (safe_read.py: no link followed, no
    # blocking open, regular files only, bounded, strict JSON); a read beside it is listed here. Reads of files
    # the run itself just wrote and fsynced (hashing for the manifest) are the reviewed exceptions below.
    reviewed = {
        # (module, what): why it may read directly
        ("checkpointing.folder", "open(path, 'rb')"): "hash_file: its callers lstat the file first (verify: "
        "regular, size against its format's before hashing; the writer: its own file)",
        ("checkpointing.folder", "os.open(path, os.O_RDONLY)"): "fsync_path: opens a folder the run made, to fsync it",
        ("checkpointing.folder", "os.open(tmp, os.O_RDONLY)"): "write_file_atomically: fsyncs the file it just wrote",
        ("checkpointing.changes", "os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)"): "_flag: a file or "
        "folder, by lstat, opened for its flags (an ioctl), without following a link or blocking; nothing read",
        ("throughput", "os.open(f'/proc/self/{name}', flags | os.O_CLOEXEC)"): "the kernel's own files",
    }
    found = {}
    for name, path in sorted(modules().items()):
        if name == "safe_read":
            continue
        with open(path) as f:
            for hit in unsafe_reads(f.read()):
                what = hit.split(": ", 1)[1]
                if not any(name == m and what.startswith(w) for m, w in reviewed):
                    found.setdefault(name, []).append(hit)
    assert not found, found
