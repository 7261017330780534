"""README's set-up commands are the ones CI runs, verbatim; the README stays short; every
relative link in README and docs resolves; the examples need only the package and ``models/``."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The README is the first screen a user reads; the rest lives in docs/.
README_MAX_LINES = 150
#: Developer tools that reproduce ``models/`` with the test fixtures' tokenizer and drafter
#: builders (docs/trained-pair.md); the user-facing examples are the other files of examples/.
EXAMPLES_USING_TEST_SUPPORT = ("examples/train/",)


def _first_bash_block(text: str) -> list[str]:
    start = text.index("```bash\n") + len("```bash\n")
    return [line for line in text[start : text.index("```", start)].splitlines() if line.strip()]


def test_readme_starts_with_install_and_test_commands():
    readme = (ROOT / "README.md").read_text()
    install, test = _first_bash_block(readme)
    assert "pip install" in install and "pytest" in test
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci and test in ci
    assert ci.index(install) < ci.index(test)


def test_readme_main_job_command_exists():
    readme = (ROOT / "README.md").read_text()
    rest = readme[readme.index("```", readme.index("```bash\n") + 8) + 3 :]
    (main_job,) = _first_bash_block(rest)
    script = main_job.split()[1]
    assert (ROOT / script).is_file(), main_job


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README has {len(lines)} lines; move detail to docs/"


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (no links live there)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def broken_links(files: list[Path], root: Path) -> list[str]:
    """``file: target (why)`` for every relative link (``[text](target)``, images included) of
    ``files`` whose file does not exist, leaves ``root``, or whose ``#anchor`` is no heading."""
    problems = []
    for path in files:
        for target in re.findall(r"\]\(([^)\s]+)(?: \"[^\"]*\")?\)", _prose(path.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            name = f"{path.relative_to(root)}: {target}"
            if not dest.is_relative_to(root):
                problems.append(f"{name} (outside the repository)")
            elif not dest.exists():
                problems.append(f"{name} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{name} (no heading #{anchor})")
    return problems


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_relative_links_in_readme_and_docs_resolve():
    problems = broken_links(_docs(), ROOT)
    assert not problems, "\n".join(problems)


def test_link_check_sees_broken_links(tmp_path):
    """Power check: a missing file, a missing heading and a path out of the tree are reported."""
    (tmp_path / "a.md").write_text("# Top\n\n## Some `code` here\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#some-code-here) [ok](#local) `[not](a link)`\n\n# Local\n\n"
                    "[x](missing.md) [y](a.md#nope) [z](../outside.md) [w](https://example.org)\n")
    problems = broken_links([page], tmp_path)
    assert problems == ["b.md: missing.md (no such file)", "b.md: a.md#nope (no heading #nope)",
                        "b.md: ../outside.md (outside the repository)"], problems


def test_every_doc_is_reachable_from_the_readme():
    """What left the README lives in docs the README links, directly or through another doc."""
    todo, seen = [ROOT / "README.md"], set()
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for target in re.findall(r"\]\(([^)#\s]+)", _prose(page.read_text())):
            dest = (page.parent / target).resolve()
            if dest.suffix == ".md" and dest.parent == ROOT / "docs" and dest.exists():
                todo.append(dest)
    unreached = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p not in seen)
    assert not unreached, f"docs no README path leads to: {unreached}"


def test_examples_import_nothing_from_tests():
    """A user copies an example with the package and models/ only: no ``tests`` import, and no
    repository root put on ``sys.path`` to reach one."""
    problems = []
    for path in sorted((ROOT / "examples").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(EXAMPLES_USING_TEST_SUPPORT):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            problems += [f"{rel}: imports {n}" for n in names if n.split(".")[0] == "tests"]
            if (isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                problems.append(f"{rel}: changes sys.path (line {node.lineno})")
    assert not problems, "\n".join(problems)
    assert (ROOT / "examples" / "generate.py").is_file()
