"""Server-sent events framing for gpudl's streamed responses (the OpenAI `stream=true` format).

Each event is one `data:` line holding a JSON object, ended by a blank line; a stream ends with the
sentinel `data: [DONE]`, which OpenAI clients read as the end of the stream.

>>> sse_event({"a": 1})
'data: {"a":1}\\n\\n'
"""

from __future__ import annotations

import json

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: dict) -> str:
    """One event. `json.dumps` escapes newlines inside strings, so the payload stays on one line
    (a raw newline would end the event early); ASCII escapes keep every byte valid in any client."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
