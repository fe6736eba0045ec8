"""Benchmarks. `python -m benchmarks.multiturn --help`.

  models.py     the benchmark models (random weights, realistic shape) and their tokenizer
  multiturn.py  session vs naive vs floor over a long scripted conversation, and operations
"""

# Before anything loads torch (a benchmark module's own imports may): the app's OpenMP settings
# are read once, when torch loads, and a benchmark measures what the app runs.
import chat.host  # noqa: E402,F401
