"""A model call as OpenTelemetry's GenAI semantic conventions describe it (``gen_ai.*``).

The gateway's trace of a request (``otel.StageSpans``) has one span for the call to the model,
named ``{gen_ai.operation.name} {gen_ai.request.model}`` as the conventions ask, from the moment
the gateway hands the request on to the end of the answer: the engine's time, apart from the
gateway's own stage spans. Its attributes are built here, from the request's body when it is
admitted (``request_attributes``) and from its outcome when it ends (``GenAiCall.attributes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serve_app.protocol import Endpoint, Tokens

PROVIDER = "vllm"  # gen_ai.provider.name: the engine behind every model of this gateway
AttributeValue = str | int | float | bool
# Request fields -> their gen_ai.request.* attribute (the first one set wins for max_tokens).
_PARAMS = (("temperature", "gen_ai.request.temperature"), ("top_p", "gen_ai.request.top_p"),
           ("top_k", "gen_ai.request.top_k"), ("seed", "gen_ai.request.seed"),
           ("frequency_penalty", "gen_ai.request.frequency_penalty"),
           ("presence_penalty", "gen_ai.request.presence_penalty"))


def request_attributes(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, AttributeValue]:
    """The ``gen_ai.request.*`` attributes of ``body`` (only well-typed values: a client's bad
    field never becomes an attribute of the wrong type)."""
    out: dict[str, AttributeValue] = {}
    model = body.get("model")
    if isinstance(model, str):
        out["gen_ai.request.model"] = model[:256]
    for name in endpoint.max_tokens_fields:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            out["gen_ai.request.max_tokens"] = value
            break
    for name, attr in _PARAMS:
        value = body.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[attr] = value
    if body.get("stream") is True:
        out["gen_ai.request.stream"] = True  # not in the conventions yet; named as theirs are
    return out


@dataclass
class GenAiCall:
    """One request's model call, for its span: set at admission, completed at its end."""

    operation: str  # gen_ai.operation.name (the endpoint's ``operation``)
    request: dict[str, AttributeValue] = field(default_factory=dict)

    def attributes(self, model_id: str, status: int, tokens: Tokens | None,
                   ttft_s: float | None) -> dict[str, AttributeValue]:
        """Every attribute of the call's span, with its outcome."""
        out: dict[str, AttributeValue] = {
            "gen_ai.operation.name": self.operation, "gen_ai.provider.name": PROVIDER,
            **self.request, "gen_ai.response.model": model_id,
        }
        out.setdefault("gen_ai.request.model", model_id)
        if tokens is not None:
            out["gen_ai.usage.input_tokens"] = tokens["prompt_tokens"]
            out["gen_ai.usage.output_tokens"] = tokens["completion_tokens"]
        if ttft_s is not None:
            out["serve_app.ttft_s"] = ttft_s
        if status >= 400:
            out["error.type"] = str(status)
        return out

    def span_name(self) -> str:
        return f"{self.operation} {self.request.get('gen_ai.request.model', '')}".strip()
