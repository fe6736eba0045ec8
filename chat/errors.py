"""Errors a caller can show to a user. Each is raised before anything changes."""


class ConversationError(ValueError):
    """Bad input or an operation with nothing to act on; the conversation is left as it was."""


class EmptyMessageError(ConversationError):
    pass


class NothingToRegenerateError(ConversationError):
    pass


class NothingToUndoError(ConversationError):
    pass


class NotAUserMessageError(ConversationError):
    pass


class ContextOverflowError(ConversationError):
    def __init__(self, message: str, *, prompt_tokens: int, max_new_tokens: int, context_limit: int):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context_limit = context_limit


class ConversationBusyError(RuntimeError):
    """A second operation while one is streaming; the running one is not disturbed."""


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded, with the reason in one line."""
