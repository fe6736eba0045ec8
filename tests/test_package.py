"""`pip install .`: the packages and the app import from anywhere, the demo
model's files come along, and a `rewind-chat` command starts the app. Built from a copy of the
sources (in-tree builds leave folders behind), without dependencies (they are this interpreter's)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "requirements.txt", "app.py", "chat", "cache_sessions", "ui")

LIBRARY = """
from chat import ChatEngine

engine = ChatEngine.load("demo")
conv = engine.conversation(system_prompt="You are terse.")
reply = "".join(delta.text for delta in conv.send("What is 2 + 3?", max_new_tokens=48, do_sample=False))
print("replied:", bool(reply), conv.stats.generated_tokens > 0)
"""


def test_an_installed_package_runs_the_library_and_has_the_command(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if (ROOT / name).is_dir() else {}))
    installed = tmp_path / "installed"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(installed), str(source)], check=True, timeout=600, capture_output=True)
    elsewhere = tmp_path / "elsewhere"  # not the repository: nothing imports from it
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(installed), HF_HUB_OFFLINE="1")
    ran = subprocess.run([sys.executable, "-c", LIBRARY], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "replied: True True" in ran.stdout
    where = subprocess.run([sys.executable, "-c", "import chat, app; print(chat.__file__, app.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300).stdout
    assert str(ROOT) not in where and str(installed) in where
    command = installed / "bin" / "rewind-chat"
    helped = subprocess.run([sys.executable, str(command), "--help"], cwd=elsewhere, env=env, capture_output=True,
                            text=True, timeout=300)
    assert helped.returncode == 0 and "--max-waiting-mb" in helped.stdout, helped.stderr[-2000:]
