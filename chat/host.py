"""Settings for a shared host, made when this module is imported: `chat` imports it first, before
anything loads torch (so this module must not import it).

PyTorch's OpenMP workers spin while they wait for work unless `OMP_WAIT_POLICY` says otherwise,
and OpenMP reads it once, when torch loads. On a host whose cores another process also uses (a
free Space's 2 vCPUs), two spinning processes take turns badly. `python -m benchmarks.shared_host`
(bench-full, one conversation decoding, another torch process multiplying matrices on both cores):
17.9 tokens/s by default, 39.1 with PASSIVE; 45.4 against 48.3 with nothing else running; one
thread instead of two held 36.9. So the app asks for PASSIVE and keeps torch's 2 threads; an
operator's own setting wins.
"""

from __future__ import annotations

import os

WAIT_POLICY = "PASSIVE"


def prefer_passive_openmp() -> None:
    """Ask OpenMP's workers to sleep, not spin, between steps (unless already set, or too late)."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)


prefer_passive_openmp()
