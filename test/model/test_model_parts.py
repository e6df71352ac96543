"""The model's parts are objects behind small typed interfaces, and every name has one home: ModelBackend owns its
caches, SEMANTIC passes, chat prompts, kernel paths and load checks, LlamaRunner its layer steps and early passes,
each made from the values it needs; none reaches into another's private members; a name is imported from the
module that defines it (no re-exports, no underscore names across modules); a function-local import says which
cost it defers (import cycles: test/project/test_import_graph.py). Syntax-tree and signature checks: no model is
loaded."""
from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

import simllm_ros
from simllm_ros.model import llama_runner, load_checks, model_backend, runner_early
from simllm_ros.model.llama_runner import LlamaRunner
from simllm_ros.model.model_backend import ModelBackend

PACKAGE = pathlib.Path(simllm_ros.__file__).parent
MODEL = PACKAGE / "model"
ROOT = PACKAGE.parent


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _module_of(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _defined(path: pathlib.Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments), not those it imports."""
    names: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.col_offset == 0:
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.col_offset == 0:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _file_of(module: str) -> pathlib.Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports_from_package(path: pathlib.Path):
    """(line, module, name) of every `from <simllm_ros module> import name` in a file, relative ones resolved."""
    here = _module_of(path).split(".") if path.is_relative_to(PACKAGE) else []
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(_tree(path)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[:len(package) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if module.split(".")[0] != "simllm_ros" or _file_of(module) is None:
            continue
        for alias in node.names:
            if _file_of(f"{module}.{alias.name}") is None:  # a name, not a submodule
                yield node.lineno, module, alias.name


def _sources() -> list[pathlib.Path]:
    tests = ROOT / "test"
    return sorted(PACKAGE.rglob("*.py")) + (sorted(tests.rglob("*.py")) if tests.is_dir() else [])


def test_the_backend_and_the_runner_are_composed_not_mixed_in():
    """No mixins: the parts are attributes (their public operations kept on the backend for serving/ and ros/)."""
    assert ModelBackend.__bases__ == (object,) and LlamaRunner.__bases__ == (object,)
    owned = {ModelBackend: ("caches", "semantic", "chat", "paths", "checks"), LlamaRunner: ("steps", "early")}
    for cls, parts in owned.items():
        init = inspect.getsource(cls)
        for part in parts:
            assert f"self.{part} = " in init, f"{cls.__name__} does not own a {part}"


@pytest.mark.parametrize("cls", [ModelBackend, LlamaRunner])
def test_the_constructors_are_named_steps(cls):
    """__init__ reads as the load's steps, each a method of its own (206 and 166 lines before)."""
    lines = inspect.getsource(cls.__init__).count("\n")
    assert lines <= 70, f"{cls.__name__}.__init__ is {lines} lines"


@pytest.mark.parametrize("holder, interface", [(ModelBackend, load_checks.ModelPasses),
                                               (LlamaRunner, runner_early.RunnerPass)])
def test_each_part_s_interface_is_what_its_owner_offers(holder, interface):
    """LoadChecks runs passes through ModelPasses (the backend), EarlyPasses through RunnerPass (the runner): a
    member renamed or a parameter changed on the owner fails here rather than at a load."""
    members = [n for n in vars(interface) if not n.startswith("_")]
    annotated = list(getattr(interface, "__annotations__", {}))
    assert members or annotated
    for name in members:
        want = list(inspect.signature(getattr(interface, name)).parameters)
        got = list(inspect.signature(getattr(holder, name)).parameters)
        assert got == want, f"{holder.__name__}.{name}{got} does not take {interface.__name__}.{name}'s {want}"
    source = inspect.getsource(holder)
    for name in annotated:  # attributes the owner sets
        assert f"self.{name} = " in source, f"{holder.__name__} has no {name}"


def test_no_part_reaches_into_another_s_private_members():
    """In model/, `self.<part>._<name>` never appears: a part's own state is its business (self._x is fine)."""
    bad = []
    for path in sorted(MODEL.glob("*.py")):
        for n in ast.walk(_tree(path)):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__") \
                    and isinstance(n.value, ast.Attribute) and isinstance(n.value.value, ast.Name) \
                    and n.value.value.id == "self":
                bad.append(f"{path.name}:{n.lineno}: self.{n.value.attr}.{n.attr}")
    assert not bad, bad


def test_names_are_imported_from_their_home():
    """Everywhere (package and tests): a name taken from a model/ module (or serving.engine) is defined there, not
    re-exported; and no underscore name is imported from another simllm_ros module."""
    owned = ("simllm_ros.model", "simllm_ros.serving.engine")
    reexported, private = [], []
    for path in _sources():
        for line, module, name in _imports_from_package(path):
            where = f"{path.relative_to(ROOT)}:{line}: {module}.{name}"
            if name.startswith("_"):
                private.append(where)
            source = _file_of(module)
            if module.startswith(owned) and source is not None and name not in _defined(source):
                reexported.append(where)
    assert not private, private
    assert not reexported, reexported


def test_function_local_imports_say_which_cost_they_defer():
    """An import inside a function only where it defers a real cost (transformers, gguf, jsonschema, xgrammar), with
    a `# deferred: ...` comment on its line or the line above."""
    bare = []
    for path in sorted(MODEL.glob("*.py")):
        lines = path.read_text().split("\n")
        for fn in ast.walk(_tree(path)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    said = lines[node.end_lineno - 1] + lines[node.lineno - 2]
                    if "# deferred:" not in said:
                        bare.append(f"{path.name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not bare, bare


def test_the_modules_the_checks_read_are_the_ones_in_use():
    """The checks above read these files: a module moved out of model/ must take its checks along."""
    for module in (model_backend, llama_runner, load_checks, runner_early):
        assert pathlib.Path(module.__file__).parent == MODEL
