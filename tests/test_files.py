"""roformer.files: one way to replace a file atomically."""
import json

import pytest

from roformer import files

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)


def test_writes_replace_the_file_and_leave_no_staging_file(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    files.write_json_atomic(path, {"a": 1}, indent=1)
    assert json.loads(path.read_text()) == {"a": 1}
    files.write_bytes_atomic(path, b"bytes")
    assert path.read_bytes() == b"bytes"
    files.write_text_atomic(path, "text")
    assert path.read_text() == "text"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with files.replacing(path, "w") as f:
            f.write("half")
            raise RuntimeError("disk full")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_a_figure_is_written_whole_or_not_at_all(tmp_path):
    from matplotlib.figure import Figure

    path = tmp_path / "plot.png"
    figure = Figure(figsize=(2, 2))
    figure.subplots().plot([0, 1], [1, 0])
    files.write_figure_atomic(path, figure, dpi=50)
    assert path.read_bytes().startswith(b"\x89PNG")
    whole = path.read_bytes()

    class Interrupted:   # a stop while the image is being written
        def savefig(self, file, **options):
            file.write(b"\x89PNG half")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files.write_figure_atomic(path, Interrupted())
    assert path.read_bytes() == whole
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]
