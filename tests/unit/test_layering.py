"""The library stays a library: the tooling (bench, faults, demo) lives beside it in
`weightsync_tools`, its dependencies (matplotlib, tqdm) are an extra, and no mock ships.

These read the source tree the tests import `weightsync` from (its `src/`), and run
`import weightsync` in a fresh interpreter on the same path.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import weightsync
from fresh_import import fresh_import

PACKAGE = Path(weightsync.__file__).parent
SRC = PACKAGE.parent
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
CONTRIBUTING = Path(__file__).resolve().parents[2] / "CONTRIBUTING.md"
TOOL_MODULES = ("matplotlib", "tqdm", "weightsync_tools", "weightsync.bench", "weightsync.demo")


def _is_under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _imports(path: Path) -> Iterator[tuple[str, bool]]:
    """(module imported, at module level?) for every import statement in `path`;
    `from a import b` yields both "a" and "a.b"."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in top_level
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, id(node) in top_level
            for alias in node.names:
                yield f"{node.module}.{alias.name}", id(node) in top_level


def test_import_weightsync_adds_no_tooling() -> None:
    """`import weightsync` and `python -m weightsync --help` (a fresh interpreter: fresh_import.py)
    import neither the tools nor their dependencies. torch itself imports tqdm (torch.hub), so
    what counts is what weightsync adds after `import torch`."""
    modules = fresh_import()
    added = [m for m in modules.added_by_weightsync if _is_under(m, TOOL_MODULES)]
    assert not added, f"import weightsync imported tooling: {added}"
    anywhere = [m for m in modules.after_help if _is_under(m, ("matplotlib", "weightsync_tools"))]
    assert not anywhere, anywhere


def test_tooling_is_not_in_the_weightsync_package() -> None:
    assert not (PACKAGE / "bench").exists(), "bench/ belongs in weightsync_tools, beside the library"
    assert not (PACKAGE / "demo").exists(), "demo/ belongs in weightsync_tools, beside the library"
    assert (SRC / "weightsync_tools" / "__init__.py").exists()


def test_the_library_never_imports_the_tools() -> None:
    """No module of weightsync imports matplotlib or tqdm; only the CLI imports
    weightsync_tools, and only inside the function that runs a subcommand."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        in_cli = path.parent == PACKAGE / "cli"
        for module, top_level in _imports(path):
            where = f"{path.relative_to(SRC)}: {module}"
            if _is_under(module, ("matplotlib", "tqdm")):
                problems.append(f"{where} (tools extra)")
            elif _is_under(module, ("weightsync_tools",)) and (not in_cli or top_level):
                problems.append(f"{where} (only weightsync.cli may, lazily)")
        if not in_cli and "weightsync_tools" in path.read_text():
            problems.append(f"{path.relative_to(SRC)} names weightsync_tools")
    assert not problems, "\n".join(problems)


def test_no_mock_in_src() -> None:
    """Fakes belong to tests; the fault rig injects faults by passing a wrapping
    transport (WeightSync(transport=FaultyTransport(...))), never by patching."""
    found = [f"{path.relative_to(SRC)}: {module}"
             for path in sorted(SRC.rglob("*.py"))
             for module, _ in _imports(path)
             if _is_under(module, ("mock", "unittest.mock"))]
    assert not found, found


def test_matplotlib_and_tqdm_are_the_tools_extra() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
                for r in requirements}

    assert not names(project["dependencies"]) & {"matplotlib", "tqdm"}, project["dependencies"]
    assert names(project["optional-dependencies"]["tools"]) >= {"matplotlib", "tqdm"}


RECORD_MODULES = ("weightsync.manifest", "weightsync.reports", "weightsync.links", "weightsync.dtypes",
                  "weightsync.change_encoding", "weightsync.errors")
"""The bottom layer: the records every layer passes (manifest, acks and reports, links,
dtype names, the encodings of a tensor's bytes in its bucket) and the error types."""


def test_the_records_import_only_each_other() -> None:
    """Every layer imports the records, so they import no weightsync module but each other,
    not even inside a function (nor the package root, whose `__init__` imports everything)."""
    paths = [SRC.joinpath(*record.split(".")).with_suffix(".py") for record in RECORD_MODULES]
    assert all(path.is_file() for path in paths), [str(p) for p in paths if not p.is_file()]
    found = [f"{path.relative_to(SRC)}: {module}"
             for path in paths
             for module, _ in _imports(path)
             if _is_under(module, ("weightsync",)) and not _is_under(module, RECORD_MODULES)]
    assert not found, found


def test_transports_import_neither_engines_nor_server() -> None:
    """Each transport module holds both its ends (trainer and engine side): engines and
    the server import transports, never the other way round, not even inside a function."""
    paths = sorted((PACKAGE / "transports").rglob("*.py"))
    assert paths
    found = [f"{path.relative_to(SRC)}: {module}"
             for path in paths
             for module, _ in _imports(path)
             if _is_under(module, ("weightsync.engines", "weightsync.server", "weightsync.push.sync"))]
    assert not found, found


def test_the_receiving_side_imports_no_engine_and_no_server() -> None:
    """The update session (`receive/update_session.py`) and the receive path (`receive/receive_path.py`:
    the one way bytes reach it) are shared by every engine: the vLLM worker extension and the
    embedded server import them, never the other way round, not even inside a function."""
    paths = (PACKAGE / "receive" / "update_session.py", PACKAGE / "receive" / "receive_path.py")
    assert all(path.is_file() for path in paths), paths
    found = [f"{path.relative_to(SRC)}: {module}"
             for path in paths
             for module, _ in _imports(path)
             if _is_under(module, ("weightsync.engines", "weightsync.server", "weightsync.push.sync",
                                   "weightsync.modes", "weightsync.cli"))]
    assert not found, found


def _calls(path: Path, attribute: str) -> list[tuple[int, str]]:
    """(line, the function it is in) of every call of a method named `attribute` in `path`."""
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == attribute:
                found.append((child.lineno, where))
            visit(child, where)

    visit(ast.parse(path.read_text(), filename=str(path)), "<module>")
    return found


def _callers(paths: list[Path], attribute: str) -> list[tuple[str, str]]:
    """(module path under src/, the function it is in) of every call of `attribute` in `paths`."""
    return [(str(path.relative_to(SRC)), where) for path in paths for _, where in _calls(path, attribute)]


def _definitions(paths: list[Path], name: str) -> list[str]:
    """The module path under src/ of every function or method named `name` in `paths`."""
    return [str(path.relative_to(SRC)) for path in paths for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name]


def test_every_staged_bucket_goes_through_the_receive_path() -> None:
    """One way in: every bucket an engine stages (http frames, shares, SGLang's broadcast, the
    group relay, shm, a disk version directory, a PEFT directory) reaches the update session
    through `ReceivePath.stage`, its one caller; no route, worker or tool calls
    `UpdateSession.stage_bucket`, nor wraps it under that name."""
    paths = sorted([*PACKAGE.rglob("*.py"), *(SRC / "weightsync_tools").rglob("*.py")])
    callers = _callers(paths, "stage_bucket")
    assert callers == [("weightsync/receive/receive_path.py", "stage")], (
        "buckets staged other than through ReceivePath.stage: " + ", ".join(f"{p} ({f})" for p, f in callers))
    assert _definitions(paths, "stage_bucket") == ["weightsync/receive/update_session.py"]


def test_a_call_around_the_receive_path_is_found(tmp_path: Path) -> None:
    path = tmp_path / "route.py"
    path.write_text("def route(state):\n    state.updater.stage_bucket(version=1)\n"
                    "    def work():\n        return updater.session.stage_bucket(version=1, index=0)\n"
                    "    state.receive_path.stage(version=1)\n")
    assert _calls(path, "stage_bucket") == [(2, "route"), (4, "work")]


def test_the_version_directory_check_is_written_once() -> None:
    """A disk version directory's manifest.json is checked against the manifest given at begin
    by one function (`formats.version_dir.check_announced`), for the vLLM worker's disk
    receiver and the embedded server alike: no other function compares manifests without
    their digests."""
    paths = sorted(PACKAGE.rglob("*.py"))
    assert _definitions(paths, "check_announced") == ["weightsync/formats/version_dir.py"]
    compared = _callers(paths, "without_digests")
    assert compared and set(compared) == {("weightsync/formats/version_dir.py", "check_announced")}, compared


def test_the_library_never_imports_the_integrations() -> None:
    """`weightsync.integrations` plugs weightsync into RL frameworks (verl, TRL) and imports
    them; no module outside it imports it, not even inside a function, so the library
    never needs a framework installed."""
    integrations = PACKAGE / "integrations"
    found = [f"{path.relative_to(SRC)}: {module}"
             for path in sorted(PACKAGE.rglob("*.py")) if integrations not in path.parents
             for module, _ in _imports(path)
             if _is_under(module, ("weightsync.integrations",))]
    assert not found, found


def test_engines_and_server_compare_no_transport_names() -> None:
    """The engine clients, the vLLM worker and the embedded server read the traits a
    transport's receiver declares (`joins_session`, `collective`, ...), never its name:
    a new transport is its module plus one registry line. Only string literals in code
    count (docstrings may name transports)."""
    found = []
    for path in sorted([*(PACKAGE / "engines").rglob("*.py"), *(PACKAGE / "server").rglob("*.py")]):
        tree = ast.parse(path.read_text(), filename=str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and id(node) not in docstrings and repr(node.value) in (
                    "'disk'", "'http'", "'broadcast'", "'shm'"):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value!r}")
    assert not found, "\n".join(found)


def _imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """weightsync modules `path` imports anywhere in its body (lazy imports included), with
    the packages whose `__init__` that runs (other than the root and `module`'s own)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    own = {module.rsplit(".", k)[0] for k in range(module.count(".") + 1)}
    for name in list(found):
        parts = name.split(".")
        found.update(p for i in range(2, len(parts)) if (p := ".".join(parts[:i])) in known and p not in own)
    return found


def test_no_import_cycle_not_even_a_lazy_one() -> None:
    """Between any two weightsync modules, imports go one way (a package's `__init__`
    counts as the package)."""
    paths = {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PACKAGE.rglob("*.py")}
    graph = {m: _imported_modules(m, p, set(paths)) - {m} for m, p in paths.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


COORDINATOR = ("push/sync.py", "push/replicas.py", "push/planning.py", "push/followers.py")


def test_the_coordinator_reads_declared_capabilities_only() -> None:
    """The coordinator (CONTRIBUTING.md) asks engines, transports and modes what they declare
    (`EngineCapabilities`, `Transport.same_host_only`, `PushMode.digests_from_parts`, ...): it
    never probes with `getattr`/`hasattr`, and never compares a value with a mode's or a
    transport's name."""
    from weightsync.manifest import MODES
    from weightsync.transports import TRANSPORTS

    names = {*TRANSPORTS, *MODES}
    assert all((PACKAGE / filename).is_file() for filename in COORDINATOR), COORDINATOR
    found = []
    for filename in COORDINATOR:
        path = PACKAGE / filename
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            probe = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if probe and node.func.id in ("getattr", "hasattr"):
                found.append(f"{filename}:{node.lineno}: {node.func.id}(...)")
            if isinstance(node, ast.Compare):
                for operand in (node.left, *node.comparators):
                    if isinstance(operand, ast.Constant) and operand.value in names:
                        found.append(f"{filename}:{node.lineno}: compares with {operand.value!r}")
    assert not found, "\n".join(found)


def _concrete_kinds() -> set[str]:
    """The classes of every transport and mode module (not of their `base` modules)."""
    names: set[str] = set()
    for folder in ("transports", "modes"):
        for path in (PACKAGE / folder).glob("*.py"):
            if path.stem not in ("__init__", "base"):
                names |= {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
    return names


def _kind_branches(text: str, filename: str, kinds: set[str]) -> list[str]:
    """Each `isinstance`/`issubclass` in `text` that names one of `kinds` among its classes."""
    found = []
    for node in ast.walk(ast.parse(text, filename=filename)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if named & kinds:
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_coordinator_branches_on_no_transport_or_mode_class() -> None:
    """Beside the names (above), the coordinator never tells a transport or a mode by its class:
    it reads what the `Transport` or `PushMode` declares."""
    kinds = _concrete_kinds()
    assert {"HttpTransport", "BroadcastTransport", "FullMode", "SparseMode"} <= kinds, sorted(kinds)
    found = [f for filename in COORDINATOR for f in _kind_branches((PACKAGE / filename).read_text(), filename, kinds)]
    assert not found, "branches on a transport's or mode's class (declare it instead):\n" + "\n".join(found)
    text = "def f(t, m):\n    if isinstance(t, (Transport, BroadcastTransport)):\n        pass\n" \
           "    return issubclass(type(m), modes.SparseMode) or isinstance(t, Transport)\n"
    assert [int(f.split(":")[1]) for f in _kind_branches(text, "f.py", kinds)] == [2, 4]


LONG_DOCSTRING_LINES = 15
"""A docstring this long is an essay: a module states its boundary in a few lines, design notes
go to docs/ (CONTRIBUTING.md)."""


def _long_docstrings(text: str, filename: str) -> list[str]:
    """Each module, class or function docstring in `text` of LONG_DOCSTRING_LINES source lines or more."""
    tree = ast.parse(text, filename=filename)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                lines = (first.end_lineno or first.lineno) - first.lineno + 1
                if lines >= LONG_DOCSTRING_LINES:
                    found.append(f"{filename}:{first.lineno}: {getattr(node, 'name', 'the module')}, {lines} lines")
    return found


def test_docstrings_state_their_boundary_in_a_few_lines() -> None:
    found = [f for path in sorted(PACKAGE.rglob("*.py"))
             for f in _long_docstrings(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert not found, "docstrings of 15+ lines (keep the boundary, design notes to docs/):\n" + "\n".join(found)
    essay = '"""One.\n' + "more\n" * 13 + '"""\n\ndef f():\n    """Short."""\n'
    assert _long_docstrings(essay, "e.py") == ["e.py:1: the module, 15 lines"]
    assert _long_docstrings(essay.replace("more\n", "", 1), "e.py") == []


FAN_OUT_WORDS = frozenset({"fan_out", "_fan_out", "send_shares", "shares", "relay", "relays", "chain", "in_group"})
"""Names and attributes that say which fan-out a push uses (a config field, a flag, the strategy)."""


def _fan_out_branches(text: str, filename: str) -> tuple[list[str], int]:
    """(each condition in `text` that reads a fan-out: a test of an `if`, `while`, `assert`,
    conditional expression or comprehension, an `and`/`or`, a comparison or a `match`
    subject naming one of FAN_OUT_WORDS (not as the function it calls) or a fan-out's name;
    how many conditions it read)."""
    from weightsync.push.fanout import FAN_OUTS

    conditions: list[ast.expr] = []
    for node in ast.walk(ast.parse(text, filename=filename)):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            conditions.append(node.test)
        elif isinstance(node, (ast.BoolOp, ast.Compare)):
            conditions.append(node)
        elif isinstance(node, ast.Match):
            conditions.append(node.subject)
        elif isinstance(node, ast.comprehension):
            conditions.extend(node.ifs)
    found = []
    for condition in conditions:
        called = {id(n.func) for n in ast.walk(condition) if isinstance(n, ast.Call)}  # `send_shares(...) or []`
        read = [n for n in ast.walk(condition) if id(n) not in called]
        words = {n.id for n in read if isinstance(n, ast.Name)} | {n.attr for n in read if isinstance(n, ast.Attribute)}
        words |= {n.value for n in ast.walk(condition) if isinstance(n, ast.Constant) and n.value in FAN_OUTS}
        if words & (FAN_OUT_WORDS | set(FAN_OUTS)):
            found.append(f"{filename}:{condition.lineno}: {ast.unparse(condition)}")
    return found, len(conditions)


def test_the_coordinator_has_no_branch_on_the_fan_out() -> None:
    """How a push fans out (direct, relay, shares) is a strategy chosen once when the sync is
    built (`push/fanout/`): the coordinator's rounds (`push/replicas.py`) and the push
    (`push/sync.py`) call it, and never branch on which fan-out is in use."""
    found = []
    for filename in ("push/replicas.py", "push/sync.py"):
        path = PACKAGE / filename
        branches, read = _fan_out_branches(path.read_text(), filename)
        assert read > 20, f"{filename}: only {read} conditions read"
        found += branches
    assert not found, "branches on the fan-out (put them in its strategy, push/fanout/):\n" + "\n".join(found)


def test_a_branch_on_the_fan_out_is_found() -> None:
    text = ("def f(self, config, e):\n"
            "    if self.relay:\n        pass\n"
            "    x = 1 if config.send_shares else 2\n"
            "    y = config.fan_out == 'relay'\n"
            "    z = [e for e in self.engines if self._fan_out.relays]\n"
            "    if e.ready and self.engines:\n        pass\n"
            "    return send_shares(e) or []\n")
    found, read = _fan_out_branches(text, "f.py")
    assert sorted(int(line.split(":")[1]) for line in found) == [2, 4, 5, 6], found
    assert read == 7


def test_vllm_plugin_and_package_import_no_engine_code() -> None:
    """vLLM runs the plugin (`engines.vllm.plugin:register`) in every one of its processes, so
    `engines/vllm/__init__.py` and `plugin.py` import nothing at module level; and of the package
    only the module vLLM's worker factory loads (`transfer_engine`; the trainer factory's,
    `integrations/vllm_trainer.py`, is outside it) imports vLLM at module level (the others
    import it inside the functions that need it)."""
    package = PACKAGE / "engines" / "vllm"
    assert all((package / name).is_file() for name in ("__init__.py", "plugin.py", "transfer_engine.py"))
    found = [f"{path.relative_to(SRC)}: {module}"
             for path in (package / "__init__.py", package / "plugin.py")
             for module, top_level in _imports(path) if top_level and module != "__future__"
             and not module.startswith("__future__.")]
    found += [f"{path.relative_to(SRC)}: {module} (import vLLM inside the function)"
              for path in sorted(package.glob("*.py")) if path.stem != "transfer_engine"
              for module, top_level in _imports(path) if top_level and _is_under(module, ("vllm",))]
    assert not found, "\n".join(found)


def top_level_units() -> set[str]:
    """The modules (`*.py` but `__init__` and `__main__`) and packages at the top of the package."""
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    return modules | packages


def _layers(text: str) -> list[list[str]]:
    """The backticked words of each item of the numbered list under "## Layering" in `text`
    (an item runs from its number to the next item or a blank line)."""
    parts = re.split(r"^## Layering$", text, maxsplit=1, flags=re.M)
    assert len(parts) == 2, "no '## Layering' section"
    section = re.split(r"^## ", parts[1], flags=re.M)[0]
    layers: list[list[str]] = []
    in_item = False
    for line in section.splitlines():
        if re.match(r"\d+\. ", line):
            layers.append([])
            in_item = True
        elif not line.strip():
            in_item = False
        if in_item:
            layers[-1] += re.findall(r"`([^`]+)`", line)
    return layers


def _named_unit(word: str) -> str | None:
    """The top-level module or package of src/weightsync a backticked path names (`probe.py`,
    `push/`, `push/sync.py`, `naming`); None for a path outside it (`src/...`) or a word
    that is no path (has a space). Raises AssertionError for a path that does not exist."""
    if " " in word or word.startswith("src/"):
        assert " " in word or (SRC.parent / word).exists(), f"CONTRIBUTING.md names {word}, which does not exist"
        return None
    path = PACKAGE / word.rstrip("/")
    assert path.is_file() or (path / "__init__.py").is_file() or path.with_suffix(".py").is_file(), (
        f"CONTRIBUTING.md's layers name `{word}`, which is no module or package of src/weightsync")
    return word.rstrip("/").split("/")[0].removesuffix(".py")


def test_every_module_stands_in_exactly_one_layer() -> None:
    """CONTRIBUTING.md's layer list names every module and package at the top of
    src/weightsync (as its path there, in backticks) in exactly one layer, and names nothing
    that does not exist: a module added, moved or removed shows here."""
    layers = _layers(CONTRIBUTING.read_text(encoding="utf-8"))
    assert len(layers) >= 3, f"no numbered layer list under '## Layering' in {CONTRIBUTING}"
    named = [{unit for word in words if (unit := _named_unit(word)) is not None} for words in layers]
    units = top_level_units()
    assert len(units) > 10, units
    missing = sorted(units - set().union(*named))
    assert not missing, f"in no layer of CONTRIBUTING.md: {missing}"
    twice = sorted(u for u in units if sum(u in layer for layer in named) > 1)
    assert not twice, f"in more than one layer of CONTRIBUTING.md: {twice}"


def test_the_layer_list_is_read_from_its_items_and_refuses_a_stale_path() -> None:
    text = "## Layering\n\n1. `manifest.py`, `push/`;\n2. `push/sync.py`\n\n`cli/` is not in a layer\n## Next\n"
    layers = _layers(text)
    assert layers == [["manifest.py", "push/"], ["push/sync.py"]]
    assert [_named_unit(w) for w in layers[0] + layers[1]] == ["manifest", "push", "push"]
    for stale in ("sync.py", "push/gone.py", "nope/"):
        with pytest.raises(AssertionError, match="no module or package"):
            _named_unit(stale)


ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"
PATH_WORD = re.compile(r"(?<![\w/.-])(\w+(?:\.py|/))(?!\w)")
"""A module (`name.py`) or package (`name/`) in the code map."""


def _code_map(text: str) -> list[str]:
    """The paths, relative to src/weightsync, that the code map under "## Layout" names: the
    tree below its `src/weightsync/` line, where a package (`name/`) holds the modules after it
    on its line and on the lines indented deeper than it."""
    block = re.split(r"^## Layout$", text, maxsplit=1, flags=re.M)[1].split("```")[1]
    lines = block.splitlines()
    start = lines.index("src/weightsync/") + 1
    paths: list[str] = []
    open_packages: list[tuple[int, str]] = []  # (indent of the line that opened it, its path)
    for line in lines[start:]:
        indent = len(line) - len(line.lstrip())
        if line.strip() and indent == 0:
            break
        while open_packages and open_packages[-1][0] >= indent:
            open_packages.pop()
        base = open_packages[-1][1] if open_packages else ""
        for word in PATH_WORD.findall(line):
            paths.append(base + word)
            if word.endswith("/"):
                base += word
                open_packages.append((indent, base))
    return paths


def test_architecture_names_only_paths_that_exist_and_maps_every_module() -> None:
    """docs/ARCHITECTURE.md's `src/weightsync/...` and `weightsync/<module>.py` paths exist, and
    its code map (## Layout) names every module and package at the top of src/weightsync, and
    nothing that is not in the tree."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    named = re.findall(r"(?<![\w/.-])((?:src/)?weightsync(?:_tools)?/[\w/]*(?:\.py)?)", text)
    assert any(n.startswith("src/weightsync/") for n in named), named
    gone = sorted({n for n in named if not (SRC.parent / n if n.startswith("src/") else SRC / n).exists()})
    assert not gone, f"docs/ARCHITECTURE.md names paths that do not exist: {gone}"
    mapped = _code_map(text)
    stale = [p for p in mapped if not (PACKAGE / p).is_file() and not (PACKAGE / p / "__init__.py").is_file()]
    assert not stale, f"the code map of docs/ARCHITECTURE.md names what is not in src/weightsync: {stale}"
    top = {p.rstrip("/").removesuffix(".py") for p in mapped if p.rstrip("/").count("/") == 0}
    missing = sorted(top_level_units() - top)
    assert not missing, f"not in the code map of docs/ARCHITECTURE.md: {missing}"


def test_the_code_map_is_read_as_a_tree() -> None:
    text = ("## Layout\n\n```\nsrc/weightsync/\n  a.py b.py   records\n  push/  sync.py  the push\n"
            "             cleanup.py  after\n    vllm/  x.py\n  cli/  one module per command, and/or /weightsync/*\n"
            "  c.py\nsrc/weightsync_tools/\n  bench/\n```\n")
    assert _code_map(text) == ["a.py", "b.py", "push/", "push/sync.py", "push/cleanup.py", "push/vllm/",
                               "push/vllm/x.py", "cli/", "c.py"]


CONNECTION_STATE: dict[str, dict[str, str]] = {
    "SGLangEngine": {
        "_http": "the connection to the server",
        "_serve": "the client of weightsync serve's own verbs, where the server has its routes (probed once, "
                  "with the capabilities)",
        "_capabilities": "what the server declared (asked once)",
        "_layout": "the layout digest the server remembers across pushes (what the engine knows, not a push)",
        "_quantization": "what a stock SGLang serves quantized, read from its checkpoint when the client is built",
    },
    "VLLMEngine": {
        "_backend": "the connection to the engine (its server or its in-process LLM)",
        "_num_ranks": "the engine's TP x PP, given or asked once",
        "_warned_unreset": "a prefix cache left unreset was logged once at WARNING (a log's state)",
    },
}
"""Every attribute an engine client may set after it is built, or privately at all: what it
knows of its engine and its connection, never what a push has done (that is the push's
`EngineUpdate`, which the coordinator holds: `engines/base.py`). A new entry needs its reason."""

_MUTATORS = frozenset({"append", "add", "update", "pop", "popitem", "clear", "setdefault", "extend", "remove",
                       "discard", "insert"})


def _self_state_writes(cls: ast.ClassDef) -> list[tuple[str, str, int]]:
    """(method, attribute, line) for every write to an attribute of `self` in `cls`'s methods:
    assigned (plainly, augmented, annotated, unpacked), an item of it assigned or deleted, or a
    mutating method of it called (`self._open.append(...)`)."""

    def attribute_of_self(node: ast.expr) -> str | None:
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr
        return None

    writes = []
    for method in cls.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(method):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = list(node.targets)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in _MUTATORS):
                targets = [node.func.value]
            flat: list[ast.expr] = []
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets.extend(target.elts)
                elif isinstance(target, ast.Starred):
                    targets.append(target.value)
                else:
                    flat.append(target)
            for target in flat:
                attr = attribute_of_self(target)
                if attr is not None:
                    writes.append((method.name, attr, node.lineno))
    return writes


def _per_push_state(texts: dict[str, str], allowed: dict[str, dict[str, str]]) -> tuple[list[str], list[str]]:
    """(each write, in the modules `texts` (filename -> source), to an engine client's attribute
    that is not connection state; the engine clients found). An engine client: a class with
    the verbs `capabilities`, `begin`, `commit` and `abort`, or a subclass of one (in any of
    the modules). Outside the constructor (`__init__`, `_init_state`) a client may set only
    `allowed[its name]` (its bases' too), and no private attribute anywhere but those."""
    classes = [(filename, node) for filename, text in texts.items()
               for node in ast.walk(ast.parse(text, filename=filename)) if isinstance(node, ast.ClassDef)]
    clients: dict[str, set[str]] = {}
    while True:  # subclasses of clients, whatever the order the modules define them in
        before = len(clients)
        for _, cls in classes:
            methods = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            bases = [b.id for b in cls.bases if isinstance(b, ast.Name)]
            if cls.name not in clients and ({"capabilities", "begin", "commit", "abort"} <= methods
                                            or any(b in clients for b in bases)):
                clients[cls.name] = set(allowed.get(cls.name, {})).union(*(clients.get(b, set()) for b in bases))
        if len(clients) == before:
            break
    found = []
    for filename, cls in classes:
        if cls.name not in clients:
            continue
        for method, attr, line in _self_state_writes(cls):
            constructing = method in ("__init__", "_init_state")
            if attr not in clients[cls.name] and (attr.startswith("_") or not constructing):
                found.append(f"{filename}:{line}: {cls.name}.{method} sets self.{attr}")
    return found, sorted(clients)


def test_engine_clients_keep_no_per_push_state() -> None:
    """An engine client keeps what it knows of its engine (its connection, the capabilities it
    probed), never what a push has done with it: where it paused, whether its commit resumed
    it, the update open, the trainer that began it. That is the push's `EngineUpdate`, which
    the coordinator holds and hands to every verb (`engines/base.py`), so the coordinator, not
    the client, decides the pause and the order of the commits."""
    texts = {str(path.relative_to(PACKAGE)): path.read_text() for path in sorted((PACKAGE / "engines").rglob("*.py"))}
    found, clients = _per_push_state(texts, CONNECTION_STATE)
    assert {"SGLangEngine", "VLLMEngine", "VLLMTransferEngine"} <= set(clients), clients
    assert set(CONNECTION_STATE) <= set(clients), f"allowed state of a client that is gone: {CONNECTION_STATE}"
    assert not found, ("engine clients keep per-push state (put it in the push's EngineUpdate, or, if it is what "
                       "the client knows of its engine, in CONNECTION_STATE with its reason):\n" + "\n".join(found))


def test_per_push_state_in_an_engine_client_is_found() -> None:
    text = ("class Client:\n"
            "    def __init__(self):\n        self.url = 'u'\n        self._http = None\n        self._open = None\n"
            "    def capabilities(self, t): ...\n"
            "    def begin(self, m, u):\n        self._open, self._owner = m.version, m.owner\n"
            "    def pause(self, p):\n        self._paused[p] = True\n        self.last_pause = p\n"
            "    def commit(self, m, u):\n        self._acks.append(m)\n        self._http = 1\n"
            "    def abort(self, u): ...\n"
            "class Serve(Client):\n"
            "    def relay(self, b):\n        self._forwarding += 1\n        self._http = 2\n"
            "class NotAClient:\n    def begin(self):\n        self._open = 1\n")
    other = "class Other(Serve):\n    def x(self):\n        self._y = 1\n"
    found, clients = _per_push_state({"f.py": text, "g.py": other}, {"Client": {"_http": "the connection"}})
    assert clients == ["Client", "Other", "Serve"]
    assert [f.split(": ", 1)[1] for f in found] == [
        "Client.__init__ sets self._open", "Client.begin sets self._owner", "Client.begin sets self._open",
        "Client.pause sets self._paused", "Client.pause sets self.last_pause", "Client.commit sets self._acks",
        "Serve.relay sets self._forwarding", "Other.x sets self._y"], found


SERVE_ONLY_VERBS = frozenset({"relay", "relay_in_group", "wait_relayed", "relay_error", "receive_share", "rollback",
                              "instance"})
"""What only `weightsync serve` does beyond an update (`Relayer`, `ShareReceiver`, `Rollbacker`,
`DigestReader`; `digests` stays on `SGLangEngine` as the user's reading, delegated)."""
SGLANG_WEIGHTSYNC_REQUESTS = frozenset({"INFO_ROUTE", "AbortRequest", "BeginRequest", "CommitRequest", "ReceiveRequest",
                                        "WeightsyncRequest"})
"""The weightsync routes `engines/sglang.py` calls: its probe and an update's (begin, receive over
shm, commit, abort); the others are `engines/serve.py`'s."""


def test_what_only_weightsync_serve_does_lives_in_its_own_client() -> None:
    """`SGLangEngine` speaks SGLang's API, plus an update's weightsync routes where its probe found
    `weightsync serve`; what only weightsync serve does is `engines/serve.py`'s client, which
    `SGLangEngine.extension` hands out after the probe and the coordinator calls where the engine
    declared it (`EngineCapabilities`), never assumed from the client's class."""
    from weightsync.engines.base import DigestReader, Relayer, Rollbacker, ShareReceiver
    from weightsync.engines.json_client import JsonClient
    from weightsync.engines.serve import ServeClient
    from weightsync.engines.sglang import SGLangEngine

    path = PACKAGE / "engines" / "sglang.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SGLangEngine")
    verbs = {n.name for n in engine.body if isinstance(n, ast.FunctionDef)} & SERVE_ONLY_VERBS
    assert not verbs, f"SGLangEngine defines weightsync serve's verbs {sorted(verbs)}: move them to engines/serve.py"
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "weightsync.protocol" for alias in node.names}
    assert imported <= SGLANG_WEIGHTSYNC_REQUESTS, sorted(imported - SGLANG_WEIGHTSYNC_REQUESTS)
    literals = [node.lineno for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and "/weightsync/" in node.value
                and node.value.lstrip().startswith("/weightsync/")]
    assert not literals, f"engines/sglang.py names weightsync routes at lines {literals}: use weightsync.protocol"
    protocols = (Relayer, ShareReceiver, Rollbacker, DigestReader)
    engine_client = SGLangEngine("http://127.0.0.1:1")  # nothing is sent: no verb is called
    http = JsonClient(engine_client.url, timeout_s=1.0)
    serve = ServeClient(http, url=engine_client.url, label="serve", timeout_s=1.0)
    try:
        assert not any(isinstance(engine_client, p) for p in protocols), "SGLangEngine passes for weightsync serve"
        assert all(isinstance(serve, p) for p in protocols)
    finally:
        engine_client.close()
        http.close()
