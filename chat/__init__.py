"""Chat on top of cache sessions.

Module map (each subpackage's `__init__` says its role):
  engine.py        ChatEngine: a loaded model + tokenizer; makes conversations (new, restored, branched off)
  config.py        EngineConfig: the engine's limits, each default once
  runtime.py       Runtime: the narrow part of an engine a conversation uses
  errors.py        errors a UI can show, one family (ChatError)
  in_flight.py     a count of things under way (plans being made, streams into a page), from any thread
  host.py          settings for a shared host, made before torch loads (OpenMP's wait policy)
  loading.py       from_pretrained with automatic device and dtype; the "demo" model
  demo.py          where the trained demo model lies; the tests' tokenizer, trained in code
  models.py        the table of model shapes built in code (demo, tests, benchmarks)
  typing_ahead.py  the terminal chat prepares the line being typed, as the page does (prompt_toolkit)
  scheduling/      the engine that schedules and runs steps, one loop on the compute thread:
                   scheduler.py (plan → apply → run → sample), requests.py and request_table.py,
                   step_plan.py (a step as plain data), step_planner.py and prompt_pieces.py (made
                   without changing anything), request_stages.py (applied over the cache owner),
                   prompt_fairness.py, step_budget.py, drafting.py and guessing.py (guessed
                   tokens), step_sampling.py and sampling.py (every token chosen), loop.py, worker.py
  model_step/      the one model step: the runner, the plain step, its compiled form, the model's own
                   forward packed, how the weights are held, feeding a session outside the loop
  dialogue/        a conversation and its history: conversation.py, operations.py, options.py,
                   history.py (the branch tree), saved.py, plans.py and fitting.py (prompts within
                   the context), templates.py, reasoning.py, detokenizer.py
  backends/        where replies come from: sources.py (the protocol), local.py (the engine),
                   served.py (an OpenAI-compatible server), remote.py (a ZeroGPU worker)
  storage/         what the server keeps: store.py (people's records), sessions.py (the server's
                   chats by its own keys), shares.py (share links)
"""

__version__ = "0.20.0"

from chat import host  # noqa: F401, I001  (first: its import sets OpenMP's wait policy before torch loads)
from chat.config import EngineConfig
from chat.dialogue.conversation import Conversation
from chat.engine import ChatEngine
from chat.errors import (
    ChatError,
    ContextOverflowError,
    ConversationBusyError,
    ConversationError,
    EmptyMessageError,
    InvalidOptionError,
    ModelLoadError,
    NotAUserMessageError,
    NothingToRegenerateError,
    NothingToUndoError,
    ReplyEndedError,
    ServerBusyError,
    StalePlanError,
    UnknownOptionError,
)
from chat.dialogue.operations import Continue, Edit, Operation, Regenerate, Send
from chat.dialogue.options import GenerationOptions
from chat.dialogue.reasoning import Delta
from chat.dialogue.saved import SavedConversationError
from chat.backends.sources import ReplyStream, TurnStats

__all__ = [
    "ChatEngine",
    "ChatError",
    "Continue",
    "ContextOverflowError",
    "Conversation",
    "ConversationBusyError",
    "ConversationError",
    "Delta",
    "Edit",
    "EmptyMessageError",
    "EngineConfig",
    "GenerationOptions",
    "InvalidOptionError",
    "ModelLoadError",
    "NothingToRegenerateError",
    "NothingToUndoError",
    "ReplyEndedError",
    "NotAUserMessageError",
    "Operation",
    "Regenerate",
    "ReplyStream",
    "Send",
    "SavedConversationError",
    "ServerBusyError",
    "StalePlanError",
    "TurnStats",
    "UnknownOptionError",
]
