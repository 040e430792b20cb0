"""The documentation can be navigated and its lists that name code match the code (issue 48,
item 5): the README links every page of docs/, every link between them resolves, the README
stays short, and the tables of layer kinds, flavors and Hugging Face families, and the files
the pages name, are compared with the registries and the tree."""

from __future__ import annotations

import re
from pathlib import Path

from tests.launch import REPO_ROOT

DOCS = REPO_ROOT / "docs"
README = REPO_ROOT / "README.md"
PAGES = sorted(DOCS.glob("*.md"))
# Files a page names that are not ours: the user's registry, Megatron's layer allocation.
NOT_OURS = {"my_registry.py", "hybrid_layer_allocation.py", "hybrid_block.py"}


def text(path: Path) -> str:
    return path.read_text()


def table_rows(page: str, header: str) -> list[list[str]]:
    """The cells of each row of the table whose header row starts with `header`."""
    lines = page.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(header))
    rows = []
    for line in lines[start + 2:]:  # past the header and its --- row
        if not line.strip().startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_readme_is_short():
    lines = len(text(README).splitlines())
    assert lines <= 250, f"README.md has {lines} lines; the details belong in docs/"


def test_the_readme_links_every_page_and_every_linked_page_exists():
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]+)?\)", text(README)))
    assert linked, "README.md links no page of docs/"
    missing = sorted(page for page in linked if not (REPO_ROOT / page).is_file())
    assert missing == [], missing
    unlinked = sorted(str(page.relative_to(REPO_ROOT)) for page in PAGES
                      if str(page.relative_to(REPO_ROOT)) not in linked)
    assert unlinked == [], f"pages the README does not link: {unlinked}"


def test_every_link_to_a_page_resolves():
    """Markdown links to .md files (relative to the page) and `docs/...md` mentions (relative to
    the repository) lead to a file, and an #anchor to one of its headings."""
    broken = []
    for page in [README, *PAGES]:
        body = text(page)
        targets = [(page.parent / link, anchor) for link, anchor in
                   re.findall(r"\]\(([\w./-]+\.md)(?:#([\w-]+))?\)", body)]
        targets += [(REPO_ROOT / link, None)
                    for link in re.findall(r"(?<![\w/])(docs/[\w.-]+\.md)", body)]
        for target, anchor in targets:
            if not target.is_file():
                broken.append(f"{page.name}: {target}")
            elif anchor:
                headings = {re.sub(r"[^\w -]", "", h).strip().lower().replace(" ", "-")
                            for h in re.findall(r"^#+ (.+)$", text(target), re.M)}
                if anchor not in headings:
                    broken.append(f"{page.name}: {target.name}#{anchor}")
    assert broken == [], broken


def test_the_files_the_pages_name_exist():
    """Every `path.py` a page names (relative to the repository or to titan_hybrid/, or a bare
    file name found under them) is there, so a move or a rename cannot leave a stale name."""
    tree = {path.name for folder in ("titan_hybrid", "bench", "tests", "scripts")
            for path in (REPO_ROOT / folder).rglob("*.py")}
    stale = []
    for page in [README, *PAGES]:
        for name in re.findall(r"`([\w./-]+\.py)`", text(page)):
            if name in NOT_OURS:
                continue
            found = ((REPO_ROOT / name).is_file() or (REPO_ROOT / "titan_hybrid" / name).is_file()
                     or ("/" not in name and name in tree))
            if not found:
                stale.append(f"{page.name}: {name}")
    assert stale == [], stale


# Where a path in the package's own text may point outside the tree: the upstream packages
# whose files its docstrings and comments cite.
UPSTREAM = ("torch/", "fla/", "megatron/", "mamba_ssm/", "torchtitan/", "transformers/")


def test_the_files_the_package_names_exist():
    """The same check over the package's own text (docstrings and comments): every
    `path.py` it names is there, relative to the repository, to titan_hybrid/ or to the naming
    module's package (or a bare file name found in the tree), unless it is an upstream file."""
    tree = {path.name for folder in ("titan_hybrid", "bench", "tests", "scripts")
            for path in (REPO_ROOT / folder).rglob("*.py")}
    stale = []
    for module in sorted((REPO_ROOT / "titan_hybrid").rglob("*.py")):
        for name in re.findall(r"(?<![\w.])([\w/]+\.py)\b", text(module)):
            if name in NOT_OURS or name.startswith(UPSTREAM):
                continue
            bases = (REPO_ROOT, REPO_ROOT / "titan_hybrid", module.parent, module.parent.parent)
            if not (any((base / name).is_file() for base in bases)
                    or ("/" not in name and name in tree)):
                stale.append(f"{module.relative_to(REPO_ROOT)}: {name}")
    assert stale == [], stale


def test_the_package_layout_names_only_modules_that_exist():
    """The other direction of test_import_graph's check: every file the layout block of
    docs/architecture.md names is a file of the package (or of the tree it lists)."""
    page = text(DOCS / "architecture.md")
    block = page[page.index("titan_hybrid/\n  launch.py"):]
    block = block[:block.index("```")]
    tree = {path.name for path in REPO_ROOT.rglob("*.py") if ".venv" not in path.parts}
    stale = sorted(set(re.findall(r"\b(\w+\.py)\b", block)) - tree)
    assert stale == [], stale


def test_the_kinds_table_is_the_layer_kinds_registry():
    """docs/patterns.md's table of layer kinds: one row per kind of LAYER_KINDS, in its order,
    each with the kind's title and the module that builds it."""
    from titan_hybrid.model.layer_kinds import LAYER_KINDS

    rows = table_rows(text(DOCS / "patterns.md"), "| symbol | layer | module |")
    assert [ticked(symbol)[0] for symbol, _, _ in rows] == list(LAYER_KINDS)
    for (symbol, layer, module), kind in zip(rows, LAYER_KINDS.values(), strict=True):
        assert kind.title.lower() in layer.lower(), (symbol, kind.title, layer)
        built_by = kind.build.__module__.removeprefix("titan_hybrid.").replace(".", "/")
        assert ticked(module) == [f"{built_by}.py"], (symbol, module)


def test_the_pattern_page_names_every_variant():
    """docs/patterns.md names each variant option (`hybrid.m_layers`, ...) and each of its
    values, as layer_kinds.VARIANTS has them, with the module that builds it."""
    from titan_hybrid.model.layer_kinds import VARIANTS

    page = text(DOCS / "patterns.md")
    for flag, kinds in VARIANTS.values():
        assert f"--hybrid.{flag}" in page, flag
        for value, kind in kinds.items():
            module = kind.build.__module__.removeprefix("titan_hybrid.").replace(".", "/")
            assert f"`{value}`" in page and f"`{module}.py`" in page, (flag, value, module)


def test_the_flavor_table_is_the_flavor_registry():
    """docs/patterns.md's table of flavors names every flavor once, each with its pattern
    (whole, or its start and end around `...`)."""
    from titan_hybrid.model.args import hybrid_flavors

    shown = {}
    for names, patterns, _ in table_rows(text(DOCS / "patterns.md"), "| flavor | pattern |"):
        names, patterns = ticked(names), ticked(patterns)
        assert len(names) == len(patterns), (names, patterns)
        for name, pattern in zip(names, patterns, strict=True):
            assert name not in shown, name
            shown[name] = pattern
    assert sorted(shown) == sorted(hybrid_flavors), sorted(set(shown) ^ set(hybrid_flavors))
    for name, pattern in shown.items():
        real = hybrid_flavors[name].pattern
        head, dots, tail = pattern.partition("...")
        assert (real.startswith(head) and real.endswith(tail)) if dots else real == pattern, (
            name, pattern, real)


def test_the_hf_page_names_every_family():
    """docs/checkpoints_and_hf.md names every `model_type` the families read and every one
    they refuse, and its family table names no other."""
    from titan_hybrid.hf import families

    page = text(DOCS / "checkpoints_and_hf.md")
    supported = set(families.supported_model_types())
    refused = set(getattr(families, "REFUSED", {}))
    missing = sorted(t for t in supported | refused if f"`{t}`" not in page)
    assert missing == [], missing
    in_table = set()
    for row in table_rows(page, "| family (`model_type`) |"):
        first = row[0].split("(")[0]  # the model types come before the description
        in_table.update(ticked(first))
    assert in_table <= supported, sorted(in_table - supported)
    assert supported <= in_table, sorted(supported - in_table)
