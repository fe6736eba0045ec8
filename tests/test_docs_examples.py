"""Every Python example in README.md and docs/ runs as written (the library example
raised after `undo`). The blocks of a file run in order in one namespace, on the offline demo
model: a hub id in an example is replaced by "demo", the one change made to the text."""

import re
from pathlib import Path

import pytest

from app_server import ROOT

FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HUB_LOAD = re.compile(r'ChatEngine\.load\("[^"]+/[^"]+"\)')


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("path", [p for p in FILES if python_blocks(p)], ids=lambda p: p.name)
def test_every_python_example_runs_as_written(path, capsys):
    namespace: dict = {}
    for block in python_blocks(path):
        exec(compile(HUB_LOAD.sub('ChatEngine.load("demo")', block), str(path), "exec"), namespace)
    assert "conv" in namespace or "engine" in namespace  # the examples ran, they were not skipped


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces as -)."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_link_between_readme_and_docs_resolves(path):
    """The README was split into docs/: a link to a moved section must follow it."""
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if link.startswith(("http://", "https://")):
            continue
        target_name, _, anchor = link.partition("#")
        target = path.parent / target_name if target_name else path
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in heading_anchors(target.read_text())):
            broken.append(link)
    assert not broken
