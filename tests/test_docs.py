"""The documentation: README.md is the front page and links every page of docs/; every relative link in README.md and
docs/*.md leads to a file that exists; docs/configuration.md is what `make docs` generates from the recipes' config
dataclasses (verl_kit.config_reference), so a flag added, renamed or re-documented shows up here until it is rerun."""

import re
from pathlib import Path

import pytest

from verl_kit import config_reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def links(page: Path) -> list[str]:
    """The targets of the page's inline links and images, outside fenced code blocks."""
    return LINK.findall(FENCE.sub("", page.read_text()))


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith("#")


def test_docs_exist():
    assert DOCS, "docs/*.md: no pages"


def test_configuration_reference_is_current():
    generated = config_reference.reference()
    checked_in = (ROOT / "docs" / "configuration.md").read_text()
    assert checked_in == generated, ("docs/configuration.md differs from the recipes' config dataclasses: run "
                                     "`make docs` and commit docs/configuration.md")


def test_configuration_reference_covers_every_recipe():
    text = (ROOT / "docs" / "configuration.md").read_text()
    recipes = [p for p in (ROOT / "recipes").glob("*.py") if not p.name.startswith("_")]
    assert {"sft", "reward_model", "dpo", "kto", "ppo", "grpo"} <= {p.stem for p in recipes}
    for p in recipes:
        assert f"\n## {p.stem}\n" in text, f"docs/configuration.md has no section for recipes/{p.name}: run `make docs`"


def test_every_docs_page_is_linked_from_readme():
    readme = ROOT / "README.md"
    linked = {(readme.parent / t.split("#")[0]).resolve() for t in links(readme) if relative(t)}
    missing = [p.relative_to(ROOT).as_posix() for p in DOCS if p.resolve() not in linked]
    assert not missing, f"README.md links none of: {', '.join(missing)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = [t for t in links(page) if relative(t) and t.split("#")[0]
              and not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {', '.join(broken)}"
