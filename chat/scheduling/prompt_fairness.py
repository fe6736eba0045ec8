"""Who gets a step's prompt budget (chat/scheduling/scheduler.py): fair by tokens owed, per client.

Shortest remaining prefill first is what makes a one-line message answered after one chunk, not
after a 4,000-token prompt sent just before it. Alone, it starves the long prompt whenever short
ones keep coming: the old guard, a count of steps passed over that any piece at all reset to
zero, let a 4,000-token prompt beside a one-line message every step be prefilled after 1,314
steps (63 alone).

Here each client with a request waiting to prefill (a flow: the requests of one client, or a
request alone where no client is known) is owed its fair share of every step's budget (the
budget over the flows that wanted some) less what its requests were given, deficit
round-robin's way. A flow owed a whole step's budget or more goes first, most owed first; the
rest go shortest remaining first. So a short message still jumps the queue, and a long prompt
still gets its client's share over any few steps, however many short messages another client
sends: those wait behind each other, not behind everyone. Fairness per request would not do:
once short messages come faster than the budget leaves room for, every policy that serves them
all leaves the long prompt only the rest (the work is conserved); only a client that sends more
than its share waiting longer keeps the others' time bounded. What is owed is kept within a few
budgets, and a flow given more than its share owes nothing back (short ones are meant to be quick).
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

OWED_CAP_BUDGETS = 4  # what one flow may be owed, in budgets


class PromptFairness:
    """The prompt tokens owed to each flow with a request waiting to prefill."""

    def __init__(self) -> None:
        self.owed: dict[Hashable, float] = {}

    def order(self, remaining: Mapping[Hashable, int], flows: Mapping[Hashable, Hashable],
              budget: int) -> list[Hashable]:
        """The order the budget goes to the requests (`remaining`: prompt tokens each still has to
        feed; `flows`: each one's client): those of flows owed a whole budget or more first, most
        owed first; then shortest remaining first (ties: in the order given, the arrival order)."""
        owed = {flows[key]: self.owed.get(flows[key], 0.0) for key in remaining}
        first = sorted((key for key in remaining if owed[flows[key]] >= max(budget, 1)),
                       key=lambda key: (-owed[flows[key]], remaining[key]))
        chosen = set(first)
        return first + sorted((key for key in remaining if key not in chosen), key=lambda key: remaining[key])

    def settle(self, wanting: Sequence[Hashable], given: Mapping[Hashable, int], budget: int) -> None:
        """After a step: each flow of `wanting` (the flows with prompt left that could go on) is
        owed its share of `budget` more, less what it was `given`."""
        if not wanting:
            return
        share, cap = budget / len(set(wanting)), OWED_CAP_BUDGETS * budget
        for flow in set(wanting):
            self.owed[flow] = min(cap, max(0.0, self.owed.get(flow, 0.0) + share - given.get(flow, 0)))

    def retain(self, flows: Sequence[Hashable]) -> None:
        """Only `flows` still have requests waiting to prefill: the others owe and are owed nothing."""
        kept = set(flows)
        self.owed = {flow: owed for flow, owed in self.owed.items() if flow in kept}
