"""The layering rules of DESIGN.md, checked: import-linter contracts (.importlinter at the repo
root), what `import adaattn` pulls in, what it costs, and that api/ never names a runner."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
CONFIG = ROOT / ".importlinter"

# Modules `import adaattn` must not import (DESIGN.md, "Never": import cost and optional
# dependencies). The kernels import triton lazily; torch._dynamo costs about a second.
NOT_ON_IMPORT = ("transformers", "triton", "torch._dynamo", "adaattn.cli")

# Every runner name, or the prefix of a family of them (Policy.backends admits prefixes).
RUNNER_PREFIXES = ("sdpa", "triton", "flash_attn", "reference")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _lint_imports() -> list[str]:
    exe = shutil.which("lint-imports")
    if exe is not None:
        return [exe]
    return [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"]


def test_import_linter_contracts_are_kept():
    pytest.importorskip("importlinter", reason="import-linter is not installed (pip install import-linter)")
    assert CONFIG.is_file(), f"{CONFIG} is missing"
    r = subprocess.run(
        _lint_imports() + ["--config", str(CONFIG), "--no-cache", "--no-logo"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, f"lint-imports failed (rc={r.returncode}):\n{r.stdout}\n{r.stderr}"


def test_import_linter_config_names_every_layer_of_the_design():
    """The contract file itself: the layers DESIGN.md lists, in its order, lowest last."""
    text = CONFIG.read_text()
    for module in ("adaattn.api", "adaattn.planner", "adaattn.kv", "adaattn.adaptive", "adaattn.backends",
                   "adaattn.kernels", "adaattn.problem", "adaattn.policy", "adaattn.hardware", "adaattn.stats",
                   "adaattn.settings", "adaattn.version", "adaattn.nn", "adaattn.integrations", "adaattn.models", "adaattn.bench",
                   "adaattn.cli", "adaattn.distributed"):
        assert module in text, f"{module} is not in {CONFIG.name}"
    order = ["adaattn.api", "adaattn.planner", "adaattn.kv", "adaattn.adaptive", "adaattn.backends",
             "adaattn.kernels", "adaattn.problem"]
    layers = text.split("[importlinter:contract:layers]")[1].split("[importlinter:contract:")[0]
    positions = [layers.index(m) for m in order]
    assert positions == sorted(positions), "layers out of DESIGN.md's order"


def _contract_lines() -> list[str]:
    return [line for line in CONFIG.read_text().splitlines() if not line.lstrip().startswith("#")]


def test_no_layer_of_the_contract_is_optional():
    """Every layer of DESIGN.md exists: an optional one (in parentheses) would let a layer vanish
    unnoticed."""
    assert [line for line in _contract_lines() if "(adaattn" in line] == []


def test_an_ignore_that_matches_no_import_is_an_error():
    """import-linter's default: an ignore left behind by a change fails the contract."""
    assert [line for line in _contract_lines() if "unmatched_ignore_imports_alerting" in line] == []


def test_every_ignored_import_is_a_rule_of_the_design():
    """DESIGN.md: bench/ and cli.py may use models/, integrations/ and distributed/; the CLI runs
    the suites. No other ignore."""
    allowed_sources = ("adaattn.cli", "adaattn.bench", "adaattn.bench.**")
    allowed_targets = {"adaattn.cli": ("adaattn.bench", "adaattn.bench.**", "adaattn.models", "adaattn.models.**",
                                       "adaattn.integrations", "adaattn.integrations.**", "adaattn.distributed",
                                       "adaattn.distributed.**")}
    bench_targets = ("adaattn.models", "adaattn.models.**", "adaattn.integrations", "adaattn.integrations.**",
                     "adaattn.distributed", "adaattn.distributed.**")
    ignores = [line.strip() for line in _contract_lines() if "->" in line]
    assert ignores, "the contract ignores nothing: then this test has nothing to hold"
    for line in ignores:
        source, target = (part.strip() for part in line.split("->"))
        assert source in allowed_sources, line
        assert target in allowed_targets.get(source, bench_targets), line


def test_kernels_never_use_autograd():
    """DESIGN.md: kernels/ is @triton.jit code; autograd belongs to the backends' glue."""
    found = []
    for path in sorted((SRC / "adaattn" / "kernels").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
                if any("autograd" in n for n in names):
                    found.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Attribute) and node.attr == "autograd":
                found.append(f"{path.name}:{node.lineno}")
    assert found == [], f"kernels use torch.autograd: {found}"


def test_import_adaattn_imports_no_optional_or_heavy_module():
    code = (
        "import sys, json\n"
        "import adaattn\n"
        f"print(json.dumps([m for m in {NOT_ON_IMPORT!r} if m in sys.modules]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    loaded = r.stdout.strip().splitlines()[-1]
    assert loaded == "[]", f"import adaattn imported {loaded}"


def _import_times(statement: str, pycache: Path) -> dict[str, int]:
    """Cumulative microseconds of each top-level import that `python -X importtime -c statement`
    makes, and of torch wherever it is imported first (nested under adaattn, say).

    Bytecode is cached in `pycache`: a package pip installs is byte-compiled at install time,
    and a user's second import reads the cache, so compiling our sources is not an import
    cost. CI sets PYTHONDONTWRITEBYTECODE, which without this made every one of these runs
    compile all of adaattn (about 0.2 s of a 1.8 s import)."""
    env = _env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    times = {"<total>": 0}
    for line in r.stderr.splitlines():
        parts = line.split("|")
        if not line.startswith("import time:") or len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        name = parts[2].strip()
        if name == "torch":
            times["torch"] = int(parts[1])
        if parts[2].startswith(" ") and not parts[2].startswith("  "):  # depth 0: one space
            times["<total>"] += int(parts[1])
    assert times["<total>"] > 0 and "torch" in times, f"no -X importtime output for {statement!r}"
    return times


@pytest.mark.slow  # four interpreter starts that each import torch: about 8 s on a 2-core CPU
def test_import_adaattn_costs_at_most_1_3x_import_torch(tmp_path):
    """What `import adaattn` adds to `import torch` (the interpreter's start-up and torch's own
    import measured in the same process, so a neighbour's load moves both alike) is at most
    30% of import torch."""
    _import_times("import adaattn", tmp_path)  # fills the bytecode cache
    runs = [_import_times("import adaattn", tmp_path) for _ in range(3)]
    ratio, run = min((t["<total>"] / t["torch"], t) for t in runs)
    assert ratio <= 1.3, (
        f"import adaattn took {run['<total>'] / 1e3:.0f} ms, of which import torch {run['torch'] / 1e3:.0f} ms "
        f"(ratio {ratio:.2f} > 1.3)")


def _api_tree() -> ast.Module:
    """Every module of the api package, as one tree."""
    body = []
    for path in sorted((SRC / "adaattn" / "api").glob("*.py")):
        body += ast.parse(path.read_text()).body
    return ast.Module(body=body, type_ignores=[])


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _is_runner_name(text: str) -> bool:
    return any(text == p or text.startswith(p + ".") for p in RUNNER_PREFIXES)


def test_api_has_no_runner_name_string():
    """DESIGN.md: api.py never names a runner (no `== "triton.quant"`, no "sdpa.cpu" default)."""
    tree = _api_tree()
    docs = _docstrings(tree)
    found = [
        (node.lineno, node.value) for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
        and _is_runner_name(node.value.strip())
    ]
    assert not found, f"api.py names runners: {found}"


def test_api_names_no_runner_constant():
    tree = _api_tree()
    found = []
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name is not None and (name == "QUANT" or name.startswith("QUANT_") or name.endswith("_QUANT")):
            found.append((node.lineno, name))
    assert not found, f"api.py refers to a runner's name constant: {found}"


def test_api_imports_no_runner_module():
    """api.py reaches runners only through the planner: it imports no runner's module."""
    tree = _api_tree()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mods = [node.module or ""] + [f"{node.module or ''}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        for m in mods:
            parts = m.strip(".").split(".")
            if any(p.startswith(("triton", "sdpa", "flash_attn", "reference", "runner", "quant")) for p in parts):
                found.append((node.lineno, m))
    assert not found, f"api.py imports runner modules: {found}"


def test_api_compares_nothing_with_a_runner_name():
    """No comparison in api.py has a string naming a runner on either side."""
    tree = _api_tree()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                for sub in ast.walk(side):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and _is_runner_name(sub.value):
                        found.append((node.lineno, sub.value))
    assert not found, f"api.py compares runner names: {found}"


def _package_imports() -> dict[str, set[str]]:
    """Every adaattn module and the adaattn modules it imports: module level and inside functions
    alike (an import inside a function is still a dependency; it only hides a circle)."""
    pkg = SRC / "adaattn"
    modules = {}
    for path in pkg.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here[:len(here) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                while t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in modules and t != mod and t != "adaattn":
                    graph[mod].add(t)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_package_imports_in_no_circle():
    """kv/decode <-> kv/sparse and adaptive/blocks <-> adaptive/rank_launch were circles hidden
    behind imports inside functions; they are gone, and a new one fails here."""
    graph = _package_imports()
    assert "adaattn.adaptive.rank_launch" in graph["adaattn.adaptive.blocks"]  # imports inside functions count
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_code_cites_notes_by_section_name_not_by_issue_number():
    """An issue number means nothing to a reader of the code: comments cite NOTES.md's sections."""
    import re

    found = [f"{p.relative_to(SRC)}:{i}" for p in sorted((SRC / "adaattn").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bissues? #?\d", line, re.I)]
    assert found == []


# Modules outside the planner (planner/) that may ask a runner's supports() directly, and why: none of them
# chooses a runner for a call.
SUPPORTS_CALLERS = {
    "adaattn/bench/suites/calibrate.py": "calibration times every runner that takes a shape; the planner reads "
                                          "the measurements",
}


def test_the_planner_is_the_only_module_that_chooses_a_runner():
    """Choosing a runner means asking runners whether they take a call (`.supports(`) and ordering
    them: only the planner (planner/) does it, for prefill, training, decode steps and ring blocks alike."""
    root = SRC / "adaattn"
    callers, orders = [], []
    for path in sorted(root.rglob("*.py")):
        rel = f"adaattn/{path.relative_to(root).as_posix()}"
        if rel.startswith("adaattn/planner/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "supports":
                if not (isinstance(node.func.value, ast.Call) and getattr(node.func.value.func, "id", "") == "super"):
                    callers.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr in ("KINDS", "_ORDERS"):
                orders.append(f"{rel}:{node.lineno}")
    assert [c for c in callers if c.split(":")[0] not in SUPPORTS_CALLERS] == []
    assert orders == []
    for module in SUPPORTS_CALLERS:  # a stale entry fails too
        assert any(c.startswith(module + ":") for c in callers), module


def test_docs_layout_lists_every_file_of_the_package():
    """docs/layout.md, the code as it stands, names each file under src/adaattn/ once, and no other."""
    import re

    text = (ROOT / "docs" / "layout.md").read_text()
    listed, folder = set(), None
    for line in text.splitlines():
        m = re.match(r"## `(adaattn(?:/[\w/]+)?)/`$", line)
        if m:
            folder = m.group(1)
            continue
        m = re.match(r"- `([\w.]+\.py)`:", line)
        if m and folder:
            listed.add(f"{folder}/{m.group(1)}")
    actual = {p.relative_to(SRC).as_posix() for p in (SRC / "adaattn").rglob("*.py")}
    assert sorted(actual - listed) == [] and sorted(listed - actual) == []


def test_one_default_scale():
    """SDPA's default scale is computed in one place, problem.default_scale (kernels aside: they take
    the scale as an argument)."""
    import re

    pattern = re.compile(r"\*\*\s*-0\.5|1(\.0)?\s*/\s*math\.sqrt\(")
    found = [f"{p.relative_to(SRC)}:{i}" for p in (SRC / "adaattn").rglob("*.py")
             if p.parent.name != "kernels" and p.relative_to(SRC).as_posix() != "adaattn/problem/__init__.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line.split("#")[0])]
    assert found == []


def test_one_relative_error():
    """Relative errors are computed in one place, backends/reference.relative_errors (and the
    squared-sum form beside it): no module divides a norm of a difference by a clamped norm itself."""
    import re

    pattern = re.compile(r"norm\(.*\)\s*/\s*.*norm\(|sqrt\(\)\s*/\s*.*\.sqrt\(\)\.clamp_min|/\s*ref\w*\.clamp_min\(1e-30\)")
    found = [f"{p.relative_to(SRC)}:{i}" for p in (SRC / "adaattn").rglob("*.py")
             if p.parent.name != "kernels" and p.name != "reference.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
