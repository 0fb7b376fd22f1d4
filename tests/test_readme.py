"""The README's quickstart runs and prints what it says, and its set-up commands match CI."""

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def code_blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_quickstart_runs_and_prints_its_comment():
    pytest.importorskip("datasets")
    block = next(b for b in code_blocks("python") if "Dataset.from_dict" in b)
    from packtools.integrations.data.drops import TokensDroppedWarning

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.warns(TokensDroppedWarning, match="dropped 1 of 11 tokens"):
        exec(
            compile(block, "README quickstart", "exec"), {}
        )  # bfd drops token 5, and says so (as the README)
    expected = re.search(r"# (\{.*\})", block).group(1)
    assert out.getvalue().strip() == expected


def test_ci_runs_the_readme_test_command():
    setup = code_blocks("bash")[0]
    test_cmd = [ln for ln in setup.splitlines() if "pytest" in ln][0].strip()
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    assert test_cmd in ci
    # the README's command is the quick set; CI runs the slow set after it, so every test runs in CI
    assert test_cmd.endswith('python -m pytest -q -n 2 --dist loadgroup -m "not slow"')
    lines = [ln.strip() for ln in ci.splitlines()]
    slow = "python -m pytest -q -n 2 --dist loadgroup -m slow"
    assert slow in lines
    assert lines.index(slow) > next(i for i, ln in enumerate(lines) if test_cmd in ln)
