"""``ropekit convert --force``: an interrupted run never leaves DST mixed, and its leftovers do not pile up.

Each run below overwrites DST, which holds an older complete conversion of another checkpoint, and
is stopped at every step that changes the file system: by an exception, by a real ``SIGKILL`` of a
forked child at that step, and by a ``SIGKILL`` sent from outside to a subprocess paused mid-write.
After each stop DST must be exactly the old output or exactly the new one (or, where directories
cannot be exchanged atomically, briefly absent) and the next run must leave no staging directory.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from convert_helpers import ENV, H2I, llama_config, run, state, write_sharded
from ropekit import files

torch.set_num_threads(1)


def content(path):
    """sha256 of a file's content; of a safetensors file's metadata and tensors (its header order varies)."""
    if path.suffix != ".safetensors":
        return hashlib.sha256(path.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    with safe_open(str(path), "pt") as f:
        digest.update(json.dumps(f.metadata(), sort_keys=True).encode())
        for name in sorted(f.keys()):
            t = f.get_tensor(name)
            digest.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
            digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tree(path):
    """``{relative path: content digest}`` of every file under ``path`` (or of the file), ``None`` if absent."""
    if not os.path.lexists(path):
        return None
    paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(p.relative_to(path)) if path.is_dir() else "file": content(p) for p in paths}


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".ropekit-staging-"))


def model(directory, seed):
    write_sharded(state(layers=3, bias=True, seed=seed), directory)
    (directory / "config.json").write_text(json.dumps(llama_config(seed=seed)))
    (directory / "tokenizer.json").write_text(json.dumps({"seed": seed}))
    return directory


@pytest.fixture
def sharded(tmp_path):
    """``(argv of the conversion under test, DST, old tree, new tree, reset)`` for a sharded directory output."""
    old_src, src = model(tmp_path / "old-src", 2), model(tmp_path / "src", 1)
    assert run(old_src, tmp_path / "old", "--to", "interleaved") == 0
    assert run(src, tmp_path / "new", "--to", "interleaved") == 0
    (tmp_path / "runs").mkdir()
    dst = tmp_path / "runs" / "dst"

    def reset():
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(tmp_path / "old", dst)

    return [src, dst, "--to", "interleaved", "--force"], dst, tree(tmp_path / "old"), tree(tmp_path / "new"), reset


@pytest.fixture
def single(tmp_path):
    """The same for a single-file output."""
    save_file(state(seed=2), str(tmp_path / "old-src.safetensors"))
    save_file(state(seed=1), str(tmp_path / "src.safetensors"))
    assert run(tmp_path / "old-src.safetensors", tmp_path / "old.safetensors", *H2I, "--heads", 4) == 0
    assert run(tmp_path / "src.safetensors", tmp_path / "new.safetensors", *H2I, "--heads", 4) == 0
    (tmp_path / "runs").mkdir()
    dst = tmp_path / "runs" / "out.safetensors"

    def reset():
        shutil.copyfile(tmp_path / "old.safetensors", dst)

    argv = [tmp_path / "src.safetensors", dst, *H2I, "--heads", 4, "--force"]
    return argv, dst, tree(tmp_path / "old.safetensors"), tree(tmp_path / "new.safetensors"), reset


def count_steps(monkeypatch, argv, reset):
    steps = []
    reset()
    monkeypatch.setattr(files, "fs_step", lambda action, path: steps.append((action, path.name)))
    assert run(*argv) == 0
    monkeypatch.undo()
    return steps


def finish_and_check(argv, dst, new):
    """The next run completes the output and removes every leftover of the interrupted one."""
    assert run(*argv) == 0
    assert tree(dst) == new
    assert leftovers(dst.parent) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("case", ["sharded", "single"])
def test_an_exception_at_every_step_leaves_old_or_new(request, monkeypatch, case, exchange):
    argv, dst, old, new, reset = request.getfixturevalue(case)
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    steps = count_steps(monkeypatch, argv, reset)
    assert len(steps) == {"sharded": 10 if not exchange else 9, "single": 4}[case], steps
    for stop in range(1, len(steps) + 1):
        reset()
        seen = []

        def interrupt(action, path, stop=stop, seen=seen):
            seen.append(action)
            if len(seen) == stop:
                raise KeyboardInterrupt(f"stopped at {action} {path.name}")

        monkeypatch.setattr(files, "fs_step", interrupt)
        if not exchange:
            monkeypatch.setattr(files, "_exchange", lambda a, b: False)
        with pytest.raises(KeyboardInterrupt):
            run(*argv)
        monkeypatch.undo()
        allowed = [old, new] + ([None] if case == "sharded" and not exchange else [])
        assert tree(dst) in allowed, (stop, steps[stop - 1])
        if not exchange:
            monkeypatch.setattr(files, "_exchange", lambda a, b: False)
        finish_and_check(argv, dst, new)


def killed_at(stop, argv):
    """Run ``convert ARGV`` in a forked child that ``SIGKILL``s itself at file-system step ``stop``."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            seen = []

            def kill(action, path):
                seen.append(action)
                if len(seen) == stop:
                    os.kill(os.getpid(), signal.SIGKILL)

            files.fs_step = kill
            run(*argv)
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.parametrize("case", ["sharded", "single"])
def test_sigkill_at_every_step_leaves_old_or_new_and_the_next_run_cleans_up(request, monkeypatch, case):
    argv, dst, old, new, reset = request.getfixturevalue(case)
    steps = count_steps(monkeypatch, argv, reset)
    kinds = set()
    for stop in range(1, len(steps) + 1):
        reset()
        assert killed_at(stop, argv), (stop, steps[stop - 1])
        state_now = tree(dst)
        assert state_now in (old, new), (stop, steps[stop - 1])
        kinds.add("old" if state_now == old else "new")
        if 1 < stop < len(steps):  # killed holding a staging directory: it stays until the next run
            assert leftovers(dst.parent), (stop, steps[stop - 1])
        finish_and_check(argv, dst, new)
    assert kinds == {"old", "new"}


PAUSE = """
import os, sys, time
from ropekit import files
seen = []
def pause(action, path):
    seen.append(action)
    if action == "write" and seen.count("write") == int(os.environ["PAUSE_AT_WRITE"]):
        print("paused", flush=True)
        time.sleep(600)
files.fs_step = pause
from ropekit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_from_outside_mid_write(sharded):
    """A real process, paused after writing two shards into its staging directory, killed by another process."""
    argv, dst, old, new, reset = sharded
    reset()
    child = subprocess.Popen([sys.executable, "-c", PAUSE, "convert", *map(str, argv)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**ENV, "PAUSE_AT_WRITE": "3"})
    try:
        assert child.stdout.readline().strip() == "paused"
        [stage] = leftovers(dst.parent)
        assert len(list((dst.parent / stage / "output").iterdir())) == 2  # two shards written, the rest not yet
        assert files.remove_stale_staging(dst.parent) == []  # a live run's directory is never taken
        assert leftovers(dst.parent) == [stage]
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert tree(dst) == old
    assert leftovers(dst.parent) == [stage]  # what the killed run left, until:
    finish_and_check(argv, dst, new)
