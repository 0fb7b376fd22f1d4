"""The notebooks execute from top to bottom in a kernel running this interpreter."""

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
KERNEL = "packtools-tests"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    """A kernelspec for ``sys.executable`` in a private JUPYTER_PATH: nothing installed, no other Python used."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return KERNEL


def test_there_are_notebooks():
    assert any(p.name == "choose_max_length.ipynb" for p in NOTEBOOKS)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path, kernel_name):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name=kernel_name, timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    if path.name == "choose_max_length.ipynb":
        images = [o for o in outputs if "image/png" in o.get("data", {})]
        assert len(images) == 3  # histogram, tradeoffs, histogram with the chosen max_length
        text = "".join(o.get("text", "") for o in outputs)
        assert "rows of at most" in text and "done in" in text


def test_stored_outputs_are_those_of_the_current_cells():
    """What a reader sees without running the notebook (GitHub renders the stored outputs) is one run of the
    cells as they are: every code cell ran, in order, and the packed rows printed at the end are those of the
    recommended max_length (the stored pack output had been left from an older cell choosing 8,192)."""
    import re

    nb = json.loads((Path(__file__).parent.parent / "notebooks" / "choose_max_length.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    text = "".join("".join(o.get("text", "")) for c in code for o in c["outputs"])
    recommended = int(re.search(r"recommended: max_length=(\d+)", text).group(1))
    picked = re.search(r"max_length = ([\d,]+): .* keeps all in ([\d,]+) rows", text)
    packed = re.search(r"-> ([\d,]+) rows of at most ([\d,]+) tokens", text)
    assert int(picked.group(1).replace(",", "")) == recommended
    assert int(packed.group(2).replace(",", "")) == recommended
    assert packed.group(1) == picked.group(2)
