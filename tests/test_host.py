"""The app asks OpenMP's workers to sleep between steps (chat/host.py), and asks before torch loads:
OpenMP reads the setting once, then. Checked in fresh processes, at the moment torch is imported
(`policy/spin count`, None where unset)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WATCH = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and not seen:
            seen.append(str(os.environ.get("OMP_WAIT_POLICY")) + "/" + str(os.environ.get("GOMP_SPINCOUNT")))
sys.meta_path.insert(0, Watch())
import {module}
print("torch loaded with", seen[0] if seen else "torch never loaded")
"""


def policy_when_torch_loads(module: str, **env: str) -> str:
    environ = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
    output = subprocess.run([sys.executable, "-c", WATCH.format(module=module)], cwd=ROOT, env=environ,
                            capture_output=True, text=True, check=True, timeout=300).stdout
    return output.strip().splitlines()[-1].removeprefix("torch loaded with ")


@pytest.mark.parametrize("module", ["app", "chat"])  # the web app, and the terminal chat / library
def test_openmp_is_asked_to_sleep_before_torch_loads(module):
    assert policy_when_torch_loads(module) == "PASSIVE/None"


def test_an_operators_own_setting_wins():
    assert policy_when_torch_loads("app", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE/None"
    # a spin count alone: OpenMP's own policy with that count (PASSIVE would ignore it)
    assert policy_when_torch_loads("app", GOMP_SPINCOUNT="100000") == "None/100000"
    # every benchmark imports the app's settings before torch, as the app does
    assert policy_when_torch_loads("benchmarks.peers") == "PASSIVE/None"
