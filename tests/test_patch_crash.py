"""``oldgpu patch`` killed at every step of its commit, against the real verl sdist.

A test-only hook (OLDGPU_PATCH_CRASH_AT=N) ends ``python -m oldgpu patch`` with exit
137, as a SIGKILL would, just before step N of its commit. For every N until the run
completes: the next run finishes or undoes the commit, so the tree is byte for byte the
old one or the new one, with no journal and no ``*.oldgpu-tmp`` left; re-running the
command and reverting then give the patched and the pristine tree exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import tree_hashes, tree_state

import oldgpu
from oldgpu import cli
from oldgpu.patch import transaction

pytestmark = pytest.mark.slow


def tree_dirs(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir()}


def snapshot(root: Path) -> tuple[dict[str, str], set[str]]:
    """Every file's hash and every directory (an emptied one left behind counts)."""
    return tree_hashes(root), tree_dirs(root)


def run_cli(capsys, *argv: str) -> dict:
    code = cli.main(["patch", *argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code in (0, 1), out
    return out


def killed_run(tree: Path, step: int, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(Path(oldgpu.__file__).parents[1]),
        PYTHONDONTWRITEBYTECODE="1",
        **{transaction.CRASH_ENV: str(step)},
    )
    return subprocess.run(
        [sys.executable, "-m", "oldgpu", "patch", str(tree), *argv, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def states(verl_pristine: Path, tmp_path_factory) -> dict[str, tuple]:
    patched = tmp_path_factory.mktemp("verl-patched") / verl_pristine.name
    shutil.copytree(verl_pristine, patched, symlinks=True)
    assert cli.main(["patch", str(patched), "--json"]) == 0
    return {
        "pristine": snapshot(verl_pristine),
        "patched": snapshot(patched),
        "patched_tree": (patched,),
    }


def leftovers(root: Path) -> list[str]:
    return [
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.name.endswith(transaction.TMP_SUFFIX) or p.name == transaction.JOURNAL_NAME
    ]


def kill_at_every_step(start: Path, argv: tuple[str, ...], work: Path, capsys, states) -> Counter:
    """Kill the command at step 1, 2, ... until it completes; check each recovery."""
    old = states["pristine"] if not argv else states["patched"]
    new = states["patched"] if not argv else states["pristine"]
    outcomes: Counter = Counter()
    # The killed runs are independent: a few run ahead while the checks go step by step.
    window = max(2, os.cpu_count() or 1)
    runs: dict[int, tuple[Path, Future]] = {}

    def launch(n: int) -> None:
        tree = work / f"step-{n}" / start.name
        shutil.copytree(start, tree, symlinks=True)
        runs[n] = (tree, pool.submit(killed_run, tree, n, *argv))

    with ThreadPoolExecutor(window) as pool:
        for n in range(1, window + 1):
            launch(n)
        step = 0
        while True:
            step += 1
            tree, future = runs.pop(step)
            proc = future.result()
            if proc.returncode == 0:  # past the last step: the commit ran whole
                assert snapshot(tree) == new, "the uninterrupted run gives another tree"
                break
            assert proc.returncode == 137, f"step {step}: {proc.stderr[-2000:]}"
            assert proc.stdout == "", f"step {step}: the run was not cut short: {proc.stdout}"
            launch(step + window)
            # What any next run does first (patch, --revert, --check: see test_a_torn_journal)
            outcome = transaction.recover(tree, sweep=False)
            expected = new if outcome == "rolled forward" else old
            assert snapshot(tree) == expected, f"step {step}: {outcome}, but the tree is not"
            assert not leftovers(tree), f"step {step}: {leftovers(tree)}"
            outcomes[outcome or "nothing to recover"] += 1
            # Re-running the command completes it; a revert gives the pristine tree.
            run_cli(capsys, str(tree), *argv)
            assert snapshot(tree) == new, f"step {step}: re-running did not give the new tree"
            assert not leftovers(tree)
            run_cli(capsys, str(tree), "--revert")
            assert snapshot(tree) == states["pristine"], f"step {step}: revert is not pristine"
            shutil.rmtree(tree.parent)
    # Every kind of step was hit: before the journal, while staging, while renaming.
    assert step > 20, step
    assert outcomes["rolled back"] >= 3 and outcomes["rolled forward"] >= 3, outcomes
    return outcomes


def test_patch_killed_at_every_step(verl_pristine: Path, tmp_path: Path, capsys, states):
    kill_at_every_step(verl_pristine, (), tmp_path, capsys, states)


def test_revert_killed_at_every_step(tmp_path: Path, capsys, states):
    (patched,) = states["patched_tree"]
    kill_at_every_step(patched, ("--revert",), tmp_path, capsys, states)


def test_leftovers_of_an_older_oldgpu_are_swept(verl_tree: Path, verl_pristine: Path, capsys):
    # oldgpu before the journal left mkstemp files behind when it was killed.
    stray = verl_tree / "verl/workers/.fsdp_workers.py.k3j2_x.oldgpu-tmp"
    stray.write_bytes(b"half a file")
    run_cli(capsys, str(verl_tree), "--check")
    assert stray.exists()  # a dry run without a journal changes nothing
    run_cli(capsys, str(verl_tree))
    run_cli(capsys, str(verl_tree), "--revert")
    assert snapshot(verl_tree) == snapshot(verl_pristine)


def test_a_torn_journal_is_dropped(verl_tree: Path, verl_pristine: Path, capsys):
    (verl_tree / transaction.JOURNAL_NAME).write_bytes(b'{"schema": 1, "ops": [{"pa')
    out = run_cli(capsys, str(verl_tree), "--check")
    assert out["recovered"] == "rolled back"
    assert snapshot(verl_tree) == snapshot(verl_pristine)


def test_a_foreign_journal_is_refused(verl_tree: Path, capsys):
    (verl_tree / transaction.JOURNAL_NAME).write_text('{"schema": 1, "ops": [{"path": "/etc/x"}]}')
    state = tree_state(verl_tree)
    assert cli.main(["patch", str(verl_tree), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == "patch-journal-invalid"
    assert tree_state(verl_tree) == state


def test_a_second_run_is_refused_while_one_holds_the_tree(verl_tree: Path, capsys):
    state = tree_state(verl_tree)
    with transaction.locked(verl_tree):
        assert cli.main(["patch", str(verl_tree), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == "patch-in-progress"
    assert tree_state(verl_tree) == state
