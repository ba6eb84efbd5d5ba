"""The README's examples run, against a real cluster, so they cannot drift."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_the_two_commands():
    text = README.read_text()
    assert "make run" in text and "make test" in text


@pytest.mark.parametrize("index", [pytest.param(i, marks=pytest.mark.slow) if 'dense="allreduce"' in block else i
                                   for i, block in enumerate(python_blocks())])     # slow: torchrun, 2 processes
def test_readme_example_runs(index, cluster, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SHARDPS_MANAGER", cluster.address)
    monkeypatch.chdir(tmp_path)
    code = python_blocks()[index]
    if 'dense="allreduce"' in code:          # hybrid: as the README runs it, under plain torchrun
        _under_torchrun(code, cluster.address, f"readme{index}", tmp_path)
        return
    # twice against the same cluster: a user runs a script again, in the same job
    for run in range(2):
        caplog.clear()
        exec(compile(code, f"README.md example {index}, run {run + 1}", "exec"), {"__name__": f"readme{index}"})
    if 'job="my-model"' in code:
        # the second run said that it continues the first's tables, as the README quotes it
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "earlier run" in r.getMessage()]
        assert said and " ".join(said[0].split()) in " ".join(README.read_text().replace("`", "").split()), said
    if "recommender.pt" in code:
        # the exported state dict loads into plain PyTorch, with nn.Embedding for PSEmbedding
        state = torch.load(tmp_path / "recommender.pt")
        plain = torch.nn.Module()
        plain.items = torch.nn.Embedding(100_000, 8)
        plain.head = torch.nn.Linear(8, 1)
        plain.load_state_dict(state)
        assert state["items.weight"].shape == (100_000, 8)


def test_the_readme_lists_every_command():
    import argparse

    from shardps.tools.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(README.read_text().split())
    listed = re.search(r"`shardps --help` lists them: (.*?)\. Every flag", text)
    assert listed, "the README's Commands section"
    assert re.findall(r"`([a-z-]+)`", listed.group(1)) == list(sub.choices)


def _under_torchrun(code: str, manager: str, job: str, tmp_path) -> None:
    """Run a README block as its comment says: torchrun, 2 processes; twice, in the same job."""
    import os
    import subprocess
    import sys
    script = tmp_path / "hybrid.py"
    script.write_text(code)
    env = {**os.environ, "SHARDPS_MANAGER": manager, "SHARDPS_JOB": job, "OMP_NUM_THREADS": "1"}
    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
