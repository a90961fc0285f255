"""Checksums of a checkpoint step's files, so damage that still decodes is found.

orbax reads back whatever decodes: a flipped bit in an array file restores as a changed
value, with no error. So once a save is complete its writer records the size and CRC32 of
every file of the step (the arrays and their metadata, the data-iterator state, the model
config, orbax's step metadata with the optimizer settings) in `<step>/checksums.json`
(`write`), and every reader checks them before it restores (`verify`). A step without that
file (saved before checksums existed, or by a run killed between its save and its
checksums) is restored unverified.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from roformer.files import write_json_atomic

CHECKSUMS = "checksums.json"
FORMAT = 1
_BLOCK = 1 << 24


class ChecksumMismatch(Exception):
    """A checkpoint step's files differ from the checksums saved with them: the step is damaged."""


def write(step_dir: str | Path) -> None:
    """Record every file of the finished step `step_dir` in its checksums.json."""
    step_dir = Path(step_dir)
    files = {name: [size, crc] for name, (size, crc) in _scan(step_dir).items()}
    write_json_atomic(step_dir / CHECKSUMS, {"format": FORMAT, "algorithm": "crc32", "files": files}, indent=None)


def verify(step_dir: str | Path, names: tuple[str, ...] | None = None) -> bool:
    """True when every file recorded for `step_dir` (or those of `names` it recorded) is there
    with its size and CRC32; False when the step has no checksums (restored unverified);
    ChecksumMismatch naming the first file that differs otherwise."""
    step_dir = Path(step_dir)
    path = step_dir / CHECKSUMS
    if not path.is_file():
        return False
    try:
        saved = json.loads(path.read_text())
        files = {str(name): (int(size), int(crc)) for name, (size, crc) in saved["files"].items()}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ChecksumMismatch(f"its {CHECKSUMS} is unreadable ({error})") from None
    for name, (size, crc) in sorted(files.items()):
        if names is not None and name not in names:
            continue
        file = step_dir / name
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            raise ChecksumMismatch(f"{name} is missing") from None
        if actual != size:
            raise ChecksumMismatch(f"{name} has {actual} bytes, {size} when saved")
        if _crc32(file) != crc:
            raise ChecksumMismatch(f"{name} does not match the CRC32 saved with it")
    return True


def _scan(step_dir: Path) -> dict[str, tuple[int, int]]:
    found = {}
    for root, _, names in os.walk(step_dir):
        for name in names:
            file = Path(root) / name
            relative = file.relative_to(step_dir).as_posix()
            if relative != CHECKSUMS:
                found[relative] = (file.stat().st_size, _crc32(file))
    return found


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc
