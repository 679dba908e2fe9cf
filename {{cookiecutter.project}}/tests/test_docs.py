"""README.md is the front page (at most 300 lines) and docs/ holds one page per topic: every relative link in them
leads to a file that is there and, with a `#anchor`, to a heading of that page (GitHub's slugs) or an `<a id>`; and
every page of docs/ is linked from the README."""

import re
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]  # not tests.helpers: this file imports no torch
README_LINES = 300
FENCE = re.compile(r"^ *```")
HEADING = re.compile(r"^(#{1,6}) +(.+?) *#* *$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def pages(project: Path = PROJECT) -> list[Path]:
    return [project / "README.md", *sorted((project / "docs").glob("*.md"))]


def prose(text: str) -> list[tuple[int, str]]:
    """(number, line) of the lines outside fenced code blocks (a `# comment` in a bash block is no heading, a `[x](y)`
    there no link)."""
    kept, fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fence = not fence
        elif not fence:
            kept.append((number, line))
    return kept


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (`_` and `-` kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a page has: one per heading (a repeated one gets -1, -2, ... as on GitHub), and each <a id>."""
    found, seen = set(), {}
    for _, line in prose(path.read_text()):
        found.update(HTML_ID.findall(line))
        if match := HEADING.match(line):
            base = slug(match[2])
            name = base if base not in seen else f"{base}-{seen[base]}"
            seen[base] = seen.get(base, 0) + 1
            found.add(name)
    return found


def broken_links(path: Path, project: Path = PROJECT) -> list[str]:
    """Each relative link of `path` that leads nowhere, one line each ([]: none)."""
    wrong = []
    for number, line in prose(path.read_text()):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:: not checked here
                continue
            file, _, anchor = target.partition("#")
            where = (path.parent / file).resolve() if file else path
            here = f"{path.relative_to(project)}:{number}: ({target})"
            if not where.exists() or project.resolve() not in [where, *where.parents]:
                wrong.append(f"{here} is no file of the project")
            elif anchor and (where.suffix != ".md" or anchor not in anchors(where)):
                wrong.append(f"{here} names no heading of {where.relative_to(project.resolve())}")
    return wrong


def test_the_readme_is_a_front_page():
    lines = len((PROJECT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines: move the detail to a page of docs/"


def test_every_link_resolves():
    wrong = [line for path in pages() for line in broken_links(path)]
    assert not wrong, "links that lead nowhere:\n" + "\n".join(wrong)


def unlinked(project: Path = PROJECT) -> list[str]:
    """The pages of docs/ that README.md links to nowhere."""
    linked = {target.partition("#")[0] for _, line in prose((project / "README.md").read_text())
              for target in LINK.findall(line)}  # fmt: skip
    return [p.name for p in pages(project)[1:] if f"docs/{p.name}" not in linked]


def test_every_page_is_linked_from_the_readme():
    assert unlinked() == []


def test_the_link_check_can_fail(tmp_path):
    """Negative controls: a missing page, a missing heading, a link out of the project, a page the README does not
    link to; and GitHub's slugs."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.md").write_text('# A page (`a.py`)\n\n## Twice\n\n## Twice\n\n<a id="here"></a>text\n')
    (tmp_path / "docs/c.md").write_text("# Linked from nowhere\n")
    (tmp_path / "README.md").write_text(
        "# X\n\n[ok](docs/a.md#a-page-apy) [ok](docs/a.md#twice-1) [ok](docs/a.md#here) [ok](#x) `[no](code.md)`\n"
        "[gone](docs/b.md) [no heading](docs/a.md#twice-2) [out](../elsewhere.md) [web](https://example.com/#x)\n"
        "```bash\n# not a heading: [nor a link](nowhere.md)\n```\n"
    )
    (tmp_path.parent / "elsewhere.md").write_text("# Elsewhere\n")
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "README.md:4: (docs/b.md) is no file of the project",
        "README.md:4: (docs/a.md#twice-2) names no heading of docs/a.md",
        "README.md:4: (../elsewhere.md) is no file of the project",
    ]
    assert broken_links(tmp_path / "docs/a.md", tmp_path) == [] and unlinked(tmp_path) == ["c.md"]
{% if cookiecutter.with_photos == "yes" %}
    assert slug("Photos: decoding only what the crop keeps (`data.decode`)") == (
        "photos-decoding-only-what-the-crop-keeps-datadecode"
    )
{% endif %}
    assert slug("Same seed, same weights, whatever the loader profile (`rng_mode`)") == (
        "same-seed-same-weights-whatever-the-loader-profile-rng_mode"
    )


# `getattr(dataset, "name"` and kin in the engine: the members it looks up on a data set (docs/data.md's table)
DATA_SET_HOOK = re.compile(r"(?:getattr|hasattr)\((?:self\.)?(?:dataset|train_set|val_set), \"(\w+)\"")


def test_every_data_set_member_the_engine_looks_up_is_in_the_protocol_table():
    section = (PROJECT / "docs/data.md").read_text().split("## What the engine asks of a data set")[1]
    listed = set(re.findall(r"`(\w+)", section))  # each name in code: `classes`, `read(shard, start)`...
    engine = "\n".join(p.read_text() for p in (PROJECT / "{{ cookiecutter.package }}/engine").glob("*.py"))
    looked_up = set(DATA_SET_HOOK.findall(engine))
    assert {"classes", "collate_fn", "sample_source", "epoch_order"} <= looked_up  # the pattern finds them
    assert looked_up <= listed, f"not in docs/data.md: {sorted(looked_up - listed)}"
    # the control: a member the table lacks is found
    assert set(DATA_SET_HOOK.findall('getattr(self.dataset, "warm_up", None)')) - listed == {"warm_up"}
