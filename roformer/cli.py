"""What every command line (`python -m roformer.<command>`) shares.

- **User errors** print one line, `error: <what is wrong>`, on stderr and exit with status 2,
  without a traceback. Which errors are the user's is decided by their type alone, never
  by where they were raised: a `roformer.errors.UserError` (raised where the cause is
  known: `ConfigError` for a value or input the project's checks refuse, `GlueDataError`,
  `UsageError` for a mistyped config key or a missing config file, `WorkdirError` for a
  workdir in use, a regular file, not creatable or not writable, `TrainingStopped` for a
  run whose loss diverged or whose checkpoint could not be written), a command-line usage
  error of absl (`app.UsageError`, `flags.Error`: an unknown flag, a config file whose
  `get_config` refused its argument), and `FileNotFoundError`, which names the missing
  input file, and a write that found the disk (or quota) full (an `OSError` whose errno
  says so, roformer.files.is_disk_full), named with its file, or that met a name too long for
  the file system or a read-only file system (`PATH_ERRNOS`). Anything else (a
  `ValueError` from numpy, say) is a bug and keeps its traceback;
  `ROFORMER_TRACEBACK=1` in the environment shows the traceback of user errors too.
  Ctrl-C prints `error: interrupted (Ctrl-C)` and exits 130 (pretraining instead saves a
  checkpoint and exits 0, as on SIGTERM).
- **Logging:** the project's own progress lines (INFO of the `roformer` loggers) show;
  library INFO lines (jax, orbax, absl) do not, nor XLA's own C++ log lines (its slow-compile
  alarm; roformer.native_logs), unless `--verbosity`/`-v` is given: 0 shows INFO, 1 DEBUG,
  -1 warnings only (for every logger).
- **`--help`** prints the command's usage and every config key with its default (of the
  file given with `--config`, else of the command's default config file) and exits 0.
- **One flag style:** every command's flags are absl flags, `--name=value` or `--name value`,
  a list as `--name=a,b,c`, a boolean as `--name` / `--noname`; a command with subcommands
  (`python -m roformer.convert to-hf`, `roformer.bench cost`, `roformer.data prepare`,
  `roformer.study report`) takes the subcommand as its first positional argument. The
  commands with a config file run through `run` (flags in absl's global FLAGS, defined when
  the module runs as a program); the others define theirs in a `CommandFlags` of their own,
  which a test can parse in-process as often as it likes.
"""
from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import logging
import os
import re
import runpy
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from absl import app, flags

from roformer import config_files, native_logs
from roformer.errors import UserError
from roformer.files import DISK_FULL_ERRNOS
from roformer.host_memory import retain_host_memory

CONFIG_DIR = config_files.CONFIG_DIR   # the commands' default config files
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130   # the shell's status for a process ended by SIGINT
TRACEBACK_ENV = "ROFORMER_TRACEBACK"
_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort")


class UsageError(UserError):
    """A command-line mistake: unknown config key or flag, missing config file, stray arguments."""


# The user's to fix, by type (see the module doc).
USER_ERRORS = (UserError, app.UsageError, flags.Error, FileNotFoundError)
# A path the user gave that the file system cannot hold: a name too long (most allow 255
# bytes a name), or a file system mounted read-only.
PATH_ERRNOS = (errno.ENAMETOOLONG, errno.EROFS)


def is_user_error(error: BaseException) -> bool:
    """Whether `error` is the user's to fix (see the module doc); False means a bug."""
    return isinstance(error, USER_ERRORS) or (isinstance(error, OSError) and error.errno in (*DISK_FULL_ERRNOS,
                                                                                             *PATH_ERRNOS))


def error_line(error: BaseException) -> str:
    """`error`'s message on one line."""
    if isinstance(error, FileNotFoundError) and error.filename:
        return f"no such file or directory: {error.filename}"
    if not isinstance(error, UserError) and isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return (f"could not write {error.filename or 'a file'}: {error.strerror or 'no space left on device'}; "
                "free some space and run the same command again")
    if not isinstance(error, UserError) and isinstance(error, OSError) and error.errno == errno.ENAMETOOLONG:
        return (f"a name in {error.filename or 'a path'} is too long for the file system (most allow 255 bytes a "
                "name): choose a shorter one")
    if not isinstance(error, UserError) and isinstance(error, OSError) and error.errno == errno.EROFS:
        return f"could not write {error.filename or 'a file'}: the file system is read-only; choose a writable place"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        # absl/ml_collections put the traceback of a failing get_config() into the
        # message: keep its first line and the error at its end.
        head = lines[0].replace("Error whilst parsing config file:", "").strip()
        return f"{head} {re.sub(r'^[A-Za-z_.]*Error: ', '', lines[-1])}"
    text = ""
    for line in lines:
        text += line if not text else (" " if text.endswith(":") else "; ") + line
    return text or type(error).__name__


def show_tracebacks() -> bool:
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn a user error raised in the block into one stderr line and exit status 2, and
    Ctrl-C (where the command does not stop cleanly on it itself) into one line and 130."""
    try:
        yield
    except KeyboardInterrupt:
        if show_tracebacks():
            raise
        print("error: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except Exception as error:  # noqa: BLE001 - anything else is re-raised untouched
        if show_tracebacks() or not is_user_error(error):
            if native_logs.hidden() and not is_user_error(error):
                print(f"note: {native_logs.hint()}", file=sys.stderr, flush=True)
            raise
        print(f"error: {error_line(error)}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None


def entry_point(main: Callable) -> Callable:
    """Decorator for a command's `main(argv)` (argv without the program name, parsed with
    `CommandFlags`): user errors become one line and status 2."""
    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        with user_errors():
            return main(*args, **kwargs)
    return wrapped


# --------------------------------------------------------------------------- absl entry points


def run(main: Callable[[list[str]], object], *, doc: str, default_config: str | Path | None = None,
        help_config: str | Path | None = None) -> None:
    """`absl.app.run(main)` with this module's errors, logging and `--help`.

    `doc` heads the help text. `default_config` is the config file used when the command
    line gives no `--config` (define the flag with default None: ml_collections would
    apply the overrides to a default at import, before any error handling);
    `help_config` is the file `--help` lists when neither is given."""
    retain_host_memory()   # before jax runs anything; see host_memory.py
    if default_config is not None and config_spec(sys.argv) is None:
        sys.argv.insert(1, f"--config={default_config}")   # the config flag reads sys.argv itself
    resolve_config_arg(sys.argv)
    parse = functools.partial(_parse_flags, doc=doc, help_config=help_config)
    app.run(functools.partial(_run_main, main), argv=sys.argv, flags_parser=parse)


def _run_main(main, argv):
    _configure_logging()
    with user_errors():
        return main(argv)


def _configure_logging() -> None:
    """Library INFO off, the project's INFO on; an explicit --verbosity rules every logger.
    (absl already set the root level from --verbosity while parsing flags.)"""
    if flags.FLAGS["verbosity"].present:
        logging.getLogger("roformer").setLevel(logging.NOTSET)
    else:
        logging.getLogger().setLevel(logging.WARNING)
        logging.getLogger("roformer").setLevel(logging.INFO)
        native_logs.hide()   # XLA's C++ lines too (the slow-compile alarm); before jax runs anything


def _parse_flags(argv: list[str], *, doc: str, help_config) -> list[str]:
    with user_errors():
        given = config_spec(argv)
        spec = given or (str(help_config) if help_config else None)
        if spec is not None:
            path = spec.split(":", 1)[0]
            if not Path(path).is_file():
                raise UsageError(f"--config={spec}: no such config file {path}")
        if asks_for_help(argv):
            print(help_text(doc, spec, given=given is not None))
            raise SystemExit(0)
        try:
            return flags.FLAGS(argv)
        except ImportError as error:   # the config file's own imports
            message = spec and config_files.old_import(error, spec)
            if not message:
                raise
            raise UsageError(message) from error
        except (AttributeError, KeyError) as error:   # ml_collections: an override names no key
            message = spec and _unknown_key_message(spec, argv)
            if not message:
                raise
            raise UsageError(message) from error


def resolve_config_arg(argv: list[str]) -> None:
    """Point --config=configs/<name>.py at this installation's file when the working
    directory has none (roformer.config_files.resolve), in place."""
    for i, arg in enumerate(argv[1:], start=1):
        match = re.match(r"^--?config(=|$)", arg)
        if match and match.group(1):
            argv[i] = f"{arg.split('=', 1)[0]}={config_files.resolve(arg.split('=', 1)[1])}"
            return
        if match and i + 1 < len(argv):
            argv[i + 1] = config_files.resolve(argv[i + 1])
            return


def asks_for_help(argv: list[str]) -> bool:
    """Whether the command line (`argv[0]` the program) asks for --help, in any of absl's spellings."""
    return any(arg in _HELP_FLAGS for arg in argv[1:])


def config_spec(argv: list[str]) -> str | None:
    """The value of --config (`path[:arg]`) on the command line, if given."""
    for i, arg in enumerate(argv[1:], start=1):
        match = re.match(r"^--?config(=|$)", arg)
        if match:
            return arg.split("=", 1)[1] if match.group(1) else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def load_config(spec: str):
    """`get_config([arg])` of the config file `path[:arg]`, called as --config calls it."""
    path, colon, arg = spec.partition(":")
    try:
        get_config = runpy.run_path(path)["get_config"]
    except ImportError as error:
        message = config_files.old_import(error, spec)
        if not message:
            raise
        raise UsageError(message) from error
    return get_config(arg) if colon else get_config()


def _unknown_key_message(spec: str, argv: list[str]) -> str | None:
    config = load_config(spec)
    for arg in argv[1:]:
        match = re.match(r"^--?(?:no)?config\.([^=]+)", arg)
        if match:
            message = unknown_key(config, match.group(1))
            if message:
                return f"--config.{match.group(1)}: {spec} {message}"
    return None


def unknown_key(config, path: str) -> str | None:
    """None if the dotted `path` names a key of `config`, else what is wrong, with the
    closest existing key."""
    # imported here: `python -m roformer.bench gpu` runs this module on hosts with only jax,
    # flax, optax and orbax (absl comes with orbax), and only config keys need ml_collections
    import ml_collections

    node, seen = config, []
    for part in path.split("."):
        if not isinstance(node, ml_collections.ConfigDict):
            return f"has a value, not a section, at {'.'.join(seen)}"
        if part not in node:
            keys = list(node.keys())
            close = difflib.get_close_matches(part, keys, n=1)
            message = f"has no key {'.'.join(seen + [part])}"
            if close:
                return f"{message}; did you mean --config.{'.'.join(seen + close)}?"
            return f"{message}; {'.'.join(seen) or 'the top level'} has: {', '.join(keys)}"
        node, seen = node[part], seen + [part]
    return None


def help_text(doc: str, spec: str | None, *, given: bool = True) -> str:
    """The command's doc, its flags and every key of the config file `spec` with its
    default (`given`: spec came from the command line rather than the command's default)."""
    lines = [doc.strip(), "", "flags:"]
    for flag in flags.FLAGS.get_key_flags_for_module(sys.argv[0]):
        lines.append(f"  --{flag.name}: {flag.help}")
    lines += ["  --verbosity=N, -v N: library log lines (jax, orbax): 0 INFO, 1 DEBUG, -1 warnings only "
              "(default: only this project's progress lines)",
              f"environment: {TRACEBACK_ENV}=1 shows the traceback of an error", ""]
    if spec is None:
        return "\n".join(lines + ["give --config=FILE with --help to list that file's keys"])
    shown = _short_path(spec)
    lines.append(f"config keys of {shown} with their defaults; set any with --config.<key>=VALUE"
                 + ("" if given else " (give --config=FILE --help for another file's values)") + ":")
    keys = list(_flatten(load_config(spec).to_dict()))
    keys.sort(key=lambda item: "." in item[0])   # top-level settings first, then each section
    section = ""
    for key, value in keys:
        top = key.split(".", 1)[0] if "." in key else ""
        if top != section:
            lines += [""] if lines[-1].startswith("  ") else []
            section = top
        lines.append(f"  {key} = {value!r}")
    return "\n".join(lines)


def _short_path(spec: str) -> str:
    relative = os.path.relpath(spec)
    return spec if relative.startswith("..") else relative


def _flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


# --------------------------------------------------------------------------- commands without a config file


class CommandFlags:
    """The flags of a command that reads no config file (convert, evaluate, bench, data's
    tokenizer), as absl flags in a `FlagValues` of their own: `define` them, then `parse`
    the command line into a namespace (`--seq-lens` is `args.seq_lens`).

    A flag keeps its `default` object as it is when not given (a list of ints, None); a
    given value is converted with `type` and checked against `choices`, and one that does
    not convert is a `UsageError` naming the flag."""

    def __init__(self, usage: str):
        self.usage = usage
        self.flag_values = flags.FlagValues()
        self._specs: dict[str, tuple] = {}   # name -> (default, type, choices, list-valued)
        self._required: list[str] = []

    def define(self, name: str, *, default=None, help: str = "", type: Callable = str,
               choices: Sequence | None = None, many: bool = False, repeat: bool = False,
               metavar: str | None = None, required: bool = False) -> None:
        """A flag `--name`: `type=bool` a switch (`--name`/`--noname`); `many` a list given as
        `--name=a,b`; `repeat` a list given as `--name=a --name=b` (for values holding commas
        or spaces); `metavar` names the value in --help."""
        name, values = name.lstrip("-"), self.flag_values
        text = f"{help} " if help else ""
        if choices is not None:
            text += f"[{'|'.join(map(str, choices))}{', comma-separated' if many else ''}]"
        elif many:
            text += "[comma-separated]" if metavar is None else f"[{metavar},...]"
        elif repeat or metavar:
            text += f"[{metavar or 'VALUE'}{'; repeat the flag for more' if repeat else ''}]"
        if type is bool:
            default = bool(default)
            flags.DEFINE_boolean(name, default, text.strip(), flag_values=values)
        elif repeat:
            flags.DEFINE_multi_string(name, None, text.strip(), flag_values=values)
        elif many:
            flags.DEFINE_list(name, None, text.strip(), flag_values=values)
        else:
            flags.DEFINE_string(name, None, text.strip(), flag_values=values)
        self._specs[name] = (default, type, choices, many or repeat)
        if required:
            self._required.append(name)

    def parse(self, argv: Sequence[str]) -> tuple[types.SimpleNamespace, list[str]]:
        """(the flags' values, the positional arguments) of `argv` (without the program name);
        `--help` prints `help_text()` and exits 0."""
        if asks_for_help(["", *argv]):
            print(self.help_text())
            raise SystemExit(0)
        self.flag_values.unparse_flags()   # a second parse starts from the defaults again
        positional = self.flag_values(["", *argv])[1:]
        missing = [f"--{name}" for name in self._required if not self.flag_values[name].present]
        if missing:
            raise UsageError(f"{' and '.join(missing)} required (see --help)")
        values = {}
        for name, (default, convert, choices, is_list) in self._specs.items():
            flag = self.flag_values[name]
            if not flag.present:
                values[name.replace("-", "_")] = default
                continue
            given = flag.value
            converted = [self._convert(name, item, convert, choices) for item in given] if is_list else (
                self._convert(name, given, convert, choices) if convert is not bool else given)
            values[name.replace("-", "_")] = converted
        return types.SimpleNamespace(**values), positional

    @staticmethod
    def _convert(name: str, text: str, convert: Callable, choices: Sequence | None):
        try:
            value = convert(text)
        except (TypeError, ValueError) as error:
            raise UsageError(f"--{name}={text}: {error}") from None
        if choices is not None and value not in choices:
            raise UsageError(f"--{name}={text}: not one of {', '.join(map(str, choices))}")
        return value

    def help_text(self) -> str:
        """The usage, then every flag with its help and default."""
        lines = [self.usage.strip(), "", "flags:"]
        for name, (default, _, _, is_list) in self._specs.items():
            shown = ",".join(map(str, default)) if is_list and default else default
            text = self.flag_values[name].help.replace("(no help available)", "").strip()
            if shown not in (None, "", False, []) and "default" not in text:
                text = f"{text} (default: {shown})".strip()
            lines.append(f"  --{name}: {text}".rstrip())
        lines.append(f"environment: {TRACEBACK_ENV}=1 shows the traceback of an error")
        return "\n".join(lines)
