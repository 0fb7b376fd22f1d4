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
