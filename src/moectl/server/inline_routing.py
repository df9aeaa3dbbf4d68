"""A request's own routing, written in the request: ``"routing": {"type": "experts", ...}``.

Besides a registered name, a request may carry a routing policy as JSON — an object or a list of
up to :data:`MAX_ITEMS` — of the kinds that read nothing from the server's disk and merge no
weights (:data:`INLINE_TYPES`: forcing/omitting experts, N experts per token, an expert mask,
Gumbel noise, a document pool). It is checked against the model like a registered one: a bad layer or expert id is a 400
naming them. Its name is ``inline-`` and a hash of its JSON, so requests that send the same
routing share one (they decode in one group of rows, and the prefix cache keys their prompts by
it); the server keeps the :data:`KEEP` most recent. Their figures (switch rates, expert counts,
``/metrics``) are kept under one label, ``inline``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from moectl.server.api_errors import APIError

INLINE_TYPES = ("experts", "topk", "replay", "expert_mask", "gumbel", "document_pool")
MAX_ITEMS = 8
KEEP = 64


class InlineRoutings:
    """The inline routings of recent requests, resolved once each (see the module doc)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._resolved: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def routing(self, spec: Any) -> Any:
        """The ``engine.routings.Routing`` of ``spec`` (an object or a list of them); a 400 naming
        what is wrong otherwise."""
        items = spec if isinstance(spec, list) else [spec]
        if not items or len(items) > MAX_ITEMS:
            raise APIError(400, f"an inline routing holds 1 to {MAX_ITEMS} policies, got {len(items)}", param="routing")
        for item in items:
            kind = item.get("type") if isinstance(item, dict) else None
            if kind not in INLINE_TYPES:
                raise APIError(
                    400,
                    f"an inline routing policy must be an object with a type among {', '.join(INLINE_TYPES)}; "
                    f"got {kind if kind is not None else type(item).__name__!r} (register others with --routing)",
                    param="routing",
                )
        text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
        name = "inline-" + hashlib.sha256(text.encode()).hexdigest()[:16]
        with self._lock:
            found = self._resolved.get(name)
            if found is not None:
                self._resolved.move_to_end(name)
                return found
        from moectl.engine.routings import resolve

        try:
            routing = resolve(name, spec, self.engine.model, self.engine.info)
        except (ValueError, TypeError, KeyError) as err:
            raise APIError(400, f"inline routing: {err}", param="routing") from None
        routing.label = "inline"  # one label for all of them in the engine's figures and /metrics
        with self._lock:
            self._resolved[name] = routing
            while len(self._resolved) > KEEP:
                self._resolved.popitem(last=False)
        return routing
