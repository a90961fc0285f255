"""The console scripts an install puts on PATH (pyproject.toml's [project.scripts]):
`roformer-<command> ARGS` is `python -m roformer.<command> ARGS`.

Each runs its module as `python -m` does, as `__main__`: the commands define their flags
and read their arguments only when run as a program.
"""
from __future__ import annotations

import runpy


def _run_module(name: str) -> None:
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def pretrain() -> None:
    _run_module("roformer.pretrain")


def glue() -> None:
    _run_module("roformer.glue")


def ablate() -> None:
    _run_module("roformer.ablate")


def capability() -> None:
    _run_module("roformer.capability")


def convert() -> None:
    _run_module("roformer.convert")


def bench() -> None:
    _run_module("roformer.bench")


def data() -> None:
    _run_module("roformer.data")


def evaluate() -> None:
    _run_module("roformer.evaluate")


def study() -> None:
    _run_module("roformer.study")
