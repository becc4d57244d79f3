"""runtime/allocator.py: a GPU's caching allocator grows expandable segments unless the user configured it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from triforce_cli.runtime.allocator import ALLOCATOR_VARIABLES, EXPANDABLE_SEGMENTS, expandable_cuda_segments

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def unset(monkeypatch):
    for name in ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_unset_allocator_gets_expandable_segments(unset):
    expandable_cuda_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == EXPANDABLE_SEGMENTS
    assert "PYTORCH_ALLOC_CONF" not in os.environ


@pytest.mark.parametrize("name", ALLOCATOR_VARIABLES)
def test_a_users_configuration_is_kept(unset, name):
    unset.setenv(name, "max_split_size_mb:128")
    expandable_cuda_segments()
    assert os.environ[name] == "max_split_size_mb:128"
    assert [other for other in ALLOCATOR_VARIABLES if other in os.environ] == [name]


def test_the_command_sets_it_first():
    """`triforce` sets the variable before torch could allocate: in the command's own process, as it starts."""
    code = (
        "import os, sys\n"
        "sys.argv = ['triforce', '--help']\n"
        "from triforce_cli.__main__ import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('allocator:', os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))\n"
    )
    env = {name: value for name, value in os.environ.items() if name not in ALLOCATOR_VARIABLES}
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"allocator: {EXPANDABLE_SEGMENTS}"
