"""The README's two set-up commands are the ones that really run."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    setup = (ROOT / "README.md").read_text().split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", setup, flags=re.S)


def test_readme_has_exactly_two_setup_commands():
    commands = readme_commands()
    assert len(commands) == 2
    assert commands[0].endswith("pipeline run examples/prompts.jsonl")
    assert commands[1].endswith("python -m pytest -q")


def test_ci_runs_the_readme_test_command():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci_lines


def test_example_prompts_exist():
    assert (ROOT / "examples" / "prompts.jsonl").stat().st_size > 0
