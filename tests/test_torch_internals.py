"""Private torch names live in one module per integration, each checked against the torch versions tested.

(a) A static walk (``ast``) of every module of ``tagc``, ``fsdp_integration`` and ``backward_drain``:
no module but the integration's internals module names a private torch attribute or module (as an
attribute, an import, or a string handed to ``getattr``), and each name below is used in an
internals module (so the list cannot go stale unnoticed).

(b) Each internals module's ``check_torch()``: silent on the torch this runs on; one warning per process naming the
version and the supported range when ``torch.__version__`` is outside it; the documented error when a name it needs
is gone (under every name a release gave it); and the same error where a name read at run time is missing.

CI runs this module on the oldest and the newest supported torch too (``pytest -m torch_range``).
"""

from __future__ import annotations

import ast
import importlib
import re
import types
import warnings

import pytest
import torch

from backward_drain import torch_versions
from backward_drain.torch_versions import PIN, TESTED_TORCH, TorchInternalsError, alternatives, resolve
from tests.source_tree import ROOT, modules

pytestmark = pytest.mark.torch_range

PACKAGES = ("tagc", "fsdp_integration", "backward_drain", "gpt2_bench")

PRIVATE = {
    # FSDP2 (fully_shard)
    "_fully_shard": "tagc.hooks.adapters.torch_fsdp2", "_fsdp_api": "tagc.hooks.adapters.torch_fsdp2",
    "_fsdp_common": "tagc.hooks.adapters.torch_fsdp2", "_get_fsdp_state": "tagc.hooks.adapters.torch_fsdp2",
    "_fsdp_param_groups": "tagc.hooks.adapters.torch_fsdp2", "_fsdp_param_group": "tagc.hooks.adapters.torch_fsdp2",
    "_module_info": "tagc.hooks.adapters.torch_fsdp2",
    "_param_fqn": "tagc.hooks.adapters.torch_fsdp2", "_orig_size": "tagc.hooks.adapters.torch_fsdp2",
    "_all_reduce_hook": "tagc.hooks.adapters.torch_fsdp2", "_local_tensor": "tagc.hooks.adapters.torch_fsdp2",
    "_post_accumulate_grad_hooks": "tagc.hooks.adapters.torch_fsdp2",
    # FSDP1 (FullyShardedDataParallel)
    "_handle": "tagc.hooks.adapters.torch_fsdp1", "_fqns": "tagc.hooks.adapters.torch_fsdp1", "_numels": "tagc.hooks.adapters.torch_fsdp1",  # noqa: E501
    "_shapes": "tagc.hooks.adapters.torch_fsdp1", "_sharded_size": "tagc.hooks.adapters.torch_fsdp1",
    "_comm_hook": "tagc.hooks.adapters.torch_fsdp1", "_comm_hook_state": "tagc.hooks.adapters.torch_fsdp1",
    "_reduce_dtype": "tagc.hooks.adapters.torch_fsdp1", "_flat_param": "tagc.hooks.adapters.torch_fsdp1",
    # DDP
    "_has_rebuilt_buckets": "tagc.hooks.adapters.torch_ddp",
    # the autograd engine (the backward drain)
    "_C": "backward_drain.torch_autograd", "_current_graph_task_id": "backward_drain.torch_autograd",
    "_execution_engine": "backward_drain.torch_autograd",
    # tracing and compiling
    "_subclasses": "tagc.kernels.torch_tracing", "_functorch": "fsdp_integration.torch_internals",
    "_inductor": "fsdp_integration.torch_internals", "_dynamo": "fsdp_integration.torch_internals",
    "_version": "fsdp_integration.torch_internals",
}
"""Each private torch name, and the one internals module allowed to use it."""

SEMI_PUBLIC = {"_functional_collectives": ("fsdp_integration.torch_internals", "tagc.hooks.adapters.torch_simple_fsdp")}
"""Underscored but the documented home of the traceable collectives: one internals module per integration that
uses it (``fsdp_integration`` and ``tagc`` may not import each other)."""

INTERNALS = ("backward_drain.torch_autograd", "fsdp_integration.torch_internals", "tagc.hooks.adapters.torch_fsdp2",
             "tagc.hooks.adapters.torch_fsdp1", "tagc.hooks.adapters.torch_ddp", "tagc.hooks.adapters.torch_simple_fsdp",  # noqa: E501
             "tagc.kernels.torch_tracing")


def private_uses(source: str, names: set[str]) -> set[tuple[str, int]]:
    """``(name, line)`` for each use of a name in ``names`` in ``source``: an attribute (``x._name``), a part of
    an imported module (``import torch._x``, ``from torch._x import y``, ``from torch import _x``), a string
    constant that is exactly the name (``getattr(x, "_name")``), or a part of a string that is a dotted torch path
    (``"torch._x.y"``, ``"torch.a.C:_x"``, ``"torch.a._x|_y"``: what ``importlib`` or a check resolves). Docstrings,
    which only mention names, are not uses."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.add((node.attr, node.lineno))
        elif isinstance(node, ast.Import):
            found.update((part, node.lineno) for alias in node.names for part in alias.name.split(".") if part in names)
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".") + [alias.name for alias in node.names]
            found.update((part, node.lineno) for part in parts if part in names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in names:
                found.add((node.value, node.lineno))
            elif re.fullmatch(r"torch(\.\w+)+(:\w+)?(\|\w+)*", node.value):
                found.update((part, node.lineno) for part in re.split(r"[.:|]", node.value) if part in names)
    return found


MODULES = modules(PACKAGES)
USES = {module: private_uses(path.read_text(), set(PRIVATE) | set(SEMI_PUBLIC)) for module, path in MODULES.items()}


def test_the_walk_finds_private_uses():
    source = ("import torch._dynamo\nfrom torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter\n"
              "from torch import _C\nx = state._fsdp_param_groups\ny = getattr(unit, '_handle', None)\n"
              "def f():\n    '''mentions _fsdp_param_groups in prose'''\n"
              "needs = ('torch.distributed.fsdp._flat_param.FlatParameter:_fqns', 'not torch._dynamo')\n"
              "older = 'torch.a.State:_fsdp_param_groups|_fsdp_param_group'\n")
    assert private_uses(source, set(PRIVATE)) == {("_dynamo", 1), ("_fully_shard", 2), ("_fsdp_api", 2),
                                                  ("_C", 3), ("_fsdp_param_groups", 4), ("_handle", 5),
                                                  ("_flat_param", 8), ("_fqns", 8), ("_fsdp_param_groups", 9),
                                                  ("_fsdp_param_group", 9)}
    assert set(INTERNALS) <= set(MODULES)


def test_private_torch_names_only_in_their_internals_module():
    wrong = sorted(f"{module}:{line} uses {name} (allowed in {PRIVATE.get(name) or SEMI_PUBLIC[name]})"
                   for module, uses in USES.items() for name, line in uses
                   if module not in ((PRIVATE[name],) if name in PRIVATE else SEMI_PUBLIC[name]))
    assert wrong == []


@pytest.mark.parametrize("name", sorted(PRIVATE) + sorted(SEMI_PUBLIC))
def test_every_listed_name_is_used_by_its_internals_module(name):
    """A name no module uses any more should leave the list (and a renamed one be found)."""
    owners = (PRIVATE[name],) if name in PRIVATE else SEMI_PUBLIC[name]
    for owner in owners:
        assert name in {used for used, _ in USES[owner]}, f"{owner} does not use {name}"


# ------------------------------------------------------------------ the version check


def _internals(module: str):
    return importlib.import_module(module)


def _needs(module) -> tuple[str, ...]:
    return tuple(module.NEEDS) + tuple(name for names in getattr(module, "COMPILE_NEEDS", {}).values()
                                       for name in names)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-process warning anew."""
    monkeypatch.setattr(torch_versions, "_warned", set())


@pytest.mark.parametrize("module", INTERNALS)
def test_check_is_silent_on_the_tested_torch(module, fresh_warnings):
    assert ".".join(torch.__version__.split("+")[0].split(".")[:2]) in TESTED_TORCH
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _internals(module).check_torch()
    for name in _needs(_internals(module)):
        resolve(name)


@pytest.mark.parametrize("module", INTERNALS)
@pytest.mark.parametrize("version", ["2.10.0", "2.16.0+cu130", "3.0.0a0"])
def test_a_release_outside_the_range_warns_once_naming_it(module, version, monkeypatch, fresh_warnings):
    internals = _internals(module)
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.warns(RuntimeWarning) as record:
        internals.check_torch()
    (warning,) = record
    message = str(warning.message)
    assert internals.INTEGRATION in message and f"torch {version} is outside" in message
    assert "torch 2.11 to 2.15" in message and PIN in message and "'torch>=2.11,<2.16'" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for other in INTERNALS:
            _internals(other).check_torch()  # once per process, whichever integration checks next


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1", "2.13.0+cpu", "2.14.1", "2.15.0+cu130"])
def test_a_release_in_the_range_is_silent(version, monkeypatch, fresh_warnings):
    monkeypatch.setattr(torch, "__version__", version)
    assert torch_versions.supported()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for module in INTERNALS:
            _internals(module).check_torch()


def test_a_spec_names_what_each_release_calls_it():
    """``torch.a.f|g``: the later release's name first, the earlier one's where only it exists."""
    assert alternatives("torch.a.b.f|g") == ["torch.a.b.f", "torch.a.b.g"]
    assert alternatives("torch.a.C:_x|_y") == ["torch.a.C:_x", "torch.a.C:_y"]
    assert resolve("torch.nn.Linear|Conv1d") is torch.nn.Linear
    assert resolve("torch.nn.NoSuchModule|Conv1d") is torch.nn.Conv1d
    with pytest.raises(AttributeError):
        resolve("torch.nn.NoSuchModule|NorThis")
    names = torch_versions.namespace(["torch.nn.NoSuchModule|Conv1d", "torch.nn.Linear"])
    assert names.NoSuchModule is torch.nn.Conv1d and names.Linear is torch.nn.Linear


def _remove(monkeypatch, spec: str) -> None:
    """Make the running torch lack ``spec`` under every name (:func:`alternatives`) it has."""
    for name in alternatives(spec):
        try:
            resolve(name)
        except (AttributeError, ImportError):
            continue
        _remove_one(monkeypatch, name)


def _remove_one(monkeypatch, name: str) -> None:
    """Make the running torch lack ``name``: delete the attribute (or the annotation ``C:_x`` declares); where
    torch's C++ types refuse that, replace the object holding it by a stand-in without it."""
    owner, _, declared = name.partition(":")
    if declared:
        cls = resolve(owner)
        for holder in cls.__mro__:
            if declared in vars(holder).get("__annotations__", {}):
                monkeypatch.delitem(vars(holder)["__annotations__"], declared)
            if declared in vars(holder):
                monkeypatch.delattr(holder, declared)
        return
    parent_name, _, attr = name.rpartition(".")
    parent = resolve(parent_name)
    if isinstance(parent, types.ModuleType) or attr in getattr(parent, "__dict__", {}):
        try:
            value = getattr(parent, attr)
            delattr(parent, attr)
            setattr(parent, attr, value)
        except (AttributeError, TypeError):
            pass
        else:
            monkeypatch.delattr(parent, attr)
            return
    grand_name, _, parent_attr = parent_name.rpartition(".")
    monkeypatch.setattr(resolve(grand_name), parent_attr, types.SimpleNamespace())


NEEDED = [(module, name) for module in INTERNALS for name in _needs(_internals(module))]


@pytest.mark.parametrize("module, name", NEEDED, ids=[f"{m.rpartition('.')[2]}-{n}" for m, n in NEEDED])
def test_missing_name_raises(module, name, monkeypatch, fresh_warnings):
    internals = _internals(module)
    _remove(monkeypatch, name)
    with pytest.raises(TorchInternalsError) as caught:
        torch_versions.check_internals(internals.INTEGRATION, _needs(internals), internals.ADVICE)
    message = str(caught.value)
    assert f"needs torch's private {name}," in message and f"torch {torch.__version__} does not have" in message
    assert PIN in message and "torch 2.11 to 2.15" in message and internals.ADVICE in message
    if name in internals.NEEDS:  # the names checked at import: the module's own check refuses too
        with pytest.raises(TorchInternalsError, match=re.escape(PIN)):
            internals.check_torch()


def test_missing_run_time_name_raises_where_read():
    from tagc.hooks.adapters import torch_ddp, torch_fsdp1, torch_fsdp2

    stand_in = types.SimpleNamespace()
    cases = [(lambda: torch_ddp.has_rebuilt_buckets(stand_in), torch_ddp, "_has_rebuilt_buckets"),
             (lambda: torch_fsdp1.comm_hook(stand_in), torch_fsdp1, "_comm_hook"),
             (lambda: torch_fsdp1.flat_param(stand_in), torch_fsdp1, "_handle"),
             (lambda: torch_fsdp2.param_fqn(stand_in), torch_fsdp2, "_param_fqn"),
             (lambda: torch_fsdp2.param_groups(types.SimpleNamespace(_get_fsdp_state=lambda: stand_in)),
              torch_fsdp2, "_fsdp_param_group"),
             (lambda: torch_fsdp2.all_reduce_hook(stand_in), torch_fsdp2, "_all_reduce_hook")]
    for call, internals, name in cases:
        with pytest.raises(TorchInternalsError) as caught:
            call()
        assert f"SimpleNamespace.{name}, which torch {torch.__version__} does not have" in str(caught.value)
        assert internals.ADVICE in str(caught.value)


def test_fsdp2_param_groups_read_each_releases_record():
    """Torch 2.13 keeps a list of a module's parameter groups; torch 2.11 at most one."""
    from tagc.hooks.adapters import torch_fsdp2

    def module(**state):
        return types.SimpleNamespace(_get_fsdp_state=lambda: types.SimpleNamespace(**state))

    assert torch_fsdp2.param_groups(module(_fsdp_param_groups=["a", "b"], _fsdp_param_group="a")) == ["a", "b"]
    assert torch_fsdp2.param_groups(module(_fsdp_param_group="a")) == ["a"]
    assert torch_fsdp2.param_groups(module(_fsdp_param_group=None)) == []


def test_fsdp2_policy_and_mesh_info_read_each_releases_record():
    """The group's policy (torch 2.13) or its parameters' (2.15); an SPMD mesh flag, which torch 2.11 lacks."""
    from tagc.hooks.adapters import torch_fsdp2

    ns = types.SimpleNamespace
    assert torch_fsdp2.mp_policy(ns(mp_policy="group", fsdp_params=[ns(mp_policy="param")])) == "group"
    assert torch_fsdp2.mp_policy(ns(fsdp_params=[ns(mp_policy="param")])) == "param"
    assert torch_fsdp2.is_spmd_mesh(ns(is_spmd_mesh=True)) and not torch_fsdp2.is_spmd_mesh(ns())


def test_pyproject_states_the_supported_range():
    """What pip is told (pyproject.toml) and what the warning names are one range, ``SUPPORTED``."""
    low, high = torch_versions.SUPPORTED
    major, minor = high.split(".")
    spec = f"torch>={low},<{major}.{int(minor) + 1}"
    assert f'"{spec}"' in (ROOT / "pyproject.toml").read_text() and f"'{spec}'" in PIN
    assert set(torch_versions.SUPPORTED) <= set(TESTED_TORCH)  # CI runs the oldest and the newest


def test_release_is_major_minor():
    assert torch_versions.torch_release("2.13.0+cpu") == "2.13"
    assert torch_versions.torch_release("2.14.1") == "2.14"
    assert torch_versions.torch_release("3.0.0a0+git1234") == "3.0"
