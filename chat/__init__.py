"""Chat on top of cache sessions.

Module map:
  engine.py        ChatEngine: a loaded model + tokenizer; makes conversations (new, restored, branched off)
  config.py        EngineConfig: the engine's limits, each default once
  runtime.py       Runtime: the narrow part of an engine a conversation uses
  conversation.py  Conversation: plans operations, has its reply source make them, records them
  operations.py    Send / Regenerate / Edit / Continue: operations as checked values
  options.py       GenerationOptions: what a user sets per reply
  history.py       the canonical messages as a tree of branches; one path is shown
  saved.py         a conversation as JSON-safe data, and the checked way back (restore)
  plans.py         planning an operation: history, prompt ids, context fitted (no changes)
  fitting.py       leaving the oldest turns out to fit the context, in time bounded by the context
  in_flight.py     a count of things under way (plans being made, streams into a page), from any thread
  sources.py       where replies come from: ReplyRequest in, deltas and a Reply out (a protocol)
  local.py         replies from the embedded engine (the scheduler and the cache owner)
  served.py        replies from an OpenAI-compatible server
  remote.py        replies from a ZeroGPU worker process
  scheduler.py     the one loop: cache commands, then one packed forward a step (decode rows and prefill chunks)
  requests.py      a reply being made (GenerationRequest) and the cache work it asks for
  request_table.py the scheduler's one record of its requests: waiting, prefilling, decoding, paused
  step_plan.py     what a step does, as plain data (StepPlan): who leaves, who is admitted, pieces, rows
  step_planner.py  makes a step's plan from the table, changing nothing; a text being typed is its lowest priority
  prompt_pieces.py which prompt pieces a step carries, from where each cache stands or will once rolled back
  step_sampling.py the step's last phase: every token chosen (kept-logits first tokens too), ended rows leave
  request_stages.py   a plan applied over the cache owner: requests begun (rolled back), pieces noted, ended
  prompt_fairness.py  who gets a step's prompt budget: fair by tokens owed, per client
  drafting.py      guessed tokens to verify: where guesses come from, how many a row feeds (--draft)
  guessing.py      the step's side of guessing: which rows guess, choosing their tokens, giving back
  step_budget.py   how many prompt tokens a step may carry beside decode rows, from timed steps
  sampling.py      the next token of one row: transformers' logits processors, greedy or seeded sampling
  detokenizer.py   streamed token ids to text deltas, whole characters only
  templates.py     rendering history to prompt ids with the tokenizer's chat template
  reasoning.py     splitting <think> reasoning from the answer, as a stream
  worker.py        the compute thread every forward pass runs on
  host.py          settings for a shared host, made before torch loads (OpenMP's wait policy)
  typing_ahead.py  the terminal chat prepares the line being typed, as the page does (prompt_toolkit)
  loading.py       from_pretrained with automatic device and dtype; the "demo" model
  demo.py          where the trained demo model lies; the tests' tokenizer, trained in code
  models.py        the table of model shapes built in code (demo, tests, benchmarks)
  errors.py        errors a UI can show, one family (ChatError)
  store.py         the server's store of signed-in people's records (SQLite or PostgreSQL), merged as the browser merges
  sessions.py      the server's chats found by keys it made (never a client's id): a count limit, idle expiry
  model_step/      the one model step: the runner, the plain step, its compiled form, the model's own
                   forward packed, and how the weights are held
  shares.py        shared snapshots of a conversation's path, reached by an unguessable id, revoked by their maker
"""

__version__ = "0.20.0"

from chat import host  # noqa: F401, I001  (first: its import sets OpenMP's wait policy before torch loads)
from chat.config import EngineConfig
from chat.conversation import Conversation
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
from chat.operations import Continue, Edit, Operation, Regenerate, Send
from chat.options import GenerationOptions
from chat.reasoning import Delta
from chat.saved import SavedConversationError
from chat.sources import ReplyStream, TurnStats

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
