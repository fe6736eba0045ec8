"""Two things Gradio 6.31 keeps that a visitor controls, and their bounds.

- **Every value an event carried, per page.** Gradio copies each input (and output) value of an
  event into the page's session state (`SessionState.config_values`, for its "deep link"
  feature), and keeps that state up to `state_session_capacity` pages for an hour after they
  close. A page load carries the browser's record of a conversation, so a forged load of 25 MB
  kept 25 MB a page (16 of them: gigabytes). This app has no deep links: `keep_no_event_values`
  makes the copy a no-op, so a page's state is Gradio's default config and this app's small
  `gr.State` values whatever its events carried.
- **The spool file of a refused upload.** An upload is written to a temporary file as it arrives;
  Gradio removes it when its own per-file limit refuses it, but not when the request-body limit
  (413, for a body sent without a length), a disconnect or a cancellation ends the read: each
  refusal left a file as large as the limit. `remove_files_of_failed_uploads` removes them on
  any failure.

Both patch Gradio's classes once, checked against the pinned version by `check_gradio`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradio.route_utils import GradioMultiPartParser
from gradio.state_holder import SessionState

_original_update_value = SessionState._update_value_in_config
_original_parse = GradioMultiPartParser.parse


def _keep_no_value(self: SessionState, key: int, value: Any) -> None:
    """What Gradio would copy into the page's config (read only by its deep links): nothing."""


def keep_no_event_values() -> None:
    """Patch `SessionState._update_value_in_config` (once): a page keeps no copy of what its events carried."""
    check_gradio()
    SessionState._update_value_in_config = _keep_no_value  # type: ignore[method-assign]


async def _parse_leaving_no_file(self: GradioMultiPartParser) -> Any:
    try:
        return await _original_parse(self)
    except BaseException:
        for spooled in self._files_to_close_on_error:
            spooled.close()
            Path(spooled.name).unlink(missing_ok=True)
        raise


def remove_files_of_failed_uploads() -> None:
    """Patch `GradioMultiPartParser.parse` (once): an upload that ends in any error leaves no file."""
    check_gradio()
    if GradioMultiPartParser.parse is _original_parse:
        GradioMultiPartParser.parse = _parse_leaving_no_file  # type: ignore[method-assign]


def check_gradio() -> None:
    """The patched names are still there (a Gradio upgrade must be checked against this module)."""
    if "config_values" not in SessionState.__init__.__code__.co_names:
        raise RuntimeError("this Gradio's SessionState keeps no config_values; check ui/gradio_limits.py against it")
    if "_files_to_close_on_error" not in GradioMultiPartParser.__init__.__code__.co_names:
        raise RuntimeError("this Gradio's upload parser changed; check ui/gradio_limits.py against it")
