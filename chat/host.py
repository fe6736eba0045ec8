"""Settings for a shared host, made when this module is imported: `chat` imports it first, before
anything loads torch (so this module must not import it).

PyTorch's OpenMP workers spin while they wait for work unless `OMP_WAIT_POLICY` says otherwise,
and OpenMP reads it once, when torch loads. On a host whose cores another process also uses (a
free Space's 2 vCPUs), two spinning processes take turns badly. `python -m benchmarks.shared_host`
(bench-full, one conversation decoding, another torch process multiplying matrices on both cores):
17.9 tokens/s by default, 39.1 with PASSIVE; 45.4 against 48.3 with nothing else running; one
thread instead of two held 36.9. So the app asks for PASSIVE and keeps torch's 2 threads; an
operator's own setting wins (`OMP_WAIT_POLICY`, or `GOMP_SPINCOUNT`: how long GCC's OpenMP
workers spin before they sleep, with no policy set).

What PASSIVE costs on a quiet host, where nothing else wants the cores: every product of a step
wakes a sleeping worker. At Qwen3-0.6B's shape with `--weights packed` (oneDNN's products, 197 a
step), `python -m benchmarks.shared_host --model real-qwen3-0.6b --weights packed` measured 10.0
tokens/s spinning by default, 9.3 with `GOMP_SPINCOUNT=100000`, 8.0 with PASSIVE; beside the busy
process 2.3, 3.5 and 5.3. A dedicated host may set `GOMP_SPINCOUNT` (docs/deploy.md).

Inductor's on-disk cache (compiled kernels the app loads and runs) goes in the app's own cache
folder, beside the saved decode steps (chat/model_step/compiled.py), not in torch's default
`/tmp/torchinductor_<user>`: that one is lost when a Space restarts, and on a shared host another
user may create it first and fill it. torch fixes the folder as a side effect of its own imports,
so it is chosen here, before torch loads; an operator's `TORCHINDUCTOR_CACHE_DIR` wins.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

WAIT_POLICY = "PASSIVE"
OPERATOR_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # either set: the operator chose


def prefer_passive_openmp() -> None:
    """Ask OpenMP's workers to sleep, not spin, between steps (unless the operator set how they
    wait, or too late)."""
    if not any(name in os.environ for name in OPERATOR_SETTINGS):
        os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY


def app_cache_folder() -> str:
    """The app's cache folder: saved decode steps and inductor's kernels (`XDG_CACHE_HOME` moves it)."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "rewind-chat")


def prefer_app_inductor_cache() -> None:
    """Inductor's cache in the app's cache folder, unless the operator chose one."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(app_cache_folder(), "inductor"))


prefer_passive_openmp()
prefer_app_inductor_cache()


def end_process(code: int) -> NoReturn:
    """Exit with `code` once the exit handlers have run (the cold tier's files, the exports, the
    replies in flight), without the interpreter's own teardown. A compile on its thread (torch's
    and inductor's native threads) cannot be stopped; tearing the interpreter down under it
    aborted the process ("terminate called without an active exception", exit 134) when a Space
    stopped during a start with `--compile on`. What the compile had not
    finished is simply not saved (a sealed file is written whole or not at all)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
