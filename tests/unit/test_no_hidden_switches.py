"""No hidden switches (docs/design.md): nothing is read from the environment at import, no function rebinds module
state but the two scoped or informational ones named here, XLA's replica groups follow from the collective's own
group, and a library call leaves the signal handlers and the garbage collector as it found them, while
`command_scope` (the CLI's) takes both over and restores them."""

from __future__ import annotations

import ast
import gc
import signal
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "preshard"
# Module state a function may rebind, and why it changes nothing a caller did not ask for.
REBOUND = {
    ("converter/parallel.py", "WORKER_RANK"): "set in a forked worker to its rank; informational (tests read it)",
    ("runtime/collectives.py", "_ACTIVE"): "the `with NeuronRuleChecker():` block the caller enters; records only",
}


def _module_level_nodes(tree: ast.Module):
    """Every node that runs at import: module statements outside function bodies (class bodies included)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def test_nothing_reads_the_environment_at_import():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in _module_level_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found


def test_only_the_named_module_state_is_rebound():
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                found |= {(path.relative_to(PACKAGE).as_posix(), name) for name in node.names}
    assert found == set(REBOUND), found


def test_xla_replica_groups_are_every_group_of_the_axis_for_any_order():
    from preshard.format.mesh import MeshSpec
    from preshard.runtime.collectives import axis_partition

    for order in ("tp,ring,ulysses", "ring,tp,ulysses", "ulysses,ring,tp", "tp,ulysses,ring"):
        mesh = MeshSpec.build(tp=2, ring=2, ulysses=3, order=order)
        for axis in ("tp", "ring", "ulysses", "cp"):
            want = sorted(sorted(g) for g in mesh.groups(axis))
            for group in mesh.groups(axis):
                assert axis_partition(group, mesh.world_size) == want, (order, axis, group)
    assert axis_partition([0, 3], 4) is None  # no axis of a 4-rank mesh has it as a group
    assert axis_partition([0, 1, 4], 8) is None
    assert axis_partition([1, 2], 4) is None  # its translate [0, 1] would overlap it


def test_a_library_call_leaves_the_signal_handlers_alone_and_the_scope_takes_them_over():
    from preshard import command_scope
    from preshard.converter.signals import deferred_signals

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with deferred_signals() as flag:  # what the converter does while it writes, outside any scope
        assert {s: signal.getsignal(s) for s in before} == before
    assert flag.signal_number is None
    enabled = gc.isenabled()
    with command_scope():
        assert not gc.isenabled()
        scoped = signal.getsignal(signal.SIGTERM)
        assert scoped is not before[signal.SIGTERM]
        with deferred_signals() as flag:
            assert signal.getsignal(signal.SIGTERM) is not scoped  # deferred to the next safe point
            signal.raise_signal(signal.SIGTERM)
            assert flag.signal_number == signal.SIGTERM
            flag.raised = True  # acted on (as the converter's check would): not delivered again at the end
        assert signal.getsignal(signal.SIGTERM) is scoped
    assert {s: signal.getsignal(s) for s in before} == before and gc.isenabled() == enabled


def test_the_environment_switches_are_read_when_used(monkeypatch):
    from preshard.converter.parallel import worker_timeout
    from preshard.format.fileio import direct_io_enabled

    monkeypatch.setenv("PRESHARD_DIRECT_IO", "0")
    monkeypatch.setenv("PRESHARD_WORKER_TIMEOUT_S", "7")
    assert not direct_io_enabled() and worker_timeout() == 7.0
    monkeypatch.delenv("PRESHARD_DIRECT_IO")
    monkeypatch.delenv("PRESHARD_WORKER_TIMEOUT_S")
    assert direct_io_enabled() and worker_timeout() == 1800.0


def test_the_torchrun_coordinator_exists_only_inside_its_block(monkeypatch):
    from preshard.converter import parallel
    from preshard.errors import DeviceError

    assert parallel.active_coordinator() is None
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(DeviceError, match="runs under torchrun"), parallel.torchrun_job():
        pass
    assert parallel.active_coordinator() is None
