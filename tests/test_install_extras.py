"""The accelerator install lines of the README resolve: each extra of ours passes through to an
extra that the installed jax declares, and the README names the same extras."""
import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACCELERATOR_EXTRAS = {"cuda12": "jax[cuda12]", "cuda13": "jax[cuda13]", "tpu": "jax[tpu]"}


def test_each_accelerator_extra_is_one_that_jax_declares():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    jax_extras = set(importlib.metadata.metadata("jax").get_all("Provides-Extra"))
    for ours, requirement in ACCELERATOR_EXTRAS.items():
        assert extras[ours] == [requirement]
        assert re.fullmatch(r"jax\[(\w+)\]", requirement).group(1) in jax_extras, requirement


@pytest.mark.parametrize("extra", sorted(ACCELERATOR_EXTRAS))
def test_the_readme_and_the_install_page_give_each_accelerator_line(extra):
    for page in ("README.md", "docs/install.md"):
        assert f'".[{extra}]"' in (ROOT / page).read_text(), (page, extra)
    assert f'pip install -e ".[{extra}]"' in (ROOT / "docs/install.md").read_text()
