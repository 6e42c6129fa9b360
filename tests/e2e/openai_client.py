"""End-to-end check of a running `mistralrs serve` (with berrylm) through the
official OpenAI Python client, on the bundled trained-tiny model.

usage: openai_client.py BASE_URL GOLDEN_JSON
Exits non-zero with a message on the first failed check.
"""

import json
import sys

from openai import OpenAI


def check(condition, message):
    if not condition:
        raise SystemExit(f"FAILED: {message}")


def request_args(sequence, stream):
    args = {
        "model": "default",
        "messages": sequence["messages"],
        "temperature": 0.0,
        "max_tokens": 96,
        "stream": stream,
    }
    if sequence["tools"]:
        args["tools"] = sequence["tools"]
    if not sequence["enable_thinking"]:
        args["extra_body"] = {"enable_thinking": False}
    return args


def extra(obj, name):
    """A field the OpenAI client does not model (reasoning_content)."""
    value = getattr(obj, name, None)
    if value is None and obj.model_extra:
        value = obj.model_extra.get(name)
    return value


def assemble(stream):
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        check(chunk.object == "chat.completion.chunk", f"chunk object {chunk.object}")
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        delta = choice.delta
        content += delta.content or ""
        reasoning += extra(delta, "reasoning_content") or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] = entry["id"] or (call.id or "")
            if call.function is not None:
                entry["name"] = entry["name"] or (call.function.name or "")
                entry["arguments"] += call.function.arguments or ""
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def main():
    base_url, golden_path = sys.argv[1], sys.argv[2]
    sequences = json.load(open(golden_path))["sequences"]
    greeting, weather = sequences[1], sequences[2]
    client = OpenAI(base_url=base_url, api_key="not-needed")

    models = client.models.list()
    check(len(models.data) >= 1, "no model listed")

    # Without tools, not streamed: reasoning then content.
    response = client.chat.completions.create(**request_args(greeting, False))
    check(response.object == "chat.completion", f"object {response.object}")
    message = response.choices[0].message
    check(message.role == "assistant", f"role {message.role}")
    check(extra(message, "reasoning_content").strip() == "The user greets me.",
          f"reasoning {extra(message, 'reasoning_content')!r}")
    check(message.content.strip() == "Hello! How can I help you today?", f"content {message.content!r}")
    check(not message.tool_calls, "unexpected tool calls")
    check(response.choices[0].finish_reason == "stop", f"finish {response.choices[0].finish_reason}")

    # Without tools, streamed.
    content, reasoning, calls, finish = assemble(client.chat.completions.create(**request_args(greeting, True)))
    check(reasoning.strip() == "The user greets me.", f"streamed reasoning {reasoning!r}")
    check(content.strip() == "Hello! How can I help you today?", f"streamed content {content!r}")
    check(not calls and finish == "stop", f"streamed calls {calls} finish {finish}")

    # With tools, not streamed: a typed get_weather call.
    response = client.chat.completions.create(**request_args(weather, False))
    choice = response.choices[0]
    check(choice.finish_reason == "tool_calls", f"finish {choice.finish_reason}")
    calls = choice.message.tool_calls or []
    check(len(calls) == 1, f"tool calls {calls}")
    check(calls[0].type == "function" and calls[0].id, f"call {calls[0]}")
    check(calls[0].function.name == "get_weather", f"name {calls[0].function.name}")
    check(json.loads(calls[0].function.arguments) == {"city": "Oslo"}, f"arguments {calls[0].function.arguments}")
    check("get_weather" in (extra(choice.message, "reasoning_content") or ""), "reasoning before the call")

    # With tools, streamed.
    content, reasoning, calls, finish = assemble(client.chat.completions.create(**request_args(weather, True)))
    check(finish == "tool_calls", f"streamed finish {finish}")
    check(len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"], f"streamed calls {calls}")
    check(json.loads(calls[0]["arguments"]) == {"city": "Oslo"}, f"streamed arguments {calls[0]['arguments']}")
    check("get_weather" in reasoning, f"streamed reasoning {reasoning!r}")
    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
