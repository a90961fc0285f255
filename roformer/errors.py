"""Errors that are the user's to fix, as types.

Code that knows the cause of a problem (a setting out of range, a file in the wrong format,
a workdir another run holds) raises a `UserError` with a message that says what is wrong
and what to do; the command lines (roformer.cli) print such an error on one line and exit
with status 2. Every other exception is a bug and keeps its traceback. A library error whose
cause is known where it is caught is wrapped: `raise ConfigError("...") from error`.
"""
from __future__ import annotations


class UserError(Exception):
    """A problem in the user's input, files or environment, said in one line."""


class ConfigError(UserError, ValueError):
    """A config value or an input the project's own checks refuse (also a ValueError, as
    callers that check values expect)."""


class NotWritable(UserError, OSError):
    """A directory a command must write into cannot be written (read-only, no permission),
    found before the command computes what it would write (roformer.files.check_writable)."""


class StorageError(UserError, OSError):
    """A file could not be written because the disk (or the user's quota) is full; the
    message names what was being written (roformer.files.writing)."""


class DataBuildError(UserError):
    """The token cache of a corpus could not be built (a source that failed while it was read
    or tokenized); the message names the cache entry and the cause."""
