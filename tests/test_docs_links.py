"""The documentation's cross-references: every relative link in README.md and docs/ leads to a
file, every #anchor to a heading of that page (GitHub's heading ids), and every docs/ page that
the code, configs and scripts name exists. Results pages link to each other and are renamed
or re-headed as they grow; a broken link there goes unseen until a reader follows it."""
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")   # [text](target), not images
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
DOCS_PATH = re.compile(r"docs/[A-Za-z0-9_./-]+\.md")


def heading_ids(page: Path) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces as hyphens,
    -1, -2, ... after a repeat."""
    ids, seen = set(), {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            ids.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return ids


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):   # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest):
            broken.append(f"{target} (no such heading)")
    return broken


def test_heading_ids_follow_githubs_rules(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A compile cache shared by the runs' processes (23:10 UTC)\n## Notes\n"
                    "```\n# not a heading\n```\n## Notes\n### XLA:CPU's `flags`, tried\n")
    assert heading_ids(page) == {"a-compile-cache-shared-by-the-runs-processes-2310-utc", "notes", "notes-1",
                                 "xlacpus-flags-tried"}
    page.write_text("[ok](#notes) [no](#missing) [file](other.md) ![image](gone.png) [web](https://x.org/y)\n"
                    "## Notes\n")
    assert broken_links(page) == ["#missing (no such heading)", "other.md (no such file)"]


@pytest.mark.parametrize("page", [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_every_docs_page_the_code_names_exists():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if tracked.returncode:
        pytest.skip("not a git checkout")
    named = {}
    for name in tracked.stdout.split():
        path = REPO / name
        if path.suffix in (".py", ".sh", ".toml", ".ipynb", "") and path.is_file():
            for ref in DOCS_PATH.findall(path.read_text(errors="replace")):
                named.setdefault(ref, name)
    assert named   # the code does name pages (configs, .ci/run, the benchmarks)
    assert {ref: where for ref, where in named.items() if not (REPO / ref).exists()} == {}


def test_every_results_page_is_in_the_index():
    """docs/results/README.md lists every dated page (and nothing that is not there), each with
    a status: current beside the index, superseded or historical under archive/."""
    index = REPO / "docs" / "results" / "README.md"
    rows = [line for line in index.read_text().splitlines() if line.startswith("| 20")]
    listed = {(index.parent / target).resolve() for row in rows for target in LINK.findall(row)}
    pages = {p.resolve() for p in [*index.parent.glob("20*.md"), *index.parent.glob("archive/20*.md")]}
    assert pages - listed == set(), "pages missing from docs/results/README.md"
    assert listed - pages == set()
    for row in rows:
        status = row.rstrip(" |").split("|")[-1].strip().split()[0]
        archived = "](archive/" in row
        assert status in (("superseded", "historical") if archived else ("current",)), row
