"""What a verb needs installed is checked before any work: one line naming the module and the ``pip install``, exit 2.

Each verb runs in a fresh interpreter in which the modules it needs cannot be imported (a meta-path
finder refuses them, as for a package that is not installed); the run must end with exit code 2 and
one line on stderr, before torch is imported (no work begun), with no output written. The lab's verbs
without the lab run in an interpreter whose path holds everything but the lab.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ropekit.cli import entry as cli
from ropekit.cli.entry import main

ROOT = Path(__file__).resolve().parent.parent
ENV = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
LAB = "pip install ropekit-lab (in a clone of ropekit: pip install ./lab)"

# argv[1]: modules to refuse (comma-separated); the rest: the command line. Exit 99 if torch was imported.
BLOCKING_RUNNER = """
import importlib.abc
import sys

blocked = set(sys.argv[1].split(","))


class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Refuse())
from ropekit.cli import main

try:
    code = main(sys.argv[2:])
except SystemExit as stop:
    code = stop.code
sys.exit(99 if "torch" in sys.modules else code)
"""


def run_all(commands: list[list[str]], env=ENV) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for c in commands]
    done = []
    for command, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(command, proc.returncode, out, err))
    return done


def test_each_verb_without_what_it_needs_is_one_line_and_exit_2_before_any_work(tmp_path):
    src = tmp_path / "model.safetensors"
    src.write_bytes(b"not read")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    cases = {  # (blocked modules, argv) -> (module named, install named), output that must not appear
        ("safetensors", ("convert", str(src), str(tmp_path / "dst"), "--to", "interleaved")):
            ("'safetensors'", "pip install 'ropekit[convert]'", tmp_path / "dst"),
        ("matplotlib", ("decay", "--dim", "8", "--max-distance", "10", "--png", str(tmp_path / "d.png"))):
            ("'matplotlib'", "pip install 'ropekit[plot]'", tmp_path / "d.png"),
        ("matplotlib", ("train", "--quick", "--out", str(tmp_path / "train"))):
            ("'matplotlib'", LAB, tmp_path / "train"),
        ("matplotlib", ("extrapolate", "--quick", "--out", str(tmp_path / "extrapolate"))):
            ("'matplotlib'", LAB, tmp_path / "extrapolate"),
        ("matplotlib", ("report", "--quick", "--out", str(tmp_path / "report"))):
            ("'matplotlib'", LAB, tmp_path / "report"),
        ("transformers", ("probe", "--model", str(model_dir), "--out", str(tmp_path / "probe"))):
            ("'transformers'", LAB, tmp_path / "probe"),
        ("gguf,accelerate", ("probe", "--gguf", str(gguf), "--out", str(tmp_path / "probe-gguf"))):
            ("'gguf' and 'accelerate'", LAB, tmp_path / "probe-gguf"),
        ("accelerate", ("probe", "--example", "--out", str(tmp_path / "probe-example"))):
            ("'accelerate'", LAB, tmp_path / "probe-example"),
    }
    commands = [[sys.executable, "-c", BLOCKING_RUNNER, blocked, *argv] for blocked, argv in cases]
    before = sorted(p.name for p in tmp_path.iterdir())
    for ((_, argv), (module, install, output)), done in zip(cases.items(), run_all(commands), strict=True):
        lines = done.stderr.splitlines()
        assert done.returncode == 2 and len(lines) == 1 and done.stdout == "", (argv, done.returncode, done.stderr)
        assert lines[0].startswith(f"ropekit {argv[0]}: error: needs the module"), lines[0]
        assert module in lines[0] and lines[0].endswith(install), lines[0]
        assert not output.exists(), argv  # nothing written, no folder created
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_verb_runs_when_only_an_option_needs_the_missing_module(tmp_path):
    runner = BLOCKING_RUNNER.replace('sys.exit(99 if "torch" in sys.modules else code)', "sys.exit(code)")
    (done,) = run_all([[sys.executable, "-c", runner, "matplotlib", "decay", "--dim", "8", "--max-distance", "10",
                        "--json"]])
    assert done.returncode == 0 and '"bound"' in done.stdout, done.stderr  # no --png: matplotlib is not needed


def test_the_readme_says_what_each_verb_needs():
    """The README's table names, for every verb, each module it declares and the command that installs it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("| verb | needs |"):]
    table = table[:table.index("\n\n")]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `ropekit (\w+)[^`]*` \|.*$", table, re.M)}
    parser = cli.build_parser()
    verbs = next(action for action in parser._actions if action.dest == "verb").choices
    assert set(rows) == set(verbs)
    for verb, sub in verbs.items():
        for modules, install, _ in sub.get_default("required_modules") or ():
            assert all(module in rows[verb] for module in modules), (verb, modules)
            command = install if install.startswith("pip install '") else "pip install ropekit-lab"
            assert command in rows[verb] or (verb in cli.LAB_VERBS and "pip install ./lab" in rows[verb]), verb


# -- the lab's verbs without the lab -----------------------------------------------------------------


def test_without_the_lab_its_verbs_say_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(cli, "installed_verbs", dict)
    for verb in cli.LAB_VERBS:
        assert main([verb, "--quick"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == (
            f"ropekit {verb}: error: {verb} is a verb of the lab, which is not installed: {LAB}\n")
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    listed = capsys.readouterr().out
    assert stop.value.code == 0 and f"The lab's verbs are not installed: {LAB}." in " ".join(listed.split())
    assert not any(re.search(rf"^\s+{verb}\s", listed, re.M) for verb in cli.LAB_VERBS), listed
    assert main(["inspect", "--preset", "llama-2", "--no-bound", "--json"]) == 0  # the library's verbs work


def path_without_the_lab(tmp_path: Path) -> list[str]:
    """This interpreter's module path, less the lab: its sources, and its metadata (folders shadowed without it)."""
    entries = []
    for entry in sys.path:
        folder = Path(entry or ".")
        if not folder.is_dir() or (folder / "ropekit_lab").is_dir():
            continue
        if any(folder.glob("ropekit_lab-*.dist-info")) or any(folder.glob("__editable__*ropekit_lab*")):
            shadow = tmp_path / f"site-{len(entries)}"
            shadow.mkdir()
            for item in folder.iterdir():
                if "ropekit_lab" not in item.name:
                    (shadow / item.name).symlink_to(item)
            folder = shadow
        entries.append(str(folder))
    return entries


def test_without_the_lab_installed_a_lab_verb_is_one_line_in_a_fresh_interpreter(tmp_path):
    """No mock: an interpreter (``-S``: no site hooks, no .pth file) whose path lacks the lab's files and metadata."""
    runner = ("import sys; sys.path[:] = sys.argv[1].split(':'); "
              "import importlib.util; assert importlib.util.find_spec('ropekit_lab') is None; "
              "from ropekit.cli import main; sys.exit(main(sys.argv[2:]))")
    path = ":".join([str(ROOT / "src"), *path_without_the_lab(tmp_path)])
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    python = [sys.executable, "-S", "-c", runner, path]
    report, help_, inspect = run_all([[*python, "report", "--out", str(tmp_path / "r")], [*python, "--help"],
                                      [*python, "inspect", "--preset", "llama-2"]], env=env)
    assert report.returncode == 2 and report.stdout == "", report.stderr
    assert report.stderr == f"ropekit report: error: report is a verb of the lab, which is not installed: {LAB}\n"
    assert not (tmp_path / "r").exists()
    assert help_.returncode == 0 and "inspect" in help_.stdout and "extrapolate" not in help_.stdout, help_.stderr
    assert inspect.returncode == 0 and "rope type default" in inspect.stdout, inspect.stderr
