"""README's set-up commands are the ones CI runs, verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
