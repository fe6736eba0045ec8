"""The errors a caller can show to a user, one family: catch `ChatError`.

Each is raised before anything changes: the conversation is left exactly as it was.
"""


class ChatError(Exception):
    """Something to tell the user; nothing changed."""


class ConversationError(ChatError, ValueError):
    """Bad input, or an operation with nothing to act on."""


class EmptyMessageError(ConversationError):
    pass


class NothingToRegenerateError(ConversationError):
    pass


class NothingToUndoError(ConversationError):
    pass


class ReplyEndedError(ConversationError):
    """Continue on a reply the model ended itself: it would only write an end-of-turn token."""


class NotAUserMessageError(ConversationError):
    pass


class InvalidOptionError(ConversationError):
    """A generation option out of range."""


class UnknownOptionError(InvalidOptionError, TypeError):
    """A generation option that does not exist (a typo, most likely)."""


class ContextOverflowError(ConversationError):
    def __init__(self, message: str, *, prompt_tokens: int, max_new_tokens: int, context_limit: int):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context_limit = context_limit


class PlanningCancelled(ChatError):
    """The caller went away while its operation was being planned; nothing changed."""


class ConversationBusyError(ChatError, RuntimeError):
    """A second operation while one is streaming; the running one is not disturbed."""


class StalePlanError(ConversationBusyError):
    """The conversation changed between planning an operation and running it."""


class ServerBusyError(ChatError, RuntimeError):
    """Every conversation slot of the server is in use."""


class ModelLoadError(ChatError, RuntimeError):
    """A model or tokenizer that cannot be loaded, with the reason in one line."""
