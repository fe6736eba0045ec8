"""The one model step of the engine: every row's tokens through the model, each row on its own cache.

Module map:
  runner.py      ModelRunner: runs a step, choosing the fast step only where it proves itself
  plain_step.py  the decoder written out over a packed sequence (the families it knows), and why not
  compiled.py    the plain step as compiled graphs for steps of decode rows alone
  resident.py    the model's own forward, packed: each row attending to its own cache
  weights.py     how the weights are held: as loaded, packed, or int8 (its prompt product timed here)

The cache owner (cache_sessions/owner.py) applies every change to a session's states; nothing here
rolls back or keeps books.
"""
