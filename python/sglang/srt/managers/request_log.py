"""`--log-requests`: one log line per finished request.

Level 0 (default) gives what an operator needs to follow traffic without seeing it: the request
id, the adapter (or the base model), prompt / cached / completion tokens, the finish reason and the
latency. Level 1 adds the sampling parameters; level 2 the first and last characters of the prompt
and the output (user text: only when asked for).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.managers.req_state import ReqState

TEXT_EDGE_CHARS = 64


def _edges(text: str) -> str:
    if len(text) <= 2 * TEXT_EDGE_CHARS:
        return repr(text)
    return f"{text[:TEXT_EDGE_CHARS]!r} ... {text[-TEXT_EDGE_CHARS:]!r} ({len(text)} chars)"


def _reason(state: "ReqState") -> str:
    reason = state.finished_reason or {}
    kind = reason.get("type", "?")
    if kind == "stop" and reason.get("matched") is not None:
        return f"stop({reason['matched']!r})"
    if kind == "abort" and reason.get("status_code"):
        return f"abort({reason['status_code']})"
    return str(kind)


def request_log_line(state: "ReqState", level: int) -> str:
    req = state.req
    parts = [
        f"rid={req.rid}",
        f"lora={req.lora_name if state.lora_id is not None else 'base'}",
        f"prompt_tokens={state.prompt_tokens or len(state.input_ids)}",
        f"cached_tokens={state.cached_tokens}",
        f"completion_tokens={state.completion_tokens}",
        f"finish={_reason(state)}",
        f"latency={time.time() - state.created:.3f}s",
    ]
    if level >= 1:
        # Unset fields are left out; a 0 (temperature 0, seed 0) is a setting and stays (0 == False).
        params = {k: v for k, v in dataclasses.asdict(state.params).items()
                  if not (v is None or v is False or v == [])}
        parts.append(f"sampling_params={params}")
    if level >= 2:
        parts.append(f"prompt={_edges(req.text) if req.text is not None else f'<{len(state.input_ids)} ids>'}")
        parts.append(f"output={_edges(state.text())}")
    return "Finished request: " + ", ".join(parts)
