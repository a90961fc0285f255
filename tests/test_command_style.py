"""One command style for every entry point (roformer/cli.py): absl flags, `--help` that lists
the command's flags and exits 0, a user error on one stderr line with status 2.

The inventory below is the list of programs in roformer/: a module that grows an
`if __name__ == "__main__":` block must be named here, as a command (and pass the tests
below) or as an internal worker that only the project's own code starts."""
import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from helpers import patient
from roformer import cli, console_scripts

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "roformer"

# module run with -m -> (--help's arguments, a flag its help must list, a user error's arguments)
COMMANDS = {
    "roformer.pretrain": (["--help"], "--workdir:", ["--config=configs/tiny.py"]),
    "roformer.glue": (["--help"], "--eval_only:", ["--workdir=unused", "stray"]),
    "roformer.ablate": (["--help"], "--report_to:", ["--config=configs/ablation.py:smoke", "--workdir=unused", "stray"]),
    "roformer.capability": (["--help"], "config keys of configs/capability.py", ["--config=configs/capability.py:smoke", "--workdir=unused",
                                                        "stray"]),
    "roformer.study": (["--help"], "--workdir:", ["no_such_command"]),
    "roformer.data": (["prepare", "--help"], "--processes:", ["tokenizer", "encode", "some text"]),
    "roformer.convert": (["--help"], "--rope-layout:", ["to-hf", "only_one_directory"]),
    "roformer.evaluate": (["--help"], "--eval-batches:", ["--step=3"]),
    "roformer.bench": (["step", "--help"], "--seq-lens: [comma-separated] (default: 128,512)", ["step", "--seq-lens=128,many"]),
}
# Started by the project's own code with a protocol of their own, never by a user.
WORKERS = {
    "roformer.ablation.job": "one run of a parallel ablation (roformer.ablation.parallel)",
    "roformer.data.workers": "a batch-making worker process (roformer.data.workers.WorkerStreams)",
    "roformer.bench.runs": "a run of the runs benchmark in a process of its own (--worker)",
    "roformer.bench.hf_torch_peer": "the PyTorch peer of the hf benchmark",
    "roformer.bench.hf_flax_peer": "the transformers Flax peer of the hf benchmark",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__main__" else parts)


def sources() -> dict[str, ast.Module]:
    return {module_name(path): ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def runs_as_program(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test)
               for node in tree.body)


@pytest.mark.fast
def test_no_module_or_script_parses_its_command_line_with_argparse():
    """absl flags are the one flag parser (roformer.cli.run, roformer.cli.CommandFlags), in the
    package and in scripts/ alike."""
    offenders = []
    scripts = {path.name: ast.parse(path.read_text()) for path in sorted((REPO / "scripts").glob("*.py"))}
    for name, tree in {**sources(), **scripts}.items():
        for node in ast.walk(tree):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) else [])
            if any((n or "").split(".")[0] in ("argparse", "optparse", "getopt", "click") for n in names):
                offenders.append(name)
    assert not offenders, f"use roformer.cli (absl flags) instead of another parser in: {offenders}"


@pytest.mark.fast
def test_every_program_in_the_package_is_a_listed_command_or_worker():
    programs = {name for name, tree in sources().items() if runs_as_program(tree)}
    assert programs == {*COMMANDS, *WORKERS}, programs ^ {*COMMANDS, *WORKERS}
    for name in COMMANDS:   # each command goes through roformer/cli.py's runner or error handling
        path = PACKAGE.parent / name.replace(".", "/")
        text = (path / "__main__.py" if path.is_dir() else path.with_suffix(".py")).read_text()
        assert "cli.run(" in text or "@cli.entry_point" in text, name


@pytest.mark.fast
def test_every_console_script_runs_a_command():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {f"roformer-{name.split('.')[1]}" for name in COMMANDS}
    for script, target in scripts.items():
        module, function = target.split(":")
        assert module == "roformer.console_scripts" and callable(getattr(console_scripts, function)), script


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=patient(300))


@pytest.mark.slow   # two processes a command, most of their time importing jax: 20-60 s each on a busy 2-core host
@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_lists_the_flags_and_a_user_error_is_one_line(command, tmp_path):
    help_args, flag, error_args = COMMANDS[command]
    shown = run(command, *help_args)
    assert shown.returncode == 0 and flag in shown.stdout, (shown.stdout[-2000:], shown.stderr[-2000:])
    refused = run(command, *(arg.replace("unused", str(tmp_path / "unused")) for arg in error_args))
    lines = refused.stderr.splitlines()
    assert refused.returncode == cli.EXIT_USER_ERROR and len(lines) == 1 and lines[0].startswith("error: "), (
        refused.returncode, refused.stderr[-3000:])
    assert not (tmp_path / "unused").exists()


@pytest.mark.fast
def test_command_flags_parse_lists_switches_and_defaults():
    command = cli.CommandFlags("usage")
    command.define("--seq-lens", type=int, many=True, default=[128, 512])
    command.define("--scheme", default="rope", choices=("rope", "t5"))
    command.define("--whole-word", type=bool)
    command.define("--flag-set", repeat=True)
    command.define("--out", required=True)
    args, rest = command.parse(["a", "--seq-lens=16,32", "--whole-word", "--flag-set=--x=1 --y", "--flag-set", "",
                                "--out", "o", "b"])
    assert (args.seq_lens, args.scheme, args.whole_word, args.flag_set, args.out, rest) == (
        [16, 32], "rope", True, ["--x=1 --y", ""], "o", ["a", "b"])
    defaults, _ = command.parse(["--out=o"])
    assert (defaults.seq_lens, defaults.whole_word, defaults.flag_set) == ([128, 512], False, None)
    for argv, message in ((["--out=o", "--seq-lens=16,x"], "--seq-lens=x: invalid literal"),
                          (["--out=o", "--scheme=alibi"], "--scheme=alibi: not one of rope, t5"),
                          ([], "--out required")):
        with pytest.raises(cli.UsageError, match=message):
            command.parse(argv)
    assert "  --seq-lens: [comma-separated] (default: 128,512)" in command.help_text().splitlines()
