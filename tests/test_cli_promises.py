"""What the command line promises, each promise broken on purpose.

- Bad input: exactly one line on stderr and exit code 2, for every verb, through the console
  script and ``python -m ropekit``; bugs keep their traceback (the rule in ``ropekit.cli``).
- Ctrl-C: one line, exit code 130, no traceback, no empty output folder left by the run.
- Output folders are checked before the work: a bad ``--out`` fails before torch is imported.
- ``--help``, ``<verb> --help`` and ``--version`` never import torch; ``import ropekit`` neither.
"""

import importlib
import importlib.metadata
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ropekit
from ropekit.cli import common as cli_common
from ropekit.cli import entry as cli
from ropekit.cli import inspect as cli_inspect
from ropekit.cli.entry import main

SCRIPT = Path(sys.executable).parent / "ropekit"
CONSOLE = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "ropekit"]
PYTHON_M = [sys.executable, "-m", "ropekit"]
ENV = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MAX_CHARS = "120000"
VERBS = ("inspect", "decay", "report", "bench", "convert", "train", "extrapolate", "probe", "extend")

# main(argv) in a fresh interpreter; exit code 99 if torch was imported on the way
NO_TORCH_RUNNER = """
import sys
from ropekit.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
sys.exit(99 if "torch" in sys.modules else code)
"""


def run_all(commands: list[list[str]], **kwargs) -> list[subprocess.CompletedProcess]:
    """Start every command, then wait for each; the completed processes in order."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, **kwargs)
             for c in commands]
    done = []
    for command, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(command, proc.returncode, out, err))
    return done


@pytest.fixture()
def hostile(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    return {"file": a_file, "under_file": a_file / "out", "missing": tmp_path / "missing.json", "tmp": tmp_path}


def bad_command_lines(h) -> dict[tuple[str, ...], str]:
    """Bad input for every verb -> words its one-line error must contain."""
    return {
        ("train", "--steps", "0"): "--steps: expected an integer >= 1, got '0'",
        ("train", "--quick", "--out", str(h["under_file"])): "lies under the file",
        ("train", "--encoding", "t5-bias"): "invalid choice: 't5-bias'",
        ("extrapolate", "--out", str(h["file"])): "must be a directory",
        ("extrapolate", "--context", "1"): "--context: expected an integer >= 2",
        ("train", "--encoding", "alibi", "--attention", "linear", "--out", str(h["tmp"] / "t")):
            "--encoding alibi acts on softmax logits: it needs --attention softmax",
        ("train", "--rope-fraction", "0"): "--rope-fraction: expected a number in (0, 1], got '0'",
        ("extrapolate", "--encodings", "rope,rope"): "--encodings: expected distinct names",
        ("extrapolate", "--encodings", "rope,xpos", "--attention", "linear", "--out", str(h["tmp"] / "x")):
            "--encodings: xpos acts on softmax logits",
        ("report", "--quick", "--out", str(h["under_file"] / "deeper")): "lies under the file",
        ("decay", "--dim", "7", "--max-distance", "10"): "--dim must be a positive even number",
        ("decay", "--dim", "8", "--max-distance", "10", "--png", str(h["under_file"])): "directory does not exist",
        ("inspect", "--config", str(h["missing"])): "config file not found",
        ("bench", "--threads", "0"): "--threads",
        ("bench", "--budget", "-1"): "--budget",
        ("probe",): "one of the arguments --model --gguf --example is required",
        ("probe", "--example", "--tokens", "2"): "--tokens: expected an integer >= 3",
        ("probe", "--model", str(h["missing"])): "no such directory",
        ("probe", "--example", "--prompt", ""): "--prompt: the text is empty",
        ("extend",): "one of the arguments --model --gguf --example is required",
        ("extend", "--example"): "--to: the target length is required",
        ("extend", "--example", "--to", "16384", "--rules", "rope9"): "--rules",
        ("extend", "--model", str(h["missing"]), "--to", "16384"): "no such directory",
        ("convert", str(h["missing"]), str(h["tmp"] / "dst"), "--to", "half", "--heads", "4"): "",
        (): "the following arguments are required: <verb>",
    }


@pytest.mark.parametrize("command", [CONSOLE, PYTHON_M], ids=["console-script", "python-m"])
def test_bad_input_is_one_line_and_exit_code_2(hostile, command):
    cases = bad_command_lines(hostile)
    for (argv, words), done in zip(cases.items(), run_all([[*command, *argv] for argv in cases]), strict=True):
        lines = done.stderr.splitlines()
        prefix = f"ropekit {argv[0]}: error: " if argv else "ropekit: error: "
        assert done.returncode == 2 and len(lines) == 1, (argv, done.stderr)
        assert lines[0].startswith(prefix) and words in lines[0], (argv, lines[0])
        assert done.stdout == ""
    assert sorted(p.name for p in hostile["tmp"].iterdir()) == ["a-file"]  # no folder, no file left behind


def test_bad_output_fails_before_torch_is_imported(hostile):
    cases = [["train", "--out", str(hostile["under_file"])], ["extrapolate", "--quick", "--out", str(hostile["file"])],
             ["report", "--out", str(hostile["under_file"])], ["train", "--steps", "-3"],
             ["train", "--encoding", "xpos", "--attention", "linear", "--out", str(hostile["tmp"] / "t")]]
    for argv, done in zip(cases, run_all([[sys.executable, "-c", NO_TORCH_RUNNER, *a] for a in cases]), strict=True):
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, (argv, done.stderr)


# -- which failures are the user's -------------------------------------------------------------------


def builtin_error_inside_ropekit(args):
    return cli_common.number("forty")  # float("forty") raises inside ropekit code, but no raise statement does


@pytest.mark.parametrize("bug, kind", [
    (lambda args: int("x"), ValueError),
    (builtin_error_inside_ropekit, ValueError),
    (lambda args: {}["missing"], KeyError),
    (lambda args: None + 1, TypeError),
    (lambda args: open("/nonexistent-ropekit-internal-file"), FileNotFoundError),
])
def test_bugs_keep_their_traceback(monkeypatch, bug, kind):
    monkeypatch.setattr(cli_inspect, "run", bug)
    with pytest.raises(kind):
        main(["inspect"])


def test_library_validation_and_user_paths_are_user_errors(monkeypatch, tmp_path, capsys):
    cases = {
        lambda args: ropekit.inv_frequencies(7): "rotary_dim",  # raised by ropekit's own validation
        lambda args: open(Path(args.config) / "inside.json"): f"No such file or directory: '{tmp_path}",
    }
    for verb, words in cases.items():
        monkeypatch.setattr(cli_inspect, "run", verb)
        assert main(["inspect", "--config", str(tmp_path)]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("ropekit inspect: error: ") and words in lines[0], lines


# -- output folders ----------------------------------------------------------------------------------


def interrupted(args):
    raise KeyboardInterrupt


def test_a_failed_run_removes_only_the_empty_folders_it_created(monkeypatch, tmp_path, capsys):
    from ropekit_lab import train

    monkeypatch.setattr(train, "run", interrupted)
    assert main(["train", "--out", str(tmp_path / "new" / "deeper")]) == 130
    assert capsys.readouterr().err == "ropekit train: interrupted\n"
    assert list(tmp_path.iterdir()) == []  # both folders the run created are gone
    existing = tmp_path / "existing"
    existing.mkdir()
    assert main(["train", "--out", str(existing)]) == 130 and existing.is_dir()  # there before: left alone

    def write_then_fail(args):
        (Path(args.out) / "model.pt").write_bytes(b"something of value")
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run", write_then_fail)
    assert main(["train", "--out", str(tmp_path / "kept")]) == 130
    assert (tmp_path / "kept" / "model.pt").read_bytes() == b"something of value"


@pytest.mark.parametrize("verb, module, attribute", [("train", "ropekit_lab.train", "run"),
                                                     ("extrapolate", "ropekit_lab.extrapolate", "run"),
                                                     ("report", "ropekit_lab.report", "write_report"),
                                                     ("probe", "ropekit_lab.probe", "run"),
                                                     ("extend", "ropekit_lab.extend", "run")])
def test_unwritable_output_fails_before_the_work(monkeypatch, tmp_path, capsys, verb, module, attribute):
    monkeypatch.setattr(importlib.import_module(module), attribute, lambda *a, **k: pytest.fail("worked first"))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = {str(a_file): "must be a directory", str(a_file / "sub" / "out"): "lies under the file"}
    if Path("/proc/self").is_dir():  # procfs accepts no new files, not even from root
        cases["/proc/ropekit-out"] = "is not writable: cannot create a file in '/proc'"
    for out, words in cases.items():
        needed = {"probe": ["--example"], "extend": ["--example", "--to", "16384"]}.get(verb, [])
        assert main([verb, *needed, "--out", out]) == 2, out
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and words in lines[0], (out, lines)


def test_read_only_output_folder(tmp_path, capsys):
    """A folder that refuses new files: chmod for a normal user; a read-only bind mount for root."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            assert main(["train", "--out", str(folder / "out")]) == 2
        finally:
            folder.chmod(0o755)
        assert "is not writable" in capsys.readouterr().err and not (folder / "out").exists()
        return
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("root ignores permission bits and unshare/mount are missing: no read-only folder to test with")
    script = 'mount --bind -o ro "$1" "$1" && shift && exec "$@"'  # in a private mount namespace, gone with it
    done = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(folder), *CONSOLE, "train", "--out",
                           str(folder / "out")], capture_output=True, text=True, env=ENV, timeout=120)
    if "mount" in done.stderr and done.returncode != 2:
        pytest.skip(f"no private read-only mount here: {done.stderr.strip()}")
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"ropekit train: error: --out '{folder / 'out'}' is not writable: cannot create a file in '{folder}' "
        "(Read-only file system)"], done.stderr
    assert list(folder.iterdir()) == []


# -- Ctrl-C ------------------------------------------------------------------------------------------


def read_until(proc: subprocess.Popen, marker: bytes, timeout: float = 120) -> bytes:
    """Read the child's stderr (raw, unbuffered) until ``marker`` appears."""
    seen, deadline = b"", time.monotonic() + timeout
    while marker not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, seen[-500:]
        if select.select([proc.stderr], [], [], 0.5)[0]:
            seen += os.read(proc.stderr.fileno(), 4096)
    return seen


def torch_loaded(proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until the child has mapped libtorch (it is past argument parsing and at work)."""
    deadline = time.monotonic() + timeout
    while "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see when the child is at work")
def test_ctrl_c_is_one_line_exit_130_and_leaves_no_empty_folder(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    runs = {  # verb -> (argv, folder to look at afterwards, whether it must still exist)
        "train": (["--quick", "--max-chars", MAX_CHARS, "--out", str(tmp_path / "new" / "train")], tmp_path / "new",
                  False),
        "extrapolate": (["--quick", "--max-chars", MAX_CHARS, "--out", str(existing)], existing, True),
        "report": (["--quick", "--out", str(tmp_path / "report")], tmp_path / "report", False),
    }
    for verb, (argv, folder, kept) in runs.items():
        proc = subprocess.Popen([*CONSOLE, verb, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
        try:
            if verb == "report":
                torch_loaded(proc)
                time.sleep(1.0)
                seen = b""
            else:
                seen = read_until(proc, b"/softmax ")  # the progress bar: training is under way
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        err = (seen + err).decode()
        assert proc.returncode == 130, (verb, err)
        assert err.splitlines()[-1] == f"ropekit {verb}: interrupted" and "Traceback" not in err, (verb, err)
        assert folder.is_dir() == kept and (not kept or list(folder.iterdir()) == []), verb
        assert out == b""


@pytest.mark.parametrize("interrupted", [True, False])
def test_a_failure_after_ctrl_c_still_ends_as_interrupted(monkeypatch, capsys, interrupted):
    # Ctrl-C in the middle of an import leaves the module half-loaded; the next import of it raises
    # ImportError ("cannot load module more than once per process"). After an interrupt, that is still
    # "interrupted", exit 130; without one, the same error is a bug and keeps its traceback.
    from ropekit import files

    def run(args):
        if interrupted:
            files.note_interrupt()
        raise ImportError("cannot load module more than once per process")

    monkeypatch.setattr(cli_inspect, "run", run)
    if not interrupted:
        with pytest.raises(ImportError):
            main(["inspect"])
        return
    assert main(["inspect"]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "ropekit inspect: interrupted"


# -- no torch before the arguments are parsed --------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["--version"], *[[verb, "--help"] for verb in VERBS]],
                         ids=lambda argv: " ".join(argv))
def test_help_and_version_do_not_import_torch(argv):
    done = subprocess.run([sys.executable, "-c", NO_TORCH_RUNNER, *argv], capture_output=True, text=True, env=ENV,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-300:] if done.returncode != 99 else "torch was imported"
    assert done.stdout.startswith("usage: ropekit" if "--help" in argv else "ropekit ")


def test_version_is_the_installed_distribution_version():
    expected = f"ropekit {importlib.metadata.version('ropekit')}"
    for done in run_all([[*CONSOLE, "--version"], [*PYTHON_M, "--version"]]):
        assert done.returncode == 0 and done.stdout.strip() == expected and done.stderr == ""
    assert ropekit.__version__ == importlib.metadata.version("ropekit")


def test_import_ropekit_is_lazy_and_complete():
    probe = "import sys, ropekit; print('torch' in sys.modules, len(dir(ropekit)) > 16)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.stdout.split() == ["False", "True"], done.stderr
    assert set(ropekit.__all__) == set(ropekit._EXPORTS) | set(ropekit._SUBMODULES)
    for name, module in ropekit._EXPORTS.items():
        assert getattr(ropekit, name) is getattr(importlib.import_module(f"ropekit.{module}"), name), name
    assert ropekit.scaling is importlib.import_module("ropekit.scaling")
    probe = "import ropekit; print(ropekit.nn.RotarySelfAttention.__name__, ropekit.functional.__name__)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.stdout.split() == ["RotarySelfAttention", "ropekit.functional"], done.stderr  # subpackages as before
    with pytest.raises(AttributeError, match="no attribute 'apply_rotary_pos_emb'"):
        ropekit.apply_rotary_pos_emb  # noqa: B018


def test_every_verb_is_a_module_of_the_cli_package_or_of_the_lab(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--help"])
    listed = capsys.readouterr().out
    assert set(cli.VERBS) | set(cli.LAB_VERBS) == set(VERBS) and all(verb in listed for verb in VERBS)
    assert "not installed" not in listed  # the lab is installed here: --help says nothing about installing it
    for verb in cli.VERBS:  # one module per verb, each with its parser and its run
        module = importlib.import_module(f"ropekit.cli.{verb}")
        assert callable(module.add_parser) and callable(module.run), verb
    points = cli.installed_verbs()
    assert list(points) == list(cli.LAB_VERBS)  # the lab's verbs, through the entry-point group ropekit.verbs
    for verb, point in points.items():
        module = point.load()
        assert module.__name__ == f"ropekit_lab.verbs.{verb}" and callable(module.add_parser) and callable(module.run)


def test_a_closed_pipe_ends_quietly():
    proc = subprocess.Popen([*CONSOLE, "decay", "--dim", "64", "--max-distance", "300000", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    assert proc.stdout.read(10) == b'{\n  "dim":'
    proc.stdout.close()  # the reader goes away, as `| head` does
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and err == b"", err


def test_default_output_folders_are_ignored_by_git():
    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(root), "rev-parse"], capture_output=True,
                                                     env=ENV).returncode != 0:
        pytest.skip("not a git checkout")
    parser = cli.build_parser()
    verbs = next(action for action in parser._actions if action.dest == "verb").choices
    defaults = {verb: sub.get_default("out") for verb, sub in verbs.items() if sub.get_default("out")}
    assert set(defaults) == {"report", "train", "extrapolate", "probe", "extend"}
    for verb, folder in defaults.items():
        done = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", f"{folder}/results.json"], env=ENV)
        assert done.returncode == 0, f"{verb}'s default --out {folder}/ is not in .gitignore"


def test_an_interrupt_python_drops_in_a_callback_still_ends_the_run_with_no_output(tmp_path, monkeypatch, capsys):
    """Ctrl-C while a weakref callback runs: Python reports the KeyboardInterrupt as "Exception ignored" and
    carries on (seen once in ``ropekit report``, exit 0). The run must still end 130, and write nothing."""
    import argparse
    import weakref

    from ropekit import files

    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: dropped.append(info.exc_type))
    target = tmp_path / "out.txt"

    def verb(args):
        class Token:
            pass

        token = Token()
        weakref.finalize(token, lambda: [os.kill(os.getpid(), signal.SIGINT)] + [n for n in range(1000)])
        del token  # the finalizer runs here; the SIGINT handler raises inside it, and Python drops that
        files.write_bytes_atomic(target, b"complete-looking output")
        return 0

    parser = argparse.ArgumentParser(prog="ropekit")
    parser.add_argument("verb")
    parser.set_defaults(func=verb)
    monkeypatch.setattr(cli, "build_parser", lambda *plugins: parser)
    before = signal.getsignal(signal.SIGINT)
    assert main(["fake"]) == 130
    assert dropped == [KeyboardInterrupt]  # the interrupt really was dropped on the way
    assert capsys.readouterr().err.splitlines()[-1] == "ropekit fake: interrupted"
    assert not target.exists() and list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is before  # main puts the previous handler back
    files.clear_interrupt()
