"""Chat on top of cache sessions.

Module map:
  engine.py        ChatEngine: a loaded model + tokenizer; makes conversations
  conversation.py  Conversation: send / regenerate / undo / edit / stop over one cache session
  generation.py    model.generate on a worker thread, streamed token ids, generation options
  templates.py     rendering history to prompt ids with the tokenizer's chat template
  reasoning.py     splitting <think> reasoning from the answer, as a stream
  worker.py        the compute thread every forward pass runs on
  remote.py        running an operation in another process (Hugging Face ZeroGPU)
  loading.py       from_pretrained with automatic device and dtype; the "demo" model
  demo.py          the tiny offline demo model (random weights, tokenizer trained in code)
  errors.py        errors a UI can show
"""

from chat.conversation import Conversation, TurnStats
from chat.engine import ChatEngine
from chat.errors import (
    ContextOverflowError,
    ConversationBusyError,
    ConversationError,
    EmptyMessageError,
    ModelLoadError,
    NothingToRegenerateError,
    NothingToUndoError,
    NotAUserMessageError,
)
from chat.generation import GenerationOptions
from chat.reasoning import Delta

__all__ = [
    "ChatEngine",
    "Conversation",
    "ContextOverflowError",
    "ConversationBusyError",
    "ConversationError",
    "Delta",
    "EmptyMessageError",
    "GenerationOptions",
    "ModelLoadError",
    "NothingToRegenerateError",
    "NothingToUndoError",
    "NotAUserMessageError",
    "TurnStats",
]
