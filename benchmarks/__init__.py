"""Benchmarks. `python -m benchmarks.multiturn --help`.

  models.py     the benchmark models (random weights, realistic shape) and their tokenizer
  multiturn.py  session vs naive vs floor over a long scripted conversation, and operations
"""
