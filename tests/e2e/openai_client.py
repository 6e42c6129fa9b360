"""End-to-end check of a running `mistralrs serve` (with berrylm) through the
official OpenAI Python client, on the bundled trained-tiny model: the golden
chats (reasoning, content, typed tool calls), `tool_choice`, `response_format`
(json_schema and json_object, after free reasoning) and chat `logprobs`, each
streamed and not, completions' `logprobs`, and the Responses API (text and a
tool call, whole and through the client's stream helper).

usage: openai_client.py BASE_URL GOLDEN_JSON
Exits non-zero with a message on the first failed check.
"""

import json
import sys

import openai
from openai import OpenAI


def check(condition, message):
    if not condition:
        raise SystemExit(f"FAILED: {message}")


def request_args(sequence, stream, max_tokens=96):
    args = {
        "model": "default",
        "messages": sequence["messages"],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if sequence["tools"]:
        args["tools"] = sequence["tools"]
    if not sequence["enable_thinking"]:
        args["extra_body"] = {"enable_thinking": False}
    return args


def golden_reasoning(sequence):
    """The reasoning of a golden greedy completion (the text before `</think>`)."""
    return sequence["greedy_completion_text"].split("</think>")[0].strip()


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


def answer(client, args):
    """One chat completion, streamed or not, as (content, reasoning, calls, finish):
    calls as {"id", "name", "arguments"} dicts."""
    if args["stream"]:
        return assemble(client.chat.completions.create(**args))
    choice = client.chat.completions.create(**args).choices[0]
    message = choice.message
    check(message.role == "assistant", f"role {message.role}")
    calls = []
    for call in message.tool_calls or []:
        check(call.type == "function", f"call type {call.type}")
        calls.append({"id": call.id, "name": call.function.name, "arguments": call.function.arguments})
    return message.content or "", extra(message, "reasoning_content") or "", calls, choice.finish_reason


def assert_matches_schema(value, schema, context):
    """Checks `value` against the JSON-schema keywords the test schemas use
    (type, properties, required, additionalProperties, string length, integer bounds)."""
    kind = schema.get("type")
    if kind == "object":
        check(isinstance(value, dict), f"not an object: {context}")
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            check(key in value, f"required {key!r} missing: {context}")
        if schema.get("additionalProperties", True) is False:
            check(set(value) <= set(properties), f"keys beyond the schema's: {context}")
        for key, item in value.items():
            if key in properties:
                assert_matches_schema(item, properties[key], context)
    elif kind == "string":
        check(isinstance(value, str), f"{value!r} is not a string: {context}")
        check(schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)),
              f"{value!r} outside the length bounds: {context}")
    elif kind == "integer":
        check(isinstance(value, int) and not isinstance(value, bool), f"{value!r} is not an integer: {context}")
        check(schema.get("minimum", value) <= value <= schema.get("maximum", value),
              f"{value!r} outside the bounds: {context}")


def assert_typed_call(call, tools, context):
    """A call to one of `tools`, with an id and arguments valid against its
    parameters' schema (only the parameters it declares); returns its name."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    check(call["id"], f"call without an id: {context}")
    check(call["name"] in schemas, f"a call to {call['name']!r}, which is not offered: {context}")
    arguments = json.loads(call["arguments"])
    schema = dict(schemas[call["name"]], additionalProperties=False)
    assert_matches_schema(arguments, schema, context)
    check(all(value != "" for value in arguments.values()), f"an empty argument: {context}")
    return call["name"]


def check_golden_chats(client, greeting, weather):
    """The golden greedy answers: reasoning then content, and a typed get_weather call."""
    response = client.chat.completions.create(**request_args(greeting, False))
    check(response.object == "chat.completion", f"object {response.object}")
    message = response.choices[0].message
    check(message.role == "assistant", f"role {message.role}")
    check(extra(message, "reasoning_content").strip() == golden_reasoning(greeting),
          f"reasoning {extra(message, 'reasoning_content')!r}")
    check(message.content.strip() == "Hello! How can I help you today?", f"content {message.content!r}")
    check(not message.tool_calls, "unexpected tool calls")
    check(response.choices[0].finish_reason == "stop", f"finish {response.choices[0].finish_reason}")

    content, reasoning, calls, finish = assemble(client.chat.completions.create(**request_args(greeting, True)))
    check(reasoning.strip() == golden_reasoning(greeting), f"streamed reasoning {reasoning!r}")
    check(content.strip() == "Hello! How can I help you today?", f"streamed content {content!r}")
    check(not calls and finish == "stop", f"streamed calls {calls} finish {finish}")

    for stream in [False, True]:
        content, reasoning, calls, finish = answer(client, request_args(weather, stream))
        context = f"weather, stream {stream}: {calls} {reasoning!r}"
        check(finish == "tool_calls", f"finish {finish}: {context}")
        check(len(calls) == 1 and calls[0]["id"] and calls[0]["name"] == "get_weather", context)
        check(json.loads(calls[0]["arguments"]) == {"city": "Oslo"}, context)
        check(reasoning.strip() == golden_reasoning(weather), context)


def check_tool_choice(client, greeting, weather, time_without_thinking):
    tools = weather["tools"]
    for stream in [False, True]:
        # `none` on questions the model answers with a call by itself.
        for sequence in [weather, time_without_thinking]:
            args = dict(request_args(sequence, stream), tool_choice="none")
            content, reasoning, calls, finish = answer(client, args)
            context = f"none, {sequence['messages'][-1]['content']!r}, stream {stream}: {content!r} {calls}"
            check(not calls and finish != "tool_calls", context)
            if sequence["enable_thinking"]:
                check(reasoning.strip() == golden_reasoning(sequence), context)

        # `required` on "Hello!", which the model answers without a call by itself.
        args = dict(request_args(greeting, stream, max_tokens=160), tools=tools, tool_choice="required")
        content, reasoning, calls, finish = answer(client, args)
        context = f"required, stream {stream}: {calls}"
        check(finish == "tool_calls" and calls, context)
        for call in calls:
            assert_typed_call(call, tools, context)

        # A named function the model would not call by itself: get_time for the
        # weather question, after the reasoning it writes anyway.
        args = dict(request_args(weather, stream, max_tokens=160),
                    tool_choice={"type": "function", "function": {"name": "get_time"}})
        content, reasoning, calls, finish = answer(client, args)
        context = f"named get_time, stream {stream}: {calls} {reasoning!r}"
        check(finish == "tool_calls" and len(calls) == 1, context)
        check(assert_typed_call(calls[0], tools, context) == "get_time", context)
        check(reasoning.strip() == golden_reasoning(weather), context)

        # A named function the request does not offer: the client raises the 4xx.
        args = dict(request_args(weather, stream),
                    tool_choice={"type": "function", "function": {"name": "get_stock"}})
        try:
            answer(client, args)
        except openai.APIStatusError as error:
            check(400 <= error.status_code < 500, f"get_stock, stream {stream}: HTTP {error.status_code}")
            check("get_stock" in str(error), f"get_stock, stream {stream}: the error does not name it: {error}")
        else:
            check(False, f"tool_choice get_stock, stream {stream}: answered")


FORECAST_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def check_structured_output(client):
    """`response_format` with thinking on: the reasoning is the one the model
    writes unconstrained, and the content after it is the constrained JSON."""
    base = {
        "model": "default",
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "temperature": 0.0,
        "max_tokens": 160,
    }
    free = client.chat.completions.create(**base, stream=False).choices[0].message
    free_reasoning = (extra(free, "reasoning_content") or "").strip()
    check(free_reasoning, f"the unconstrained answer has no reasoning: {free}")

    formats = {
        "json_schema": {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST_SCHEMA}},
        "json_object": {"type": "json_object"},
    }
    for name, response_format in formats.items():
        answers = []
        for stream in [False, True]:
            content, reasoning, calls, finish = answer(
                client, dict(base, stream=stream, response_format=response_format))
            context = f"{name}, stream {stream}: {reasoning!r} {content!r}"
            check(reasoning.strip() == free_reasoning, f"the reasoning is not the free one: {context}")
            check(finish == "stop" and not calls, context)
            try:
                value = json.loads(content)
            except json.JSONDecodeError as error:
                raise SystemExit(f"FAILED: content is not JSON ({error}): {context}")
            check(isinstance(value, dict), f"content is not a JSON object: {context}")
            if name == "json_schema":
                check(set(value) == {"city", "days"}, context)
                assert_matches_schema(value, FORECAST_SCHEMA, context)
            answers.append(value)
        check(answers[0] == answers[1], f"{name}: streamed and not differ: {answers}")


def assert_logprob_entry(entry, top, context):
    """One `logprobs.content` entry in OpenAI's shape, read through the
    client's typed objects; greedy decoding chose the most likely token."""
    check(isinstance(entry.token, str), f"token {entry.token!r} is not a string: {context}")
    check(isinstance(entry.logprob, float) and entry.logprob <= 0.0, f"logprob {entry.logprob!r}: {context}")
    check(isinstance(entry.top_logprobs, list) and len(entry.top_logprobs) == top,
          f"{entry.top_logprobs!r}, asked {top}: {context}")
    previous = 0.0
    for alternative in [entry] + entry.top_logprobs:
        check(isinstance(alternative.token, str), f"an alternative's token {alternative.token!r}: {context}")
        check(isinstance(alternative.bytes, list) and all(isinstance(b, int) for b in alternative.bytes),
              f"bytes {alternative.bytes!r} is not a list of ints: {context}")
        check(bytes(alternative.bytes) == alternative.token.encode("utf-8"),
              f"bytes {alternative.bytes!r} are not the UTF-8 of {alternative.token!r}: {context}")
        check(isinstance(alternative.logprob, float), f"logprob {alternative.logprob!r}: {context}")
    for alternative in entry.top_logprobs:
        check(alternative.logprob <= previous, f"alternatives not in decreasing order: {context}")
        previous = alternative.logprob
    best = entry.top_logprobs[0]
    check(best.token == entry.token and abs(best.logprob - entry.logprob) < 1e-6,
          f"the greedy token is not the most likely alternative: {context}")


def check_logprobs(client, arithmetic):
    """`logprobs` with `top_logprobs` 3 on the golden arithmetic question: the
    tokens spell the golden greedy completion, streamed as in the response."""
    top = 3
    args = dict(request_args(arithmetic, False, max_tokens=6), logprobs=True, top_logprobs=top)
    content = client.chat.completions.create(**args).choices[0].logprobs.content
    check(len(content) == 6, f"{len(content)} logprobs entries for 6 tokens")
    for index, entry in enumerate(content):
        assert_logprob_entry(entry, top, f"entry {index}")
    text = "".join(entry.token for entry in content)
    check(arithmetic["greedy_completion_text"].startswith(text),
          f"the tokens {text!r} do not begin the golden completion")

    streamed = []
    for chunk in client.chat.completions.create(**dict(args, stream=True)):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content or [])
    for index, entry in enumerate(streamed):
        assert_logprob_entry(entry, top, f"streamed entry {index}")
    check([(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content],
          "streamed logprobs differ from the response's")


def check_completion_logprobs(client, arithmetic):
    """`/v1/completions` with `logprobs` 3 on the golden arithmetic prompt,
    read through the client's `Completion` type: the tokens spell the golden
    greedy completion's start, each the most likely of its alternatives."""
    top = 3
    choice = client.completions.create(
        model="default", prompt=arithmetic["rendered_prompt"], max_tokens=6, temperature=0,
        logprobs=top).choices[0]
    logprobs = choice.logprobs
    check(logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 6,
          f"completion logprobs {logprobs!r}")
    check(arithmetic["greedy_completion_text"].startswith("".join(logprobs.tokens)),
          f"the tokens {logprobs.tokens!r} do not begin the golden completion")
    for token, value, alternatives in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        check(len(alternatives) == top, f"{alternatives!r}, asked {top}")
        check(abs(max(alternatives.values()) - value) < 1e-6 and abs(alternatives[token] - value) < 1e-6,
              f"the greedy token {token!r} is not the most likely of {alternatives!r}")


def golden_content(sequence):
    """The content of a golden greedy completion (after `</think>`, without the end of turn)."""
    return sequence["greedy_completion_text"].split("</think>")[1].removesuffix("<|im_end|>").strip()


def check_responses(client, greeting, weather):
    """The Responses API: the golden greeting as text, whole and through the
    client's stream helper (which checks that every event names the same
    items), and the golden weather call with the tool in the Responses shape."""
    args = {"model": "default", "input": greeting["messages"], "temperature": 0.0, "max_output_tokens": 96}
    response = client.responses.create(**args)
    check(response.output_text.strip() == golden_content(greeting), f"responses text {response.output_text!r}")
    check(extra(response, "reasoning").strip() == golden_reasoning(greeting),
          f"responses reasoning {extra(response, 'reasoning')!r}")
    with client.responses.stream(**args) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    check(deltas.strip() == golden_content(greeting), f"streamed responses text {deltas!r}")
    check(final.output_text.strip() == golden_content(greeting), f"final responses text {final.output_text!r}")
    for answer in [response, final]:
        first = answer.output[0]
        check(first.type == "reasoning" and first.content[0].text.strip() == golden_reasoning(greeting),
              f"responses reasoning item {answer.output!r}")
    # The conversation goes on with the answer's output given back as it came,
    # as OpenAI's guide to conversation state does it.
    follow_up = client.responses.create(
        **dict(args, input=greeting["messages"] + final.output + [{"role": "user", "content": "What is 7 + 5?"}]))
    check(follow_up.output[0].type == "reasoning" and follow_up.output_text.strip() != "",
          f"responses follow-up {follow_up.output!r}")

    tools = [dict(type="function", **tool["function"]) for tool in weather["tools"]]
    args = {"model": "default", "input": weather["messages"], "tools": tools, "temperature": 0.0,
            "max_output_tokens": 96}
    for stream in [False, True]:
        if stream:
            with client.responses.stream(**args) as events:
                for _ in events:
                    pass
                response = events.get_final_response()
        else:
            response = client.responses.create(**args)
        calls = [item for item in response.output if item.type == "function_call"]
        context = f"responses weather, stream {stream}: {response.output}"
        check(len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id, context)
        check(json.loads(calls[0].arguments) == {"city": "Oslo"}, context)
        check(extra(response, "reasoning").strip() == golden_reasoning(weather), context)


def main():
    base_url, golden_path = sys.argv[1], sys.argv[2]
    sequences = json.load(open(golden_path))["sequences"]
    arithmetic, greeting, weather, time_without_thinking = sequences[:4]
    client = OpenAI(base_url=base_url, api_key="not-needed")

    models = client.models.list()
    check(len(models.data) >= 1, "no model listed")

    check_golden_chats(client, greeting, weather)
    check_tool_choice(client, greeting, weather, time_without_thinking)
    check_structured_output(client)
    check_logprobs(client, arithmetic)
    check_completion_logprobs(client, arithmetic)
    check_responses(client, greeting, weather)
    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
