"""XLA's own C++ log lines (its "Very slow compile?" alarm, at ERROR level) stay out of the
commands' logs unless --verbosity asks for library lines (roformer.native_logs, roformer.cli).

The alarm needs a compile of over two minutes; the tests provoke an ERROR line of the same
channel cheaply instead: XLA_FLAGS=--xla_dump_to=<a path under a regular file> makes XLA log
that it cannot create the dump directory when it compiles."""
import os
import subprocess
import sys
import textwrap

import pytest

from roformer import native_logs

COMMAND = textwrap.dedent("""
    from roformer import cli

    def main(argv):
        import jax, jax.numpy as jnp
        print("result", float(jax.jit(lambda x: x + 1)(jnp.ones(())).block_until_ready()), flush=True)
        if len(argv) > 1:   # a stray argument: the command fails as a bug would
            raise RuntimeError("a bug")

    cli.run(main, doc="a command that compiles one program")
""")


def run_command(tmp_path, *args, env_extra=None):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_dump_to={blocker}/dump",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    env.pop(native_logs.ENV, None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", COMMAND, *args], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_xla_error_lines_are_off_by_default_and_back_with_verbosity(tmp_path):
    quiet = run_command(tmp_path)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "result 2.0" in quiet.stdout
    assert "Could not create directory" not in quiet.stderr and "dump.cc" not in quiet.stderr, quiet.stderr
    # The same command with library lines asked for: XLA's line is there (the channel is live).
    loud = run_command(tmp_path, "--verbosity=0")
    assert loud.returncode == 0, loud.stderr[-2000:]
    assert "Could not create directory" in loud.stderr
    # The user's own level rules.
    theirs = run_command(tmp_path, env_extra={native_logs.ENV: "0"})
    assert "Could not create directory" in theirs.stderr


@pytest.mark.slow
def test_a_failing_command_says_how_to_see_the_hidden_lines(tmp_path):
    failed = run_command(tmp_path, "extra-argument")
    assert failed.returncode != 0
    assert "RuntimeError: a bug" in failed.stderr
    assert "run again with --verbosity=0" in failed.stderr and "Could not create directory" not in failed.stderr


def test_hide_keeps_the_users_level(monkeypatch):
    monkeypatch.setattr(native_logs, "_hidden", False)
    monkeypatch.setenv(native_logs.ENV, "1")
    assert native_logs.hide() is False and os.environ[native_logs.ENV] == "1" and not native_logs.hidden()
    monkeypatch.delenv(native_logs.ENV)
    calls = []
    monkeypatch.setattr(native_logs, "_set_jaxlib_level", calls.append)
    monkeypatch.setitem(sys.modules, "jaxlib", sys.modules.get("jaxlib") or object())
    assert native_logs.hide() is True and os.environ[native_logs.ENV] == "3" and native_logs.hidden()
    assert calls == [3]   # a jaxlib imported before read the environment already: its level is set too
