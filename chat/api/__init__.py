"""The OpenAI API served from the engine: clients that send whole conversations with no id find
their kept caches by their tokens (chat/api/kept_states.py), requests run on the scheduler that
serves the page (chat/api/runs.py), over HTTP beside the page or alone (chat/api/routes.py,
`python -m chat.api`)."""

from chat.api.kept_states import KeptStates
from chat.api.routes import api_routes
from chat.api.runs import ApiRuns

__all__ = ["ApiRuns", "KeptStates", "api_routes"]
