"""Two costs of Gradio 6.31 that slow the model down while a reply streams, and their remedies.

Both were measured with `python -m benchmarks.web_stream` (see docs/performance.md, "Through the web"): the
model's compute thread shares the process, the GIL and, on a small machine, the cores with
Gradio's event loop, so every bit of work the loop does per update or per millisecond is taken
from decoding.

- Every streamed update carries all of an event's outputs; the ones left as they are
  (`gr.skip()`) are still turned into a fresh instance of their component, config and all, on the
  event loop (`Blocks.postprocess_data`), for nothing: the page receives an empty update either
  way. `pass_skipped_outputs_through` hands an empty update on as it is.
- The queue looks for new events every millisecond while it has none waiting
  (`Queue.sleep_when_free`), that is a thousand wake-ups of the event loop a second, each one
  taking the GIL from the compute thread. `poll_queue_every` sets a gentler interval; an event
  then starts at most that much later.

And one fault of its start on a busy host: `patient_start_check`.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import gradio as gr
from gradio import networking
from gradio.blocks import Blocks

SKIPPED: dict[str, str] = gr.skip()  # what the page receives for an output left as it is
QUEUE_POLL_S = 0.01
START_CHECK_S = 120.0

_original_postprocess = Blocks.postprocess_data


async def _postprocess_without_skipped(self: Blocks, block_fn: Any, predictions: Any, state: Any) -> list[Any]:
    if not isinstance(predictions, (list, tuple)) or len(predictions) != len(block_fn.outputs) \
            or len(block_fn.outputs) < 2 or block_fn.batch:  # Gradio's own checks and messages apply
        return await _original_postprocess(self, block_fn, predictions, state)
    kept = [i for i, value in enumerate(predictions) if not (isinstance(value, dict) and value == SKIPPED)]
    if len(kept) == len(predictions):
        return await _original_postprocess(self, block_fn, predictions, state)
    narrowed = copy.copy(block_fn)  # the same event with only the outputs that change
    narrowed.outputs = [block_fn.outputs[i] for i in kept]
    values = [predictions[i] for i in kept]
    done = await _original_postprocess(self, narrowed, values[0] if len(kept) == 1 else values, state) if kept else []
    # as Gradio answers for each: nothing for a State (it stays on the server), else an empty update
    result: list[Any] = [None if block.stateful else dict(SKIPPED) for block in block_fn.outputs]
    for index, value in zip(kept, done):
        result[index] = value
    return result


def pass_skipped_outputs_through() -> None:
    """Patch `Blocks.postprocess_data` (once) so that outputs given as `gr.skip()` cost nothing."""
    if Blocks.postprocess_data is _original_postprocess:
        Blocks.postprocess_data = _postprocess_without_skipped  # type: ignore[method-assign]


def poll_queue_every(demo: gr.Blocks, seconds: float = QUEUE_POLL_S) -> None:
    """After `demo.queue(...)`: how often the idle queue looks for new events."""
    queue = getattr(demo, "_queue", None)
    if queue is None or not hasattr(queue, "sleep_when_free"):
        raise RuntimeError("this Gradio's queue has no sleep_when_free; check ui/gradio_tuning.py against it")
    queue.sleep_when_free = seconds


def patient_start_check(seconds: float = START_CHECK_S) -> None:
    """Gradio's `launch` asks its own page once before it returns (`networking.url_ok`: a HEAD
    with a 3 s timeout, and a timeout is not asked again) and, if no answer came, raises "When
    localhost is not accessible, a shareable link must be created": on a busy host the page's
    first answer took longer and the app exited at start (seen twice here, beside a training run
    on both cores). This asks again until `seconds` have passed; a real failure still raises."""
    original = networking.url_ok
    if getattr(original, "patient", False):
        return

    def patient(url: str) -> bool:
        deadline = time.monotonic() + seconds
        while not original(url):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)
        return True

    patient.patient = True  # type: ignore[attr-defined]
    networking.url_ok = patient
