"""House rules the code is read for (``ast``), not run for.

* A codec is named only in its own file: every other module reaches it through the
  :class:`~tagc.hooks.codecs.codec.Codec` interface (its attributes, its all-reduce form, ...), so a codec
  plugs in without a branch on its class anywhere else. The registry, which builds each codec once, is
  the one exception; a class statement may name the codec base it extends (that is how a codec is
  written, ``class SignCodec(ResidualCodec)``).
* No module reads another module's private names (``x._name``, ``from m import _name``): what crosses a
  module boundary is public and documented. Torch's own privates are the fenced internals modules'
  business (``torch_*.py``, :mod:`tests.test_torch_internals`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.source_tree import ROOT, modules

CODEC_PACKAGE = "tagc.hooks"
"""Where codecs live: every class there that extends ``Codec``, directly or through another codec class."""
CODEC_ROOTS = ("tagc", "fsdp_integration", "backward_drain", "gpt2_bench", "testbed")
"""The code that must not name a codec class outside the codec's own file."""
REGISTRY = "tagc.hooks.codecs.registry"
"""Builds every registered codec from its spec: the one module that may name them all."""
PRIVATE_ROOTS = ("tagc", "fsdp_integration", "backward_drain")
"""The library code whose modules must not read each other's private names."""
DOCUMENTED = {("os", "_exit")}
"""Underscored but documented names of Python's standard library (``os._exit``: exit without cleanup)."""


def _trees(packages) -> dict[str, tuple[Path, ast.Module]]:
    return {name: (path, ast.parse(path.read_text(), str(path))) for name, path in modules(packages).items()}


def _codec_classes(trees: dict[str, tuple[Path, ast.Module]]) -> dict[str, str]:
    """``{class name: defining module}`` of every subclass of ``Codec`` under :data:`CODEC_PACKAGE`, by the names
    in the class statements' bases (to a fixed point: a codec may extend another codec class)."""
    bases: dict[str, tuple[str, set[str]]] = {}
    for module, (_, tree) in trees.items():
        if module.startswith(CODEC_PACKAGE + "."):
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    bases[node.name] = (module, {_last_name(base) for base in node.bases})
    found = {"Codec": bases["Codec"][0]}
    grew = True
    while grew:
        grew = False
        for name, (module, parents) in bases.items():
            if name not in found and parents & set(found):
                found[name] = module
                grew = True
    return {name: module for name, module in found.items() if name != "Codec"}


def _last_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def codec_names_outside_their_files(trees: dict[str, tuple[Path, ast.Module]],
                                    codecs: dict[str, str]) -> list[str]:
    """``module:line names Class`` for each name, attribute or import of a codec class outside its own module (and
    the registry), a class statement's bases aside (and the import of a class only extended there)."""
    wrong = []
    for module, (_, tree) in trees.items():
        if module == REGISTRY:
            continue
        nodes = list(ast.walk(tree))
        bases = {id(part) for node in nodes if isinstance(node, ast.ClassDef)
                 for base in node.bases for part in ast.walk(base)}
        names = {node.id for node in nodes if isinstance(node, ast.Name)}
        used = {node.id for node in nodes if isinstance(node, ast.Name) and id(node) not in bases}
        for node in nodes:
            named = []
            if isinstance(node, ast.Name) and id(node) not in bases:
                named = [node.id]
            elif isinstance(node, ast.Attribute) and id(node) not in bases:
                named = [node.attr]
            elif isinstance(node, ast.ImportFrom):
                named = [alias.name for alias in node.names
                         if (alias.asname or alias.name) in used or (alias.asname or alias.name) not in names]
            wrong += [f"{module}:{node.lineno} names {name}" for name in named
                      if name in codecs and codecs[name] != module]
    return sorted(set(wrong))


def test_codec_classes_are_named_only_in_their_files():
    trees = _trees((CODEC_PACKAGE.replace(".", "/"),))
    codecs = _codec_classes(trees)
    assert {"TAGCCodec", "PowerSGDCodec", "EF21Codec", "TopKCodec", "SignCodec", "PlainCodec"} <= set(codecs)
    assert codec_names_outside_their_files(_trees(CODEC_ROOTS), codecs) == []


def test_the_codec_walk_sees_a_branch_on_a_codec_class():
    source = ("from tagc.hooks.codecs.codec import ResidualCodec, TAGCCodec\nfrom tagc.hooks import powersgd\n"
              "class Mine(ResidualCodec):\n    pass\n"
              "def f(codec):\n    return isinstance(codec, TAGCCodec) or isinstance(codec, powersgd.PowerSGDCodec)\n")
    trees = {"tagc.hooks.mine": (Path("mine.py"), ast.parse(source))}
    codecs = {"ResidualCodec": "tagc.hooks.codecs.codec", "TAGCCodec": "tagc.hooks.codecs.codec",
              "PowerSGDCodec": "tagc.hooks.codecs.powersgd"}
    assert codec_names_outside_their_files(trees, codecs) == [
        "tagc.hooks.mine:1 names TAGCCodec", "tagc.hooks.mine:6 names PowerSGDCodec",
        "tagc.hooks.mine:6 names TAGCCodec"]


# ---------------------------------------------------------------------------------------------- private names


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _fenced(path: Path) -> bool:
    """A torch internals module: the one place a torch private may be named (:mod:`tests.test_torch_internals`)."""
    return path.name.startswith("torch_")


def _defined(tree: ast.Module) -> set[str]:
    """Every name ``tree`` defines: functions, classes, arguments, names and attributes it assigns (``self._x = ``,
    ``obj._x = ``), names it imports under an alias."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
    return names


def _torch_names(tree: ast.Module) -> set[str]:
    """Local names bound to torch or one of its modules or values (``import torch``, ``import torch.distributed as
    dist``, ``from torch._x import y``), and names assigned from such a chain (``opdef = OPDEFS.get(name)``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            names.update(alias.asname or alias.name for alias in node.names)
    assigned = [(node.targets[0].id, _root(node.value)) for node in ast.walk(tree)
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)]
    grew = True
    while grew:
        before = len(names)
        names.update(target for target, root in assigned
                     if isinstance(root, ast.Name) and root.id in names and root.id != target)
        grew = len(names) > before
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node


def private_accesses(module: str, path: Path, tree: ast.Module, package_modules: set[str]) -> Iterator[str]:
    """``module:line what`` for each read of another module's private name: ``x._name`` (``x`` not ``self`` or
    ``cls``) and ``from m import _name`` where ``_name`` is defined nowhere in this module. Exempt: chains rooted at
    torch (its privates are :mod:`tests.test_torch_internals`' business), everything in a fenced ``torch_*.py``
    module, and a package's private submodule imported inside that package."""
    if _fenced(path):
        return
    defined, torch_names = _defined(tree), _torch_names(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            for alias in node.names:
                if not _is_private(alias.name) or source.split(".")[0] == "torch":
                    continue
                if source == package and f"{source}.{alias.name}" in package_modules:
                    continue  # a package-private submodule, imported by a module of that package
                yield f"{module}:{node.lineno} from {source} import {alias.name}"
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in defined:
            root = _root(node.value)
            if isinstance(root, ast.Name) and (root.id in ("self", "cls") or root.id in torch_names
                                               or (root.id, node.attr) in DOCUMENTED):
                continue
            yield f"{module}:{node.lineno} {ast.unparse(node)[:80]}"


def test_no_private_cross_module_access():
    found = modules(PRIVATE_ROOTS)
    wrong = []
    for module, path in found.items():
        wrong += private_accesses(module, path, ast.parse(path.read_text(), str(path)), set(found))
    assert sorted(wrong) == []


def test_the_private_walk_sees_reads_of_other_modules_privates():
    source = ("import os, sys\nimport torch\nimport torch.distributed as dist\nfrom tagc.hooks.core.engine import _Part\n"  # noqa: E501
              "from tagc.kernels import _numba\n"
              "class A:\n    def __init__(self):\n        self._mine = 1\n"
              "    def f(self, hook, other):\n"
              "        return (hook._plan, other._mine, self._x, torch._C._get, dist._secret, sys._getframe(),\n"
              "                torch.cuda._sleep(1)._y, os._exit)\n"
              "def g(name):\n    from torch._library.custom_ops import OPDEFS\n"
              "    opdef = OPDEFS.get(name)\n    return opdef._init_fn\n")
    got = sorted(private_accesses("tagc.kernels.cpu", Path("cpu.py"), ast.parse(source),
                                {"tagc.kernels._numba", "tagc.kernels.cpu"}))
    assert got == sorted(["tagc.kernels.cpu:4 from tagc.hooks.core.engine import _Part", "tagc.kernels.cpu:10 hook._plan",  # noqa: E501
                          "tagc.kernels.cpu:10 sys._getframe"])
    assert list(private_accesses("tagc.hooks.torch_x", Path("torch_x.py"), ast.parse(source), set())) == []
    assert ROOT.is_dir()


def test_core_imports_no_adapter():
    """The engine's room imports no adapter, at module level or inside a function: adapters plug into it
    (``tagc.hooks.core.engine.ADAPTERS``)."""
    import ast
    from pathlib import Path

    core = Path(__file__).resolve().parent.parent / "tagc" / "hooks" / "core"
    found = []
    for path in sorted(core.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {name}" for name in names if name.startswith("tagc.hooks.adapters")]
    assert len(list(core.glob("*.py"))) > 10 and not found, found
