#!/usr/bin/env python3
"""Load tool for a running `mistralrs serve` (OpenAI-compatible HTTP) on this machine.

Modes:

    python3 tools/load_test.py [basic options]          the bounded chat-completions run (default)
    python3 tools/load_test.py sweep [options]          throughput / TTFT / inter-token latency grid
    python3 tools/load_test.py interference [options]   running streams' latency around a long prefill
    python3 tools/load_test.py soak [options]           mixed long-running traffic, errors, memory

`python3 tools/load_test.py MODE --help` describes each mode. Every mode accepts only loopback
URLs (127.0.0.0/8, localhost, ::1), takes `--url`, `--model` and `--timeout-s`, and never waits on
the server without a time limit. A malformed response is counted as an error, with its text, never
a crash. Standard library only (asyncio on raw sockets for the streaming modes), so it runs on a
machine without a package registry.

What the host (mistral.rs 0.8.1, read in .host/mistralrs-server-core/src and mistralrs-core/src)
supports, which the streaming modes work around:

* `/v1/completions` takes `prompt` as a string only (`CompletionRequest.prompt: String`): an array of
  token ids is rejected before it reaches the engine. The modes therefore probe once
  (`--prompt-kind auto`): token ids if the server takes them, else words `t<id>` when the server
  counts them as one token each (the word-level tokenizer of `berrylm-bench --save-checkpoint`
  checkpoints, whose vocabulary is `t0 ... t<vocab-1>`), else common English words (about one token
  each; the measured `usage.prompt_tokens` of a probe is reported beside the requested length).
* No `min_tokens` / `ignore_eos` (not in the request types or `SamplingParams`; unknown JSON fields
  are ignored): requests use temperature 0 and the tools report the output tokens actually
  generated. `--ignore-eos` still sends `ignore_eos` and `min_tokens` for a server that honours them.
* A stream's last chunk carries `usage` (completions since the seam's "Usage of streamed
  completions" edits; the pristine host sent none there), which gives the output tokens; without
  it they are the chunks that carry text (one per decode step; a multi-byte character split over
  tokens arrives as one chunk).
* `/metrics` is not a route of the pristine host; the seam adds it (docs/host-seam.md, "Metrics
  endpoint"). Against a host without it (404) `soak` records that and falls back to
  /proc/PID/status (VmRSS) of `--server-pid`.
"""

import argparse
import asyncio
import copy
import dataclasses
import http.client
import ipaddress
import json
import math
import os
import random
import socket
import sys
import threading
import time
import urllib.parse
from typing import Optional

MODES = ("sweep", "interference", "soak")

BASIC_HELP = """Bounded load test of chat completions (the default mode; the other modes are `sweep`,
`interference` and `soak`: `load_test.py MODE --help`).

Usage:

    python3 tools/load_test.py [--url http://127.0.0.1:1234] [--requests 64] [--concurrency 8]
                               [--max-tokens 32] [--stream] [--prompts FILE] [--timeout-s 300]

It sends --requests chat completions (`"model": "default"`, temperature 0, `max_tokens`
--max-tokens), at most --concurrency at a time, cycling through the prompts, and stops after
those requests or after --timeout-s seconds in all, whichever comes first (requests not finished
by then count as failed). Then it prints one table: requests ok / failed, wall time, requests/s,
completion tokens/s (the sum of `usage.completion_tokens` over the successful requests divided
by the wall time), latency p50/p90/p99 in ms (request sent to response complete) and, with
--stream, time to first token p50/p99 (request sent to the first chunk that carries content,
reasoning or a tool call). The exit status is 1 when any request failed, 2 on bad arguments.

The built-in prompts suit the bundled model (tests/fixtures/trained-tiny): arithmetic questions,
greetings, and weather / time questions with the `get_weather` and `get_time` tools of its golden
file. --prompts FILE takes a JSON list whose items are either a string (one user message) or an
object `{"messages": [...], "tools": [...]?, "enable_thinking": bool?}`; an object with such a list
under `"sequences"` (a fixture's golden.json) works too.

Only loopback URLs are accepted (127.0.0.0/8, localhost, ::1). Standard library only.

Example, with the bundled model:

    cargo xtask serve &        # serves tests/fixtures/trained-tiny/model on 127.0.0.1:1234
    python3 tools/load_test.py --requests 64 --concurrency 8 --stream
"""

GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather and forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
GET_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS = [GET_WEATHER, GET_TIME]


def user(text, tools=None, enable_thinking=None):
    request = {"messages": [{"role": "user", "content": text}]}
    if tools:
        request["tools"] = tools
    if enable_thinking is not None:
        request["enable_thinking"] = enable_thinking
    return request


DEFAULT_PROMPTS = [
    user("What is 7 + 5?"),
    user("Hello!"),
    user("What is the weather in Oslo?", TOOLS),
    user("What is 12 + 30?"),
    user("Hi there!"),
    user("What time is it in Lima?", TOOLS, enable_thinking=False),
    user("What is 9 - 4?", enable_thinking=False),
    user("Good morning!"),
    user("What is the weather in Paris?", TOOLS),
    user("What is 6 * 3?"),
    user("What time is it in Tokyo?", TOOLS),
    user("Hey, how are you?", enable_thinking=False),
]


def parse_basic_args(argv):
    parser = argparse.ArgumentParser(
        prog="load_test.py", description=BASIC_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:1234", help="server base URL (loopback only)")
    parser.add_argument("--model", default="default", help='the request\'s "model" (default "default")')
    parser.add_argument("--requests", type=int, default=64, help="requests to send in all (default 64)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (default 8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request (default 32)")
    parser.add_argument("--stream", action="store_true", help="stream the responses (SSE) and measure time to first token")
    parser.add_argument("--prompts", metavar="FILE", help="JSON list of prompts (see above)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="time limit of the whole run in seconds (default 300)")
    args = parser.parse_args(argv)
    for name in ("requests", "concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.timeout_s > 0:
        parser.error("--timeout-s must be positive")
    return args


def loopback_target(url):
    """(host, port, path prefix) of a loopback http URL, or an error message."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http":
        return None, f"--url {url}: only http:// is supported"
    host = parsed.hostname
    if not host:
        return None, f"--url {url}: no host"
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, parsed.port or 80, proto=socket.IPPROTO_TCP)}
    except socket.gaierror as error:
        return None, f"--url {url}: cannot resolve {host}: {error}"
    for address in addresses:
        if not ipaddress.ip_address(address.split("%")[0]).is_loopback:
            return None, f"--url {url}: {host} resolves to {address}, which is not a loopback address"
    return (host, parsed.port or 80, parsed.path.rstrip("/")), None


def load_prompts(path):
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if isinstance(data, dict):
        data = data.get("sequences")
    if not isinstance(data, list) or not data:
        raise ValueError("expected a non-empty JSON list (or an object with a `sequences` list)")
    prompts = []
    for index, item in enumerate(data):
        if isinstance(item, str):
            prompts.append(user(item))
        elif isinstance(item, dict) and isinstance(item.get("messages"), list):
            request = {"messages": item["messages"]}
            if item.get("tools"):
                request["tools"] = item["tools"]
            if item.get("enable_thinking") is not None:
                request["enable_thinking"] = item["enable_thinking"]
            prompts.append(request)
        else:
            raise ValueError(f"item {index}: expected a string or an object with `messages`")
    return prompts


@dataclasses.dataclass(eq=False)
class Result:
    ok: bool = False
    error: Optional[str] = None
    latency_s: Optional[float] = None
    ttft_s: Optional[float] = None
    completion_tokens: Optional[int] = None
    tokens_estimated: bool = False


def carries_output(chunk):
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


def read_stream(response, started, deadline, result):
    """Reads an SSE stream of chat.completion.chunk objects into result."""
    usage = None
    output_chunks = 0
    finished = False
    buffer = b""
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("time limit reached while streaming")
        line = response.readline()
        if not line:
            break
        buffer += line
        if not line.endswith(b"\n"):
            continue
        text = buffer.decode("utf-8").strip()
        buffer = b""
        if not text.startswith("data:"):
            continue  # blank separators, comments, event names
        payload = text[len("data:"):].strip()
        if payload == "[DONE]":
            finished = True
            break
        chunk = json.loads(payload)
        if chunk.get("error"):
            raise RuntimeError(f"error in stream: {chunk['error']}")
        if carries_output(chunk):
            output_chunks += 1
            if result.ttft_s is None:
                result.ttft_s = time.monotonic() - started
        if chunk.get("usage"):
            usage = chunk["usage"]
    if not finished:
        raise RuntimeError("stream ended without [DONE]")
    if usage and usage.get("completion_tokens") is not None:
        result.completion_tokens = int(usage["completion_tokens"])
    else:
        result.completion_tokens = output_chunks
        result.tokens_estimated = True


def send(target, prompt, args, deadline):
    host, port, prefix = target
    result = Result()
    body = dict(prompt)
    body.update({"model": args.model, "max_tokens": args.max_tokens, "temperature": 0.0, "stream": args.stream})
    if args.stream:
        body["stream_options"] = {"include_usage": True}
    data = json.dumps(body).encode("utf-8")
    started = time.monotonic()
    remaining = deadline - started
    if remaining <= 0:
        result.error = "time limit reached before sending"
        return result
    connection = http.client.HTTPConnection(host, port, timeout=remaining)
    try:
        connection.request(
            "POST",
            prefix + "/v1/chat/completions",
            body=data,
            headers={"Content-Type": "application/json", "Accept": "text/event-stream" if args.stream else "application/json"},
        )
        response = connection.getresponse()
        if response.status != 200:
            detail = response.read(500).decode("utf-8", "replace")
            raise RuntimeError(f"HTTP {response.status}: {detail}")
        if args.stream:
            read_stream(response, started, deadline, result)
        else:
            payload = json.loads(response.read())
            if payload.get("error"):
                raise RuntimeError(f"error: {payload['error']}")
            if not payload.get("choices"):
                raise RuntimeError(f"no choices: {json.dumps(payload)[:300]}")
            usage = payload.get("usage") or {}
            if usage.get("completion_tokens") is None:
                raise RuntimeError("no usage.completion_tokens in the response")
            result.completion_tokens = int(usage["completion_tokens"])
        result.latency_s = time.monotonic() - started
        result.ok = True
    except (OSError, http.client.HTTPException, ValueError, RuntimeError, TimeoutError) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        connection.close()
    return result


def percentile(values, fraction):
    """Nearest-rank percentile: the ceil(fraction * n)-th smallest value."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def run(args, target, prompts):
    """Sends the requests; returns (results by index, wall seconds)."""
    results = [None] * args.requests
    lock = threading.Lock()
    next_index = [0]
    start = time.monotonic()
    deadline = start + args.timeout_s

    def worker():
        while True:
            with lock:
                index = next_index[0]
                if index >= args.requests or time.monotonic() >= deadline:
                    return
                next_index[0] += 1
            results[index] = send(target, prompts[index % len(prompts)], args, deadline)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(args.concurrency, args.requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        # Sockets time out at the deadline; the grace covers a request stuck elsewhere.
        thread.join(max(0.0, deadline + 5.0 - time.monotonic()))
    wall = time.monotonic() - start
    for index, result in enumerate(results):
        if result is None:
            results[index] = Result()
            results[index].error = "not sent, or not finished, within --timeout-s"
    return results, wall


def ms(seconds):
    return "-" if seconds is None else f"{seconds * 1000.0:.1f}"


def report(args, results, wall):
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    estimated = any(r.tokens_estimated for r in ok)
    latencies = [r.latency_s for r in ok]
    rows = [
        ("requests ok", str(len(ok))),
        ("requests failed", str(len(failed))),
        ("wall time (s)", f"{wall:.2f}"),
        ("requests/s", f"{len(ok) / wall:.2f}" if wall > 0 else "-"),
        ("completion tokens/s" + (" (~, counted chunks)" if estimated else ""),
         f"{tokens / wall:.1f}" if wall > 0 else "-"),
        ("latency p50 (ms)", ms(percentile(latencies, 0.50))),
        ("latency p90 (ms)", ms(percentile(latencies, 0.90))),
        ("latency p99 (ms)", ms(percentile(latencies, 0.99))),
    ]
    if args.stream:
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        rows.append(("time to first token p50 (ms)", ms(percentile(ttfts, 0.50))))
        rows.append(("time to first token p99 (ms)", ms(percentile(ttfts, 0.99))))
    title = (
        f"load test: {args.url}, {args.requests} requests, concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}, {'streamed' if args.stream else 'not streamed'}"
    )
    width = max([len("metric")] + [len(name) for name, _ in rows])
    value_width = max([len("value")] + [len(value) for _, value in rows])
    print(title)
    print(f"| {'metric'.ljust(width)} | {'value'.rjust(value_width)} |")
    print(f"|{'-' * (width + 2)}|{'-' * (value_width + 2)}|")
    for name, value in rows:
        print(f"| {name.ljust(width)} | {value.rjust(value_width)} |")
    if failed:
        errors = {}
        for result in failed:
            errors[result.error] = errors.get(result.error, 0) + 1
        print("failures:")
        for error, count in sorted(errors.items(), key=lambda item: -item[1]):
            print(f"  {count} x {error}")
    return 1 if failed else 0


def main_basic(argv):
    args = parse_basic_args(argv)
    target, error = loopback_target(args.url)
    if error:
        print(f"load_test: {error}", file=sys.stderr)
        return 2
    try:
        prompts = load_prompts(args.prompts) if args.prompts else DEFAULT_PROMPTS
    except (OSError, ValueError) as problem:
        print(f"load_test: --prompts {args.prompts}: {problem}", file=sys.stderr)
        return 2
    results, wall = run(args, target, prompts)
    return report(args, results, wall)


# =====================================================================================
# The streaming modes (sweep, interference, soak): asyncio on raw sockets.
# =====================================================================================

# The tools of soak's tool requests (the brief's two simple functions).
SOAK_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current local time in a timezone",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string"}},
                "required": ["timezone"],
            },
        },
    },
]

COMMON_WORDS = (
    "the of and to in is that it for on with as was at by be this are from or have an not which but "
    "all were when we there can more if no one so what up out about who get them into time has two "
    "like other some could these then than first been may its only new over also after made any "
    "work way even well back most where much through water down each long very day good people "
    "year just make know take see come think look want give use find tell ask seem feel try leave "
    "call hand part place case week point world school house city number night area money story"
).split()

CITIES = ["Oslo", "Paris", "Lima", "Tokyo", "Nairobi", "Quito", "Perth", "Montreal"]
TIMEZONES = ["Europe/Oslo", "America/Lima", "Asia/Tokyo", "Africa/Nairobi", "UTC"]


class RequestFailed(Exception):
    """A request that failed in a way the record names (kind, text)."""

    def __init__(self, kind, text):
        super().__init__(f"{kind}: {text}")
        self.kind = kind
        self.text = text


def clip(text, limit=300):
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


class ChunkedDecoder:
    """Incremental decoder of an HTTP/1.1 chunked body."""

    def __init__(self):
        self.buffer = b""
        self.remaining = None  # bytes of the current chunk still to read; 0: its CRLF; None: a size line
        self.done = False

    def feed(self, data):
        self.buffer += data
        out = []
        while not self.done:
            if self.remaining is None:
                end = self.buffer.find(b"\r\n")
                if end < 0:
                    if len(self.buffer) > 1024:
                        raise RequestFailed("malformed", "chunk size line longer than 1 KiB")
                    break
                line = self.buffer[:end].split(b";")[0].strip()
                self.buffer = self.buffer[end + 2:]
                try:
                    size = int(line, 16)
                except ValueError:
                    raise RequestFailed("malformed", f"bad chunk size line {line[:40]!r}") from None
                if size == 0:
                    self.done = True
                    break
                self.remaining = size
            else:
                if self.remaining > 0:
                    piece = self.buffer[: self.remaining]
                    out.append(piece)
                    self.buffer = self.buffer[len(piece):]
                    self.remaining -= len(piece)
                    if self.remaining > 0:
                        break
                if len(self.buffer) < 2:
                    break
                if self.buffer[:2] != b"\r\n":
                    raise RequestFailed("malformed", "chunk not followed by CRLF")
                self.buffer = self.buffer[2:]
                self.remaining = None
        return b"".join(out)


class SSEParser:
    """Incremental server-sent-events parser: feed bytes, get (event type, data) of complete events."""

    def __init__(self):
        self.buffer = b""
        self.data = []
        self.event = ""

    def feed(self, data):
        lines = (self.buffer + data).split(b"\n")
        self.buffer = lines.pop()
        events = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self.data:
                    events.append((self.event, "\n".join(self.data)))
                self.data = []
                self.event = ""
                continue
            if line.startswith(b":"):
                continue  # a comment (keep-alive)
            field, _, value = line.partition(b":")
            if value.startswith(b" "):
                value = value[1:]
            if field == b"data":
                self.data.append(value.decode("utf-8", "replace"))
            elif field == b"event":
                self.event = value.decode("utf-8", "replace")
        if len(self.buffer) > (64 << 20):
            raise RequestFailed("malformed", "an SSE line longer than 64 MiB")
        return events


class Record:
    """One streamed request: times (time.monotonic()), output events, outcome."""

    def __init__(self, kind="plain", client=-1):
        self.kind = kind  # what the mode sent (plain, tools, reasoning, continue, long, ...)
        self.client = client
        self.sent = None
        self.first = None  # arrival of the first chunk carrying output
        self.events = []  # arrival time of every chunk carrying output
        self.end = None
        self.status = None
        self.done = False  # [DONE] seen
        self.error_kind = None
        self.error_text = None
        self.hung_up = False
        self.cancelled = False  # stopped by the tool at the end of a run
        self.refused = False  # an invalid request answered with a 4xx, as it should be
        self.usage = None
        self.finish_reason = None
        self.text = []
        self.reasoning = []
        self.tool_calls = {}
        self.body_head = b""

    def fail(self, kind, text):
        if self.error_kind is None:
            self.error_kind = kind
            self.error_text = clip(text)

    @property
    def ok(self):
        return self.error_kind is None and self.done and not self.hung_up and not self.cancelled

    @property
    def failed(self):
        return self.error_kind is not None

    def output_tokens(self):
        """(tokens, counted): usage.completion_tokens when the stream gave it, else the output chunks."""
        if isinstance(self.usage, dict) and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"], False
        return len(self.events), True

    def ttft(self):
        return None if self.first is None or self.sent is None else self.first - self.sent

    def gaps(self):
        events = self.events
        return [events[i] - events[i - 1] for i in range(1, len(events))]

    def assistant_message(self):
        message = {"role": "assistant", "content": "".join(self.text)}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            calls = []
            for index in sorted(self.tool_calls):
                call = self.tool_calls[index]
                calls.append({
                    "id": call.get("id") or f"call_{index}",
                    "type": "function",
                    "function": {"name": call.get("name", ""), "arguments": call.get("arguments", "")},
                })
            message["tool_calls"] = calls
        return message

    def handle_data(self, event, data, now):
        """One SSE event's data. Sets done / an error / the output."""
        if data == "[DONE]":
            self.done = True
            return
        if event == "error":
            self.fail("sse_error", data)
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            # mistral.rs without the seam sends an error in a stream as the bare message text.
            self.fail("sse_error", data)
            return
        try:
            if not isinstance(chunk, dict):
                raise TypeError(f"an SSE data item that is not an object: {clip(data, 200)}")
            if chunk.get("error") is not None:
                self.fail("sse_error", json.dumps(chunk["error"]))
                return
            if isinstance(chunk.get("usage"), dict):
                self.usage = chunk["usage"]
            choices = chunk.get("choices")
            if choices is None:
                return
            if not isinstance(choices, list):
                raise TypeError("`choices` is not a list")
            produced = False
            for choice in choices:
                if not isinstance(choice, dict):
                    raise TypeError("a choice is not an object")
                if "delta" in choice:
                    delta = choice.get("delta") or {}
                    content = delta.get("content")
                    if content:
                        self.text.append(str(content))
                        produced = True
                    reasoning = delta.get("reasoning_content")
                    if reasoning:
                        self.reasoning.append(str(reasoning))
                        produced = True
                    for call in delta.get("tool_calls") or []:
                        index = call.get("index", 0)
                        slot = self.tool_calls.setdefault(index, {})
                        if call.get("id"):
                            slot["id"] = call["id"]
                        function = call.get("function") or {}
                        if function.get("name"):
                            slot["name"] = slot.get("name", "") + str(function["name"])
                        if function.get("arguments"):
                            slot["arguments"] = slot.get("arguments", "") + str(function["arguments"])
                        produced = True
                else:
                    text = choice.get("text")
                    if text:
                        self.text.append(str(text))
                        produced = True
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
            if produced:
                self.events.append(now)
                if self.first is None:
                    self.first = now
        except (AttributeError, TypeError, ValueError) as error:
            self.fail("malformed", f"{error}; data: {clip(data, 200)}")


class Client:
    """Where the requests go, and their time limit."""

    def __init__(self, target, model, timeout_s):
        self.host, self.port, self.prefix = target
        self.model = model
        self.timeout_s = timeout_s


async def _open(client, method, path, body, accept):
    """Sends one request (Connection: close); returns (reader, writer, status, headers)."""
    reader, writer = await asyncio.open_connection(client.host, client.port, limit=1 << 20)
    try:
        head = (
            f"{method} {client.prefix}{path} HTTP/1.1\r\nHost: {client.host}:{client.port}\r\n"
            f"User-Agent: berrylm-load-test\r\nAccept: {accept}\r\nConnection: close\r\n"
        )
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        writer.write(head.encode("latin-1") + b"\r\n" + (body or b""))
        await writer.drain()
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as error:
            raise RequestFailed("truncated", f"connection closed before the response headers ({len(error.partial)} bytes)")
        except asyncio.LimitOverrunError:
            raise RequestFailed("malformed", "response headers longer than 1 MiB")
        status, headers = parse_head(raw)
        return reader, writer, status, headers
    except BaseException:
        writer.transport.abort()
        raise


class _Body:
    """Reads a response body: Content-Length, chunked, or up to the connection's close."""

    def __init__(self, reader, headers):
        self.reader = reader
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self.decoder = ChunkedDecoder() if self.chunked else None
        length = headers.get("content-length")
        self.left = int(length) if (length and length.isdigit() and not self.chunked) else None
        self.finished = False

    async def read(self):
        """The next piece of the body; b"" at its end. Raises RequestFailed when it is cut short."""
        while not self.finished:
            if self.left == 0:
                self.finished = True
                break
            size = 65536 if self.left is None else min(65536, self.left)
            data = await self.reader.read(size)
            if not data:
                self.finished = True
                if self.chunked and not self.decoder.done:
                    raise RequestFailed("truncated", "connection closed inside a chunked body")
                if self.left:
                    raise RequestFailed("truncated", f"connection closed {self.left} bytes before the body's end")
                break
            if self.left is not None:
                self.left -= len(data)
            if self.chunked:
                data = self.decoder.feed(data)
                if self.decoder.done:
                    self.finished = True
                if not data:
                    continue
            return data
        return b""


async def http_call(client, method, path, payload=None, timeout_s=None, limit=16 << 20):
    """A plain request; returns (status, body bytes). Raises RequestFailed (timeout, connection, ...)."""

    async def call():
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        reader, writer, status, headers = await _open(client, method, path, data, "*/*")
        try:
            body = _Body(reader, headers)
            pieces, size = [], 0
            while True:
                piece = await body.read()
                if not piece:
                    break
                pieces.append(piece)
                size += len(piece)
                if size > limit:
                    raise RequestFailed("malformed", f"response body larger than {limit} bytes")
            return status, b"".join(pieces)
        finally:
            writer.transport.abort()

    timeout_s = client.timeout_s if timeout_s is None else timeout_s
    try:
        return await asyncio.wait_for(call(), timeout_s)
    except asyncio.TimeoutError:
        raise RequestFailed("timeout", f"no complete response within {timeout_s:g} s") from None
    except (OSError, EOFError) as error:
        raise RequestFailed("connection", f"{type(error).__name__}: {error}") from None


def parse_head(raw):
    """(status, headers) of a response head (bytes up to the blank line)."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise RequestFailed("malformed", f"bad status line {clip(lines[0], 100)!r}")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


class _StreamProtocol(asyncio.Protocol):
    """One streamed request, parsed as the bytes arrive (no task switch per read: the arrival times
    are taken in the callback that receives the bytes)."""

    def __init__(self, request, record, hangup_after, finished):
        self.request = request
        self.record = record
        self.hangup_after = hangup_after
        self.finished = finished  # a future, set when the request is over
        self.transport = None
        self.head = b""
        self.status = None
        self.chunked = None
        self.left = None  # Content-Length bytes still to come, or None
        self.body_done = False
        self.error_body = []
        self.error_size = 0
        self.sse = SSEParser()
        self.pending = []
        self.scheduled = False

    def connection_made(self, transport):
        self.transport = transport
        transport.write(self.request)

    def finish(self):
        if not self.finished.done():
            self.finished.set_result(None)
        if self.transport is not None:
            self.transport.abort()  # abrupt for a hang-up; nothing more is read after the end anyway

    def data_received(self, data):
        # Only the arrival time is taken here; the parsing runs in a later callback, so that when many
        # streams' chunks arrive in one poll (one decode step of a batch), the parsing of the first
        # ones does not delay the time stamps of the others.
        self.pending.append((time.monotonic(), data))
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.process)

    def process(self):
        self.scheduled = False
        pending, self.pending = self.pending, []
        for now, data in pending:
            if self.finished.done():
                return
            self.receive(now, data)

    def receive(self, now, data):
        record = self.record
        try:
            if self.status is None:
                self.head += data
                end = self.head.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.head) > (1 << 20):
                        raise RequestFailed("malformed", "response headers longer than 1 MiB")
                    return
                data = self.head[end + 4:]
                self.status, headers = parse_head(self.head[: end + 4])
                record.status = self.status
                if "chunked" in headers.get("transfer-encoding", "").lower():
                    self.chunked = ChunkedDecoder()
                else:
                    length = headers.get("content-length", "")
                    self.left = int(length) if length.isdigit() else None
            if self.chunked is not None:
                data = self.chunked.feed(data)
                self.body_done = self.chunked.done
            elif self.left is not None:
                data = data[: self.left]
                self.left -= len(data)
                self.body_done = self.left <= 0
            if self.status != 200:
                if self.error_size < 2000:
                    self.error_body.append(data)
                    self.error_size += len(data)
                if self.body_done or self.error_size >= 2000:
                    self.fail_status()
                return
            if data:
                if len(record.body_head) < 300:
                    record.body_head += data[: 300 - len(record.body_head)]
                for event, text in self.sse.feed(data):
                    record.handle_data(event, text, now)
                    if record.done or record.failed:
                        self.finish()
                        return
                    if self.hangup_after is not None and len(record.events) >= self.hangup_after:
                        record.hung_up = True
                        self.finish()
                        return
            if self.body_done:
                self.fail_truncated()
        except RequestFailed as error:
            record.fail(error.kind, error.text)
            self.finish()
        except Exception as error:  # the tool never crashes on what a server sends
            record.fail("client_error", f"{type(error).__name__}: {error}")
            self.finish()

    def fail_status(self):
        detail = b"".join(self.error_body)[:2000].decode("utf-8", "replace")
        self.record.fail(f"http_{self.status}", detail or "(no body)")
        self.finish()

    def fail_truncated(self):
        self.record.fail(
            "truncated",
            "stream ended without [DONE]; it began: " + self.record.body_head.decode("utf-8", "replace"),
        )
        self.finish()

    def eof_received(self):
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc):
        self.process()
        if self.finished.done():
            return
        if self.status is None:
            reason = f" ({type(exc).__name__}: {exc})" if exc else ""
            self.record.fail("truncated", f"connection closed before the response headers{reason}")
            self.finish()
        elif self.status != 200:
            self.fail_status()
        else:
            self.fail_truncated()


async def stream_request(client, path, payload, record, hangup_after=None):
    """Streams one request into record (which the caller keeps, so a cancelled request leaves what it
    had). hangup_after: close the connection after that many output chunks (a client that leaves)."""
    data = json.dumps(payload).encode("utf-8")
    request = (
        f"POST {client.prefix}{path} HTTP/1.1\r\nHost: {client.host}:{client.port}\r\n"
        "User-Agent: berrylm-load-test\r\nAccept: text/event-stream\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode("latin-1") + data
    loop = asyncio.get_running_loop()
    protocol = _StreamProtocol(request, record, hangup_after, loop.create_future())
    record.sent = time.monotonic()

    async def call():
        await loop.create_connection(lambda: protocol, client.host, client.port)
        await protocol.finished

    try:
        await asyncio.wait_for(call(), client.timeout_s)
    except asyncio.TimeoutError:
        record.fail("timeout", f"no complete response within {client.timeout_s:g} s")
    except (OSError, EOFError) as error:
        record.fail("connection", f"{type(error).__name__}: {error}")
    except asyncio.CancelledError:
        record.cancelled = True
        record.end = time.monotonic()
        # The connection is aborted below; its end is the tool's doing, not the server's. (The
        # future is already cancelled when the cancellation came while awaiting it, not when it
        # came during create_connection.)
        protocol.finished.cancel()
        raise
    except Exception as error:  # the tool never crashes on what a server sends
        record.fail("client_error", f"{type(error).__name__}: {error}")
    finally:
        if protocol.transport is not None:
            protocol.transport.abort()
    record.end = time.monotonic()
    return record


async def lag_monitor(samples, interval=0.05):
    """How late the event loop wakes up: a measure of how far the client itself skews the times."""
    while True:
        before = time.monotonic()
        await asyncio.sleep(interval)
        samples.append(max(0.0, time.monotonic() - before - interval))


# ----------------------------------------------------------------------------- prompts


def make_prompt(kind, tokens, rng, vocab):
    """A prompt of about `tokens` tokens: token ids (a list), `t<id>` words, or English words."""
    lo, hi = vocab
    if kind == "ids":
        return [rng.randrange(lo, hi) for _ in range(tokens)]
    if kind == "tword":
        return " ".join(f"t{rng.randrange(lo, hi)}" for _ in range(tokens))
    return " ".join(rng.choice(COMMON_WORDS) for _ in range(tokens))


def shared_prefix(args, kind):
    """The --shared-prefix-tokens every sweep prompt begins with: the same seeded tokens every time."""
    return make_prompt(kind, args.shared_prefix_tokens, random.Random(f"{args.seed}:prefix"), args.vocab_range)


def sweep_prompt(args, kind, tokens, rng):
    """A sweep prompt of `tokens` tokens: the shared prefix (shared_prefix), then tokens of its own."""
    own = make_prompt(kind, tokens - args.shared_prefix_tokens, rng, args.vocab_range)
    if not args.shared_prefix_tokens:
        return own
    prefix = shared_prefix(args, kind)
    return prefix + own if kind == "ids" else f"{prefix} {own}"


def text_kind(kind):
    """Chat messages are text: token ids become English words there."""
    return "words" if kind == "ids" else kind


def completion_body(args, prompt, max_tokens, stream=True):
    body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if args.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    return body


async def probe_prompt(client, args, prompt):
    """A non-streamed completion of max_tokens 1: (status, usage.prompt_tokens or None, detail)."""
    try:
        status, body = await http_call(client, "POST", "/v1/completions", completion_body(args, prompt, 1, stream=False))
    except RequestFailed as error:
        return None, None, f"{error.kind}: {error.text}"
    detail = body.decode("utf-8", "replace")
    tokens = None
    if status == 200:
        try:
            usage = json.loads(detail).get("usage") or {}
            tokens = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None
        except (ValueError, AttributeError):
            pass
    return status, tokens, clip(detail, 300)


async def resolve_prompt_kind(client, args, notes):
    """The prompt kind to use (--prompt-kind, probing the server for `auto`) and what was found."""
    requested = args.prompt_kind
    findings = {"requested": requested}
    rng = random.Random(f"{args.seed}:probe")
    units = 32
    if requested in ("auto", "ids"):
        status, tokens, detail = await probe_prompt(client, args, make_prompt("ids", units, rng, args.vocab_range))
        findings["token_id_prompt"] = {"status": status, "prompt_tokens": tokens, "detail": detail}
        if status is None:
            raise RequestFailed("connection", f"the probe request failed: {detail}")
        if status == 200:
            findings["used"] = "ids"
            notes.append(f"prompts: token ids (the server took a {units}-id prompt; it counted {tokens})")
            return "ids", findings
        if requested == "ids":
            raise RequestFailed(f"http_{status}", f"--prompt-kind ids: the server rejected a token-id prompt: {detail}")
        notes.append(f"prompts: the server rejects token-id prompts (HTTP {status}: {clip(detail, 120)})")
    if requested in ("auto", "tword"):
        status, tokens, detail = await probe_prompt(client, args, make_prompt("tword", units, rng, args.vocab_range))
        findings["t_word_prompt"] = {"status": status, "prompt_tokens": tokens, "detail": detail}
        if status is None:
            raise RequestFailed("connection", f"the probe request failed: {detail}")
        if requested == "tword" or (status == 200 and tokens == units):
            findings["used"] = "tword"
            notes.append(f"prompts: words `t<id>`, one token each (a {units}-word probe counted {tokens} tokens)")
            return "tword", findings
    status, tokens, detail = await probe_prompt(client, args, make_prompt("words", units, rng, args.vocab_range))
    findings["english_prompt"] = {"status": status, "prompt_tokens": tokens, "detail": detail}
    if status is None:
        raise RequestFailed("connection", f"the probe request failed: {detail}")
    findings["used"] = "words"
    notes.append(
        f"prompts: common English words, about one token each (a {units}-word probe counted {tokens} tokens); "
        "the requested lengths are approximate"
    )
    return "words", findings


# ----------------------------------------------------------------------------- figures


def ms_or_none(seconds):
    return None if seconds is None else round(seconds * 1000.0, 3)


def latency_figures(values, prefix):
    """p50 / p99 / max in ms of a list of seconds, under prefix_*."""
    return {
        f"{prefix}_p50_ms": ms_or_none(percentile(values, 0.50)),
        f"{prefix}_p99_ms": ms_or_none(percentile(values, 0.99)),
        f"{prefix}_max_ms": ms_or_none(max(values) if values else None),
    }


def error_summary(records, samples=3):
    """{kind: {"count": n, "samples": [texts]}} of the failed records."""
    kinds = {}
    for record in records:
        if record.failed:
            entry = kinds.setdefault(record.error_kind, {"count": 0, "samples": []})
            entry["count"] += 1
            if len(entry["samples"]) < samples and record.error_text not in entry["samples"]:
                entry["samples"].append(record.error_text)
    return kinds


def fmt(value, digits=1):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(headers, rows):
    """A Markdown table: the first column left-aligned, the others right-aligned."""
    widths = [max([len(str(h))] + [len(str(row[i])) for row in rows]) for i, h in enumerate(headers)]

    def line(values):
        cells = [str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(values, widths))]
        return "| " + " | ".join(cells) + " |"

    print(line(headers))
    print("|" + "|".join(":" + "-" * (w + 1) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|")
    for row in rows:
        print(line(row))


def print_errors(kinds, indent="  "):
    for kind, entry in sorted(kinds.items(), key=lambda item: -item[1]["count"]):
        print(f"{indent}{entry['count']} x {kind}")
        for sample in entry["samples"]:
            print(f"{indent}    e.g. {sample}")


def lag_figures(samples):
    return {
        "client_loop_lag_p99_ms": ms_or_none(percentile(samples, 0.99)),
        "client_loop_lag_max_ms": ms_or_none(max(samples) if samples else None),
    }


def warn_lag(figures):
    lag = figures.get("client_loop_lag_p99_ms")
    if lag is not None and lag > 5.0:
        print(
            f"warning: the client's event loop ran up to {lag:.1f} ms late (p99): the measured times include "
            "that much of the client's own delay; use fewer clients per process",
        )


def write_json(path, data):
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, sort_keys=False, allow_nan=False, default=str)
            handle.write("\n")
    except (OSError, ValueError) as error:
        print(f"load_test: could not write {path}: {error}", file=sys.stderr)
        return
    print(f"figures written to {path}")


# ----------------------------------------------------------------------------- sweep


async def sweep_part(client, args, kind, indices, prompt_tokens, output_tokens, cell, start_at):
    """The requests of the clients `indices` of one cell, from start_at (time.monotonic(), shared by
    the processes of the cell); returns (records, event-loop lag samples)."""
    records = []
    lag = []
    monitor = asyncio.ensure_future(lag_monitor(lag))
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    stop_at = start_at + args.duration_s if args.duration_s else None

    async def worker(index):
        rng = random.Random(f"{args.seed}:sweep:{cell}:{index}")
        sent = 0
        while True:
            if stop_at is None and sent >= args.requests_per_client:
                return
            if stop_at is not None and time.monotonic() >= stop_at:
                return
            record = Record("sweep", index)
            records.append(record)
            prompt = sweep_prompt(args, kind, prompt_tokens, rng)
            await stream_request(client, "/v1/completions", completion_body(args, prompt, output_tokens), record)
            record.text = []  # not needed, and it would travel back from a worker process
            sent += 1

    try:
        await asyncio.gather(*(worker(index) for index in indices))
    finally:
        monitor.cancel()
    return records, lag


def _sweep_part_in_process(client, args, kind, indices, prompt_tokens, output_tokens, cell, start_at):
    return asyncio.run(sweep_part(client, args, kind, indices, prompt_tokens, output_tokens, cell, start_at))


def client_processes(args, concurrency):
    """Processes that run a cell's clients: --processes, or one per 64 clients (at most the CPU count)."""
    if args.processes:
        wanted = args.processes
    else:
        wanted = max(1, min(os.cpu_count() or 1, math.ceil(concurrency / 64)))
    return max(1, min(wanted, concurrency))


def sweep_cell(client, args, kind, concurrency, prompt_tokens, output_tokens, cell):
    """Runs one cell (its clients spread over processes when there are many); returns its figures."""
    processes = client_processes(args, concurrency)
    parts = [list(range(concurrency))[i::processes] for i in range(processes)]
    start_at = time.monotonic() + (0.5 if processes > 1 else 0.0)
    results = None
    if processes > 1:
        try:
            import multiprocessing
            context = multiprocessing.get_context("fork")
        except (ImportError, ValueError):
            context = None
            processes = 1
            parts = [list(range(concurrency))]
        if context is not None:
            with context.Pool(processes) as pool:
                results = pool.starmap(_sweep_part_in_process, [
                    (client, args, kind, part, prompt_tokens, output_tokens, cell, start_at) for part in parts])
    if results is None:
        results = [_sweep_part_in_process(client, args, kind, parts[0], prompt_tokens, output_tokens, cell, start_at)]
    records = [record for part, _ in results for record in part]
    lag = [sample for _, part_lag in results for sample in part_lag]
    # From the first request sent to the last response's end (the processes start at start_at, or as
    # soon as they can after it).
    ends = [r.end for r in records if r.end is not None]
    starts = [r.sent for r in records if r.sent is not None]
    wall = (max(ends) - min(starts)) if ends and starts else 0.0
    ok = [r for r in records if r.ok]
    tokens, counted = 0, False
    for record in records:
        count, was_counted = record.output_tokens()
        tokens += count
        counted = counted or was_counted
    ttfts = [r.ttft() for r in ok if r.ttft() is not None]
    gaps = [gap for r in records for gap in r.gaps()]
    latencies = [r.end - r.sent for r in ok]
    per_request = [r.output_tokens()[0] for r in ok]
    figures = {
        "concurrency": concurrency,
        "prompt_tokens": prompt_tokens,
        "max_tokens": output_tokens,
        "requests": len(records),
        "completed": len(ok),
        "errors": sum(1 for r in records if r.failed),
        "errors_by_kind": error_summary(records),
        "output_tokens": tokens,
        "output_tokens_counted_from_chunks": counted,
        "output_tokens_per_request_mean": round(sum(per_request) / len(per_request), 2) if per_request else None,
        "output_tokens_per_request_min": min(per_request) if per_request else None,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "ttft_p50_ms": ms_or_none(percentile(ttfts, 0.50)),
        "ttft_p99_ms": ms_or_none(percentile(ttfts, 0.99)),
        "itl_p50_ms": ms_or_none(percentile(gaps, 0.50)),
        "itl_p99_ms": ms_or_none(percentile(gaps, 0.99)),
        "itl_samples": len(gaps),
        "latency_p50_ms": ms_or_none(percentile(latencies, 0.50)),
        "latency_p99_ms": ms_or_none(percentile(latencies, 0.99)),
        "client_processes": processes,
    }
    figures.update(lag_figures(lag))
    return figures


async def sweep_prepare(client, args, notes):
    """The prompt kind, warm-up requests and the per-length probes: (kind, findings, measured)."""
    kind, findings = await resolve_prompt_kind(client, args, notes)
    for note in notes:
        print(note)
    if args.shared_prefix_tokens:
        # The bare prefix first: a hybrid model's server resumes a prompt only where it kept the recurrent
        # state, and keeps one where a prompt it ran ended.
        record = Record("warmup")
        await stream_request(client, "/v1/completions", completion_body(args, shared_prefix(args, kind), 1), record)
        if record.failed:
            print(f"the shared prefix's request failed: {record.error_kind}: {record.error_text}")
    rng = random.Random(f"{args.seed}:warmup")
    for _ in range(args.warmup):
        record = Record("warmup")
        prompt = sweep_prompt(args, kind, args.prompt_tokens[0], rng)
        await stream_request(client, "/v1/completions", completion_body(args, prompt, args.output_tokens[0]), record)
        if record.failed:
            print(f"warm-up request failed: {record.error_kind}: {record.error_text}")
    measured = {}
    if not args.no_probe:
        for length in args.prompt_tokens:
            _, tokens, _ = await probe_prompt(client, args, sweep_prompt(args, kind, length, rng))
            measured[length] = tokens
    return kind, findings, measured


# Output tokens of a warm-up round's requests: enough for a few batched decode steps.
WARMUP_ROUND_TOKENS = 4


def warm_up_cell(client, args, kind, concurrency, prompt_tokens, cell):
    """--warmup-rounds rounds of the cell's concurrency and prompt length, WARMUP_ROUND_TOKENS output tokens
    each, not counted in the cell: the server's first batch of a size can pay for kernels it loads, memory it
    allocates and decode graphs it captures, once. Returns the failed requests' count."""
    if not args.warmup_rounds:
        return 0
    rounds = copy.copy(args)
    rounds.requests_per_client = args.warmup_rounds
    rounds.duration_s = None
    figures = sweep_cell(client, rounds, kind, concurrency, prompt_tokens, WARMUP_ROUND_TOKENS, f"warmup:{cell}")
    if figures["errors"]:
        print(f"warm-up rounds at concurrency {concurrency}, prompt {prompt_tokens}: {figures['errors']} failed")
        print_errors(figures["errors_by_kind"])
    return figures["errors"]


def run_sweep(args, client):
    notes = []
    kind, findings, measured = asyncio.run(sweep_prepare(client, args, notes))
    cells = []
    cell = 0
    for concurrency in args.concurrency:
        for prompt_tokens in args.prompt_tokens:
            for output_tokens in args.output_tokens:
                warmup_errors = warm_up_cell(client, args, kind, concurrency, prompt_tokens, cell)
                figures = sweep_cell(client, args, kind, concurrency, prompt_tokens, output_tokens, cell)
                figures["warmup_rounds"] = args.warmup_rounds
                figures["warmup_errors"] = warmup_errors
                figures["prompt_tokens_measured"] = measured.get(prompt_tokens)
                cells.append(figures)
                cell += 1
                print(
                    f"  cell {cell}: concurrency {concurrency}, prompt {prompt_tokens}, output {output_tokens}: "
                    f"{figures['completed']}/{figures['requests']} ok, {fmt(figures['output_tokens_per_s'])} tokens/s"
                    f" ({figures['client_processes']} client process{'es' if figures['client_processes'] > 1 else ''})",
                    flush=True,
                )
    result = {
        "mode": "sweep",
        "url": args.url,
        "model": args.model,
        "prompt_kind": kind,
        "server_support": findings,
        "notes": notes,
        "requests_per_client": None if args.duration_s else args.requests_per_client,
        "duration_s": args.duration_s,
        "ignore_eos_sent": args.ignore_eos,
        "cells": cells,
    }
    lags = [c["client_loop_lag_p99_ms"] for c in cells if c["client_loop_lag_p99_ms"] is not None]
    result["client_loop_lag_p99_ms"] = max(lags) if lags else None
    print(f"\nsweep: {args.url}, prompts: {kind}, "
          + (f"{args.duration_s:g} s per cell" if args.duration_s else f"{args.requests_per_client} requests per client"))
    headers = ["conc", "prompt", "(meas)", "max_tok", "reqs", "errs", "out tok", "tok/req", "out tok/s",
               "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "wall s"]
    rows = []
    for c in cells:
        rows.append([
            c["concurrency"], c["prompt_tokens"], fmt(c["prompt_tokens_measured"]), c["max_tokens"], c["requests"],
            c["errors"], c["output_tokens"], fmt(c["output_tokens_per_request_mean"]), fmt(c["output_tokens_per_s"]),
            fmt(c["ttft_p50_ms"]), fmt(c["ttft_p99_ms"]), fmt(c["itl_p50_ms"], 2), fmt(c["itl_p99_ms"], 2),
            fmt(c["wall_s"], 2),
        ])
    print_table(headers, rows)
    print("times in ms; out tok/s = output tokens of the cell / its wall time"
          + ("; output tokens counted as text chunks (the stream carries no usage)"
             if any(c["output_tokens_counted_from_chunks"] for c in cells) else ""))
    for c in cells:
        if c["errors_by_kind"]:
            print(f"errors at concurrency {c['concurrency']}, prompt {c['prompt_tokens']}, output {c['max_tokens']}:")
            print_errors(c["errors_by_kind"])
    warn_lag(result)
    write_json(args.json, result)
    return 1 if any(c["errors"] or c["warmup_errors"] for c in cells) else 0


# ----------------------------------------------------------------------------- interference


def phase_figures(gaps, events, start, end, t0):
    """ITL figures of gaps, (previous chunk, next chunk) arrival pairs, over the phase [start, end], and
    the background streams' chunks per second in it (events: every background chunk's arrival)."""
    values = [b - a for a, b in gaps]
    figures = {"start_s": round(start - t0, 3), "duration_s": round(end - start, 3), "itl_samples": len(values)}
    figures.update(latency_figures(values, "itl"))
    chunks = sum(1 for at in events if start <= at < end)
    figures["background_chunks_per_s"] = round(chunks / (end - start), 2) if end > start else None
    return figures


async def run_interference(args, client):
    notes = []
    lag = []
    monitor = asyncio.ensure_future(lag_monitor(lag))
    records = []
    long_record = Record("long")
    try:
        kind, findings = await resolve_prompt_kind(client, args, notes)
        for note in notes:
            print(note)
        rng = random.Random(f"{args.seed}:interference")
        long_measured = None
        if not args.no_probe:
            # Another prompt of the same length: warms the long prefill up without a prefix-cache hit later.
            _, long_measured, detail = await probe_prompt(
                client, args, make_prompt(kind, args.long_prompt_tokens, rng, args.vocab_range))
            if long_measured is None:
                print(f"note: the long-prompt probe gave no prompt_tokens ({detail})")
        long_prompt = make_prompt(kind, args.long_prompt_tokens, rng, args.vocab_range)
        stop = asyncio.Event()

        async def background(index):
            client_rng = random.Random(f"{args.seed}:interference:{index}")
            while not stop.is_set():
                record = Record("background", index)
                records.append(record)
                prompt = make_prompt(kind, args.prompt_tokens, client_rng, args.vocab_range)
                await stream_request(client, "/v1/completions", completion_body(args, prompt, args.output_tokens), record)
                if record.failed:
                    await asyncio.sleep(0.2)  # no busy loop against a failing server

        t0 = time.monotonic()
        tasks = [asyncio.ensure_future(background(index)) for index in range(args.clients)]
        await asyncio.sleep(args.warmup_s)
        print(f"sending the {args.long_prompt_tokens}-token prompt after {args.warmup_s:g} s", flush=True)
        await stream_request(
            client, "/v1/completions", completion_body(args, long_prompt, args.long_output_tokens), long_record)
        prefill_end = long_record.first if long_record.first is not None else long_record.end
        await asyncio.sleep(max(0.0, prefill_end + args.window_s - time.monotonic()))
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        monitor.cancel()
    t_long = long_record.sent
    gaps = []
    arrivals = []
    for record in records:
        events = record.events
        arrivals.extend(events)
        gaps.extend((events[i - 1], events[i]) for i in range(1, len(events)))
    before_start = max(t0, t_long - args.window_s)
    after_end = prefill_end + args.window_s
    # before: gaps that ended in the window before the long prompt was sent; during: gaps that overlap
    # its prefill (from sending it to its first token), the stall included; after: gaps that began after
    # its first token, within the window.
    phases = {
        "before": phase_figures([g for g in gaps if before_start <= g[1] <= t_long], arrivals, before_start, t_long, t0),
        "during": phase_figures([g for g in gaps if g[1] > t_long and g[0] < prefill_end], arrivals, t_long,
                                prefill_end, t0),
        "after": phase_figures([g for g in gaps if prefill_end <= g[0] and g[1] <= after_end], arrivals, prefill_end,
                               after_end, t0),
    }
    background_errors = [r for r in records if r.failed]
    long_figures = {
        "prompt_tokens": args.long_prompt_tokens,
        "prompt_tokens_measured_by_probe": long_measured,
        "max_tokens": args.long_output_tokens,
        "sent_at_s": round(t_long - t0, 3),
        "ttft_ms": ms_or_none(long_record.ttft()),
        "latency_ms": ms_or_none(long_record.end - long_record.sent if long_record.end else None),
        "output_tokens": long_record.output_tokens()[0],
        "ok": long_record.ok,
        "error": None if not long_record.failed else f"{long_record.error_kind}: {long_record.error_text}",
    }
    result = {
        "mode": "interference",
        "url": args.url,
        "model": args.model,
        "prompt_kind": kind,
        "server_support": findings,
        "notes": notes,
        "clients": args.clients,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.output_tokens,
        "warmup_s": args.warmup_s,
        "window_s": args.window_s,
        "background_requests": len(records),
        "background_completed": sum(1 for r in records if r.ok),
        "background_errors": len(background_errors),
        "background_errors_by_kind": error_summary(records),
        "long_prompt": long_figures,
        "phases": phases,
    }
    result.update(lag_figures(lag))
    print(f"\ninterference: {args.url}, {args.clients} streams of {args.prompt_tokens}-token prompts "
          f"(max_tokens {args.output_tokens}), then one {args.long_prompt_tokens}-token prompt; prompts: {kind}")
    rows = []
    for name in ("before", "during", "after"):
        p = phases[name]
        rows.append([name, fmt(p["start_s"], 2), fmt(p["duration_s"], 2), p["itl_samples"], fmt(p["itl_p50_ms"], 2),
                     fmt(p["itl_p99_ms"], 2), fmt(p["itl_max_ms"], 2), fmt(p["background_chunks_per_s"])])
    print_table(["phase", "from s", "length s", "ITL n", "ITL p50", "ITL p99", "ITL max", "bg chunks/s"], rows)
    print(f"long prompt: TTFT {fmt(long_figures['ttft_ms'])} ms, "
          f"{'ok' if long_record.ok else 'FAILED: ' + str(long_figures['error'])}"
          + (f", {long_measured} prompt tokens measured by the probe" if long_measured is not None else ""))
    print("before: gaps that ended in the window before the long prompt was sent; during: gaps that overlap "
          "its prefill (sent to first token); after: gaps that began in the window after its first token (ms)")
    if background_errors:
        print("background errors:")
        print_errors(result["background_errors_by_kind"])
    warn_lag(result)
    write_json(args.json, result)
    return 1 if (background_errors or not long_record.ok) else 0


# ----------------------------------------------------------------------------- soak


def parse_prometheus(text, prefixes):
    """{series: value} of the sample lines whose metric name starts with one of prefixes, plus process memory."""
    samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace >= 0 and (space < 0 or brace < space):
            close = line.rfind("}")
            if close < brace:
                continue
            series, rest = line[: close + 1], line[close + 1:].split()
            name = line[:brace]
        else:
            parts = line.split()
            series, rest = parts[0], parts[1:]
            name = series
        if not rest:
            continue
        if not (any(name.startswith(prefix) for prefix in prefixes) or name.startswith("process_resident_memory")
                or name.startswith("process_virtual_memory")):
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        samples[series] = value if math.isfinite(value) else str(value)
    return samples


def read_vmrss(pid):
    """VmRSS of a process in bytes, or None."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    parts = line.split()
                    return int(parts[1]) * 1024 if parts[2].lower() == "kb" else int(parts[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_of(sample):
    if sample.get("rss_bytes") is not None:
        return sample["rss_bytes"]
    metrics = sample.get("metrics") or {}
    for series, value in metrics.items():
        if series.split("{")[0].endswith("process_resident_memory_bytes") and isinstance(value, float):
            return int(value)
    return None


# The server's occupancy gauges in its /metrics (the seam's names; a gauge the server leaves out,
# KV blocks without paged attention say, is absent from the report).
OCCUPANCY_GAUGES = (
    ("running", "mistralrs:num_requests_running"),
    ("waiting", "mistralrs:num_requests_waiting"),
    ("recurrent_slots_in_use", "mistralrs:recurrent_state_slots_in_use"),
    ("recurrent_slots_total", "mistralrs:recurrent_state_slots_total"),
    ("kv_blocks_in_use", "mistralrs:kv_cache_blocks_in_use"),
    ("kv_blocks_total", "mistralrs:kv_cache_blocks_total"),
    ("gpu_memory_used_bytes", "mistralrs:gpu_memory_used_bytes"),
)


def occupancy_of(sample):
    """{gauge: value} of the occupancy gauges a sample's /metrics holds."""
    metrics = sample.get("metrics") or {}
    return {key: metrics[name] for key, name in OCCUPANCY_GAUGES if isinstance(metrics.get(name), float)}


def occupancy_figures(series, end):
    """Each occupancy gauge's peak over the run and its value at the end sample."""
    peak = {}
    for sample in series:
        for key, value in occupancy_of(sample).items():
            peak[key] = max(peak.get(key, value), value)
    return {"peak": peak, "end": occupancy_of(end), "idle_at_end": end.get("idle")}


def log_uniform(rng, lo, hi):
    if hi <= lo:
        return lo
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def words_in(messages):
    total = 0
    for message in messages:
        for key in ("content", "reasoning_content"):
            if isinstance(message.get(key), str):
                total += len(message[key].split())
    return total


def chat_body(args, messages, tools=None, enable_thinking=None):
    body = {"model": args.model, "messages": messages, "max_tokens": args.output_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if tools:
        body["tools"] = tools
    if enable_thinking is not None:
        body["enable_thinking"] = enable_thinking
    if args.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = args.output_tokens
    return body


# Request-level errors the soak mixes in with --invalid-fraction: (what is wrong, the change to a
# valid completion body that makes it so). The server must answer each with a 4xx.
INVALID_CHANGES = (
    ("a negative temperature", {"temperature": -1.0}),
    ("top_logprobs beyond 20", {"logprobs": True, "top_logprobs": 100}),
    ("n beyond its bound", {"n": 100000}),
    ("an unknown model", {"model": "no-such-model"}),
    ("a negative max_tokens", {"max_tokens": -5}),
)


def invalid_request(args, kind, rng):
    """("invalid", path, body, None): a short completion made invalid in one of INVALID_CHANGES's ways."""
    _, change = rng.choice(INVALID_CHANGES)
    body = completion_body(args, make_prompt(kind, 16, rng, args.vocab_range), args.output_tokens)
    body.update(change)
    return "invalid", "/v1/completions", body, None


def invalid_because(body):
    """What INVALID_CHANGES made this body invalid."""
    return next(what for what, change in INVALID_CHANGES if all(body.get(k) == v for k, v in change.items()))


def soak_request(args, kind, rng, history):
    """(request kind, path, body, messages or None) of one soak request; history: the client's last
    finished conversation (messages including the assistant's answer), or None."""
    if rng.random() < args.invalid_fraction:
        return invalid_request(args, kind, rng)
    draw = rng.random()
    length = log_uniform(rng, args.min_prompt_tokens, args.max_prompt_tokens)
    words = text_kind(kind)
    tools_edge = args.tools_fraction
    reasoning_edge = tools_edge + args.reasoning_fraction
    continue_edge = reasoning_edge + args.continue_fraction
    if draw < tools_edge:
        context = make_prompt(words, max(0, length - 12), rng, args.vocab_range)
        question = (f"What is the weather in {rng.choice(CITIES)}?" if rng.random() < 0.5
                    else f"What time is it in {rng.choice(TIMEZONES)}?")
        messages = [{"role": "user", "content": (context + "\n\n" if context else "") + question}]
        return "tools", "/v1/chat/completions", chat_body(args, messages, SOAK_TOOLS), messages
    if draw < reasoning_edge:
        a, b = rng.randrange(11, 99), rng.randrange(11, 99)
        context = make_prompt(words, max(0, length - 16), rng, args.vocab_range)
        messages = [{"role": "user", "content": (context + "\n\n" if context else "")
                     + f"Think it through step by step: what is {a} * {b}?"}]
        return "reasoning", "/v1/chat/completions", chat_body(args, messages, enable_thinking=True), messages
    if draw < continue_edge and history is not None and words_in(history) + length // 4 < args.max_prompt_tokens:
        messages = list(history)
        last = messages[-1]
        if last.get("tool_calls"):
            for call in last["tool_calls"]:
                name = (call.get("function") or {}).get("name", "")
                result = {"temperature_c": rng.randrange(-10, 35)} if name == "get_weather" else {"time": "12:34"}
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": json.dumps(result)})
        else:
            follow = make_prompt(words, max(1, length // 4), rng, args.vocab_range)
            messages.append({"role": "user", "content": "And one more thing: " + follow})
        tools = SOAK_TOOLS if any(m.get("tool_calls") for m in messages) else None
        return "continue", "/v1/chat/completions", chat_body(args, messages, tools), messages
    if args.plain_endpoint == "completions":
        prompt = make_prompt(kind, length, rng, args.vocab_range)
        body = completion_body(args, prompt, args.output_tokens)
        return "plain", "/v1/completions", body, None
    messages = [{"role": "user", "content": make_prompt(words, length, rng, args.vocab_range)}]
    return "plain", "/v1/chat/completions", chat_body(args, messages), messages


async def scrape(client, args, state, start):
    """One time-series sample: /metrics (until it answers 404) and the server's VmRSS."""
    sample = {"t_s": round(time.monotonic() - start, 3)}
    if state["metrics_endpoint"] != "404":
        try:
            status, body = await http_call(client, "GET", "/metrics", timeout_s=min(10.0, client.timeout_s))
            if status == 404:
                state["metrics_endpoint"] = "404"
                sample["metrics_error"] = "HTTP 404: the server has no /metrics"
            elif status == 200:
                state["metrics_endpoint"] = "200"
                sample["metrics"] = parse_prometheus(body.decode("utf-8", "replace"), args.metrics_prefix)
            else:
                sample["metrics_error"] = f"HTTP {status}: {clip(body.decode('utf-8', 'replace'), 200)}"
        except RequestFailed as error:
            sample["metrics_error"] = f"{error.kind}: {error.text}"
    if args.server_pid:
        sample["rss_bytes"] = read_vmrss(args.server_pid)
    return sample


async def settle(client, args, state, start):
    """The end sample: /metrics scraped until no sequence runs or waits (the server cancels a hung-up
    request at its next token), at most --idle-timeout-s; `idle` says whether it got there (None
    without the running and waiting gauges)."""
    deadline = time.monotonic() + args.idle_timeout_s
    while True:
        sample = await scrape(client, args, state, start)
        occupancy = occupancy_of(sample)
        known = "running" in occupancy and "waiting" in occupancy
        idle = known and occupancy["running"] == 0 and occupancy["waiting"] == 0
        if idle or not known or time.monotonic() >= deadline:
            sample["idle"] = idle if known else None
            return sample
        await asyncio.sleep(min(0.5, args.metrics_interval))


def judge_invalid(record, what):
    """An invalid request must be refused with a 4xx: then it is `refused`, not an error."""
    if record.error_kind is not None and record.error_kind.startswith("http_4"):
        record.error_kind = record.error_text = None
        record.refused = True
    elif not record.hung_up:
        record.error_kind = "invalid_not_refused"
        record.error_text = clip(f"{what}: HTTP {record.status}, {record.error_text or 'answered'}")


async def run_soak(args, client):
    notes = []
    lag = []
    monitor = asyncio.ensure_future(lag_monitor(lag))
    records = []
    series = []
    state = {"metrics_endpoint": "unknown"}
    try:
        if args.plain_endpoint == "completions":
            kind, findings = await resolve_prompt_kind(client, args, notes)
        else:
            kind = "words" if args.prompt_kind in ("auto", "ids") else args.prompt_kind
            findings = {"requested": args.prompt_kind, "used": kind,
                        "note": "chat requests only: prompts are text, no probe of /v1/completions"}
        for note in notes:
            print(note)
        start = time.monotonic()
        end_at = start + args.minutes * 60.0
        stop = asyncio.Event()

        async def scraper():
            while True:
                series.append(await scrape(client, args, state, start))
                try:
                    await asyncio.wait_for(stop.wait(), args.metrics_interval)
                    return
                except asyncio.TimeoutError:
                    pass

        async def soak_client(index):
            rng = random.Random(f"{args.seed}:soak:{index}")
            history = None
            while time.monotonic() < end_at:
                request_kind, path, body, messages = soak_request(args, kind, rng, history)
                hangup = rng.randrange(1, args.hangup_after_chunks + 1) if rng.random() < args.hangup_fraction else None
                record = Record(request_kind, index)
                record.hangup_planned = hangup is not None
                records.append(record)
                await stream_request(client, path, body, record, hangup_after=hangup)
                if request_kind == "invalid":
                    judge_invalid(record, invalid_because(body))
                if record.ok and messages is not None:
                    history = messages + [record.assistant_message()]
                elif record.failed:
                    history = None
                    if args.server_pid and not os.path.exists(f"/proc/{args.server_pid}"):
                        state["server_exited"] = True
                        return  # nobody left to answer
                    await asyncio.sleep(0.2)  # no busy loop against a failing server

        scraping = asyncio.ensure_future(scraper())
        await asyncio.gather(*(soak_client(index) for index in range(args.clients)))
        stop.set()
        await scraping
        wall = time.monotonic() - start
        end = await settle(client, args, state, start)
        series.append(end)
    finally:
        monitor.cancel()
    ok = [r for r in records if r.ok]
    hung = [r for r in records if r.hung_up and not r.failed]
    refused = [r for r in records if r.refused]
    failed = [r for r in records if r.failed]
    ttfts = [r.ttft() for r in records if r.ttft() is not None and not r.failed]
    gaps = [gap for r in records if not r.failed for gap in r.gaps()]
    rss_points = [(s["t_s"], rss_of(s)) for s in series if rss_of(s) is not None]
    # At the first minute: the sample nearest 60 s (the last one of a shorter run).
    first_minute = min(rss_points, key=lambda point: abs(point[0] - 60.0)) if rss_points else (None, None)
    rss_first_minute = first_minute[1]
    # The largest sample up to that one: under load a sample moves by a tenth or more within seconds (the
    # allocator keeps and returns transient buffers), so a leak shows as an end above this peak.
    rss_first_minute_peak = max((rss for t, rss in rss_points if t <= first_minute[0]), default=None)
    rss_end = rss_points[-1][1] if rss_points else None
    per_minute = []
    for minute in range(int(math.ceil(wall / 60.0)) or 1):
        lo, hi = start + 60.0 * minute, start + 60.0 * (minute + 1)
        chunk = [r for r in records if lo <= r.sent < hi]
        minute_ttfts = [r.ttft() for r in chunk if r.ttft() is not None and not r.failed]
        minute_gaps = [gap for r in chunk if not r.failed for gap in r.gaps()]
        per_minute.append({
            "minute": minute,
            "requests": len(chunk),
            "completed": sum(1 for r in chunk if r.ok),
            "hung_up": sum(1 for r in chunk if r.hung_up and not r.failed),
            "errors": sum(1 for r in chunk if r.failed),
            "ttft_p50_ms": ms_or_none(percentile(minute_ttfts, 0.50)),
            "itl_p99_ms": ms_or_none(percentile(minute_gaps, 0.99)),
        })
    by_kind = {}
    for record in records:
        entry = by_kind.setdefault(record.kind, {"requests": 0, "completed": 0, "hung_up": 0, "refused": 0,
                                                 "errors": 0})
        entry["requests"] += 1
        entry["refused"] += int(record.refused)
        entry["completed"] += int(record.ok)
        entry["hung_up"] += int(record.hung_up and not record.failed)
        entry["errors"] += int(record.failed)
    rss_source = ("VmRSS of pid %d" % args.server_pid if args.server_pid and any(s.get("rss_bytes") is not None for s in series)
                  else "process_resident_memory_bytes of /metrics" if rss_points else None)
    result = {
        "mode": "soak",
        "url": args.url,
        "model": args.model,
        "clients": args.clients,
        "minutes": args.minutes,
        "wall_s": round(wall, 3),
        "prompt_kind": kind,
        "server_support": findings,
        "notes": notes,
        "fractions": {"tools": args.tools_fraction, "reasoning": args.reasoning_fraction,
                      "continue": args.continue_fraction, "hangup": args.hangup_fraction,
                      "invalid": args.invalid_fraction},
        "requests": len(records),
        "completed": len(ok),
        "hung_up": len(hung),
        "refused": len(refused),
        "errors": len(failed),
        "errors_by_kind": error_summary(records, samples=5),
        "by_request_kind": by_kind,
        "output_tokens": sum(r.output_tokens()[0] for r in records),
        "ttft_p50_ms": ms_or_none(percentile(ttfts, 0.50)),
        "ttft_p99_ms": ms_or_none(percentile(ttfts, 0.99)),
        "itl_p50_ms": ms_or_none(percentile(gaps, 0.50)),
        "itl_p99_ms": ms_or_none(percentile(gaps, 0.99)),
        "metrics_endpoint": state["metrics_endpoint"],
        "server_exited": state.get("server_exited", False),
        "rss_source": rss_source,
        "rss_first_minute_bytes": rss_first_minute,
        "rss_first_minute_peak_bytes": rss_first_minute_peak,
        "rss_end_bytes": rss_end,
        "occupancy": occupancy_figures(series, end),
        "per_minute": per_minute,
        "timeseries": series,
    }
    result.update(lag_figures(lag))
    print(f"\nsoak: {args.url}, {args.clients} clients, {args.minutes:g} min (wall {wall:.1f} s), "
          f"prompts {args.min_prompt_tokens}..{args.max_prompt_tokens} tokens ({kind})")
    mib = lambda value: "-" if value is None else f"{value / (1 << 20):.1f} MiB"  # noqa: E731
    rows = [
        ("requests", len(records)),
        ("completed", len(ok)),
        ("hung up (by the tool)", len(hung)),
        ("invalid, refused with a 4xx", len(refused)),
        ("errors", len(failed)),
        ("TTFT p50 / p99 (ms)", f"{fmt(result['ttft_p50_ms'])} / {fmt(result['ttft_p99_ms'])}"),
        ("ITL p50 / p99 (ms)", f"{fmt(result['itl_p50_ms'], 2)} / {fmt(result['itl_p99_ms'], 2)}"),
        ("RSS at first minute (its peak) / end",
         f"{mib(rss_first_minute)} ({mib(rss_first_minute_peak)}) / {mib(rss_end)}"),
    ]
    occupancy = result["occupancy"]
    for key, _ in OCCUPANCY_GAUGES:
        if key in occupancy["peak"]:
            show = mib if key.endswith("_bytes") else (lambda value: "-" if value is None else f"{value:g}")
            rows.append((f"{key.replace('_', ' ')}: peak / end", f"{show(occupancy['peak'][key])} / "
                         f"{show(occupancy['end'].get(key))}"))
    if state.get("server_exited"):
        rows.append(("server", f"pid {args.server_pid} exited during the run: the clients stopped"))
    if occupancy["idle_at_end"] is False:
        rows.append(("end", f"still busy {args.idle_timeout_s:g} s after the clients"))
    print_table(["figure", "value"], [list(row) for row in rows])
    print("by request kind: " + ", ".join(
        f"{name} {e['requests']} ({e['completed']} ok, {e['hung_up']} hung up, {e['refused']} refused, "
        f"{e['errors']} errors)"
        for name, e in sorted(by_kind.items())))
    if state["metrics_endpoint"] == "404":
        print("/metrics: 404 (not served); " + (f"RSS from {rss_source}" if rss_source else "no RSS source (give --server-pid)"))
    elif state["metrics_endpoint"] == "200":
        kept = len(set().union(*[set((s.get("metrics") or {}).keys()) for s in series]))
        print(f"/metrics: scraped every {args.metrics_interval:g} s, {kept} series kept; RSS from {rss_source}")
    else:
        print(f"/metrics: never answered ({series[-1].get('metrics_error') if series else 'no scrape'})")
    if failed:
        print("errors by kind:")
        print_errors(result["errors_by_kind"])
    warn_lag(result)
    write_json(args.json, result)
    return 1 if failed else 0


# ----------------------------------------------------------------------------- arguments


def int_list(text):
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, not {text!r}") from None
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, not {text!r}")
    return values


def vocab_range(text):
    lo, sep, hi = text.partition(":")
    try:
        lo, hi = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, not {text!r}") from None
    if not sep or lo < 0 or hi <= lo:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 <= LO < HI, not {text!r}")
    return lo, hi


def fraction(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], not {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], not {text!r}")
    return value


def positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}")
        return value
    return parse


SWEEP_HELP = """Throughput and latency over a grid of concurrency x prompt length x output length.

For every cell, --concurrency clients each stream /v1/completions requests back to back
(--requests-per-client each, or until --duration-s has passed), prompts of the cell's length (seeded
random token ids or words, see --prompt-kind), max_tokens the cell's output length, temperature 0.
Per cell: requests, errors, output tokens/s (all output tokens of the cell / its wall time), TTFT
p50/p99 (request sent to the first chunk with text), inter-token latency p50/p99 (gaps between the
arrivals of a stream's consecutive text chunks), and the prompt length the server counted for a
probe of that length. Prints a table; --json FILE has every figure. Exit status 1 when any request
failed, 2 on bad arguments. --warmup-rounds N sends N uncounted rounds of a cell's concurrency and
prompt length (4 output tokens each) before the cell: a server's first batch of a size can pay once
for kernels it loads, memory it allocates and decode graphs it captures.

A cell's clients run in --processes processes (default one per 64 clients): the arrival time of a
chunk is taken when its bytes are read, and one process parsing hundreds of streams would delay
them. Each cell reports how late its event loops woke up (client_loop_lag_*_ms) and the tool warns
when that exceeds 5 ms at p99. Cells run one after the other; with --duration-s, clients stop
starting requests after it and the cell's wall time runs to its last response."""

INTERFERENCE_HELP = """Inter-token latency of running streams before, during and after a long prefill.

--clients streams decode continuously (each sends /v1/completions of --prompt-tokens, max_tokens
--output-tokens, back to back). After --warmup-s one more request sends a --long-prompt-tokens prompt
(max_tokens --long-output-tokens). The running streams' inter-token gaps are grouped by the arrival times
of a gap's two chunks: before (gaps that ended in the --window-s before the long prompt was sent),
during (gaps that overlap its prefill, from sending it to its first token: the stall is one of them),
after (gaps that began in the --window-s after its first token). Reports ITL
p50/p99/max per phase and the long prompt's TTFT. Exit status 1 when a request failed."""

SOAK_HELP = """Mixed streaming traffic for --minutes: errors, latency, server memory over time.

--clients clients send streamed requests back to back: prompts of log-uniform lengths from
--min-prompt-tokens to --max-prompt-tokens; a --tools-fraction of chat requests with two tools
(get_weather(city), get_time(timezone)); a --reasoning-fraction of reasoning-style chats
(enable_thinking); a --continue-fraction that continue the client's last finished conversation
(its messages, the assistant's answer, then the tool results when it called tools, else a new user
turn: a prefix-cache hit for the server); the rest plain chats (or /v1/completions with
--plain-endpoint completions, for a checkpoint without a chat template). Independently, a
--hangup-fraction of requests close the connection after 1..--hangup-after-chunks output chunks.
Errors: HTTP status >= 400, SSE error events, malformed data, streams cut before [DONE] (other than
the tool's hang-ups), timeouts. Every --metrics-interval s it scrapes GET /metrics (sample lines of
the --metrics-prefix metrics and process memory) and, with --server-pid, VmRSS from /proc; when
/metrics is 404 that is recorded and only VmRSS is kept. Clients stop starting requests after
--minutes; requests in flight then finish (at most --timeout-s). Then it scrapes /metrics until the
server runs and queues no sequence (at most --idle-timeout-s): that is the end sample. Prints a
summary: RSS at the first minute (the sample nearest 60 s, and the largest sample up to it) and at
the end; the peak and end values of
the server's occupancy gauges (running and waiting sequences, recurrent-state slots and KV blocks in
use and in all, GPU memory used; those the server reports). --json FILE has the figures, per-minute
counts and the time series. Exit status 1 when there were errors besides hang-ups."""


def common_options(parser, default_url):
    parser.add_argument("--url", default=default_url, help=f"server base URL, loopback only (default {default_url})")
    parser.add_argument("--model", default="default", help='the requests\' "model" (default "default")')
    parser.add_argument("--timeout-s", type=positive(float), default=300.0,
                        help="time limit of each request, connection to last byte (default 300)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE as JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and the random choices (default 0)")
    parser.add_argument("--vocab-range", type=vocab_range, default=(1000, 30000), metavar="LO:HI",
                        help="token ids (or t<id> words) of the prompts are drawn from [LO, HI) (default 1000:30000)")
    parser.add_argument("--prompt-kind", choices=("auto", "ids", "tword", "words"), default="auto",
                        help="ids: token-id arrays; tword: words t<id> (one token each on berrylm-bench "
                             "checkpoints); words: common English words; auto (default): probe the server, in that order")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="also send ignore_eos and min_tokens = max_tokens (mistral.rs 0.8.1 ignores both)")


def parse_mode_args(mode, argv):
    helps = {"sweep": SWEEP_HELP, "interference": INTERFERENCE_HELP, "soak": SOAK_HELP}
    parser = argparse.ArgumentParser(prog=f"load_test.py {mode}", description=helps[mode],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common_options(parser, "http://127.0.0.1:1234")
    if mode == "sweep":
        parser.add_argument("--concurrency", type=int_list, default=[1, 16, 64, 256], metavar="LIST",
                            help="concurrent clients per cell (default 1,16,64,256)")
        parser.add_argument("--prompt-tokens", type=int_list, default=[128], metavar="LIST",
                            help="prompt lengths in tokens (default 128)")
        parser.add_argument("--output-tokens", type=int_list, default=[128], metavar="LIST",
                            help="max_tokens of the requests (default 128)")
        parser.add_argument("--requests-per-client", type=positive(int), default=4,
                            help="requests each client sends per cell (default 4)")
        parser.add_argument("--duration-s", type=positive(float), default=None,
                            help="instead: each client sends requests until this many seconds have passed")
        parser.add_argument("--warmup", type=int, default=1, help="requests sent one by one before the grid (default 1)")
        parser.add_argument("--warmup-rounds", type=int, default=0,
                            help="rounds of each cell's concurrency and prompt length (4 output tokens a request) "
                                 "sent before the cell and not counted in it (default 0)")
        parser.add_argument("--processes", type=positive(int), default=None,
                            help="client processes per cell (default: one per 64 clients, at most the CPU count), "
                                 "so that parsing the streams does not delay their time stamps")
        parser.add_argument("--no-probe", action="store_true",
                            help="skip the per-length probe that measures the server's prompt_tokens")
        parser.add_argument("--shared-prefix-tokens", type=int, default=0, metavar="N",
                            help="every prompt begins with the same N tokens (a shared system prompt or "
                                 "document), sent alone before the warm-up so that a server's prefix cache "
                                 "holds them; less than every --prompt-tokens (default 0)")
    elif mode == "interference":
        parser.add_argument("--clients", type=positive(int), default=16, help="decoding streams (default 16)")
        parser.add_argument("--prompt-tokens", type=positive(int), default=128, help="their prompt length (default 128)")
        parser.add_argument("--output-tokens", type=positive(int), default=256, help="their max_tokens (default 256)")
        parser.add_argument("--long-prompt-tokens", type=positive(int), default=32768,
                            help="the long prompt's length (default 32768)")
        parser.add_argument("--long-output-tokens", type=positive(int), default=8,
                            help="the long request's max_tokens (default 8)")
        parser.add_argument("--warmup-s", type=positive(float), default=10.0,
                            help="seconds of decoding before the long prompt is sent (default 10)")
        parser.add_argument("--window-s", type=positive(float), default=5.0,
                            help="length of the before and after windows (default 5)")
        parser.add_argument("--no-probe", action="store_true",
                            help="skip the probe (a prompt of the long length, sent alone before the run)")
    else:
        parser.add_argument("--clients", type=positive(int), default=32, help="concurrent clients (default 32)")
        parser.add_argument("--minutes", type=positive(float), default=10.0, help="duration (default 10)")
        parser.add_argument("--min-prompt-tokens", type=positive(int), default=16, help="shortest prompt (default 16)")
        parser.add_argument("--max-prompt-tokens", type=positive(int), default=4096, help="longest prompt (default 4096)")
        parser.add_argument("--output-tokens", type=positive(int), default=128, help="max_tokens (default 128)")
        parser.add_argument("--tools-fraction", type=fraction, default=0.2, help="chat requests with tools (default 0.2)")
        parser.add_argument("--reasoning-fraction", type=fraction, default=0.1,
                            help="reasoning-style chats, enable_thinking (default 0.1)")
        parser.add_argument("--continue-fraction", type=fraction, default=0.2,
                            help="requests that continue the client's last conversation (default 0.2)")
        parser.add_argument("--hangup-fraction", type=fraction, default=0.1,
                            help="requests whose connection the tool closes mid-stream (default 0.1)")
        parser.add_argument("--invalid-fraction", type=fraction, default=0.0,
                            help="invalid completions (a negative temperature, top_logprobs 100, n 100000, an "
                                 "unknown model, a negative max_tokens), which must be refused with a 4xx; "
                                 "any other answer is an error (default 0)")
        parser.add_argument("--hangup-after-chunks", type=positive(int), default=5,
                            help="a hang-up happens after 1..N output chunks (default 5)")
        parser.add_argument("--plain-endpoint", choices=("chat", "completions"), default="chat",
                            help="endpoint of the plain requests (default chat)")
        parser.add_argument("--metrics-interval", type=positive(float), default=10.0,
                            help="seconds between /metrics and RSS samples (default 10)")
        parser.add_argument("--metrics-prefix", action="append", default=None, metavar="PREFIX",
                            help="keep /metrics samples whose name starts with PREFIX (repeatable; default mistralrs:)")
        parser.add_argument("--idle-timeout-s", type=positive(float), default=60.0,
                            help="after the clients, wait at most this long for the server to be idle (default 60)")
        parser.add_argument("--server-pid", type=positive(int), default=None,
                            help="pid of the server, for VmRSS from /proc/PID/status")
    args = parser.parse_args(argv)
    args.mode = mode
    if mode == "soak":
        args.metrics_prefix = args.metrics_prefix or ["mistralrs:"]
        if args.tools_fraction + args.reasoning_fraction + args.continue_fraction > 1.0 + 1e-9:
            parser.error("--tools-fraction + --reasoning-fraction + --continue-fraction must be at most 1")
        if args.min_prompt_tokens > args.max_prompt_tokens:
            parser.error("--min-prompt-tokens must be at most --max-prompt-tokens")
        if args.server_pid and not os.path.exists(f"/proc/{args.server_pid}/status"):
            parser.error(f"--server-pid {args.server_pid}: no /proc/{args.server_pid}/status")
    if mode == "sweep" and not 0 <= args.shared_prefix_tokens < min(args.prompt_tokens):
        parser.error("--shared-prefix-tokens must be 0 or more and less than every --prompt-tokens")
    if mode == "sweep" and args.warmup_rounds < 0:
        parser.error("--warmup-rounds must be 0 or more")
    if mode == "sweep" and args.warmup < 0:
        parser.error("--warmup must be at least 0")
    return args


def main_mode(mode, argv):
    args = parse_mode_args(mode, argv)
    target, error = loopback_target(args.url)
    if error:
        print(f"load_test: {error}", file=sys.stderr)
        return 2
    client = Client(target, args.model, args.timeout_s)
    try:
        if mode == "sweep":
            return run_sweep(args, client)
        runner = {"interference": run_interference, "soak": run_soak}[mode]
        return asyncio.run(runner(args, client))
    except RequestFailed as failure:
        print(f"load_test {mode}: {failure.kind}: {failure.text}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"load_test {mode}: interrupted", file=sys.stderr)
        return 130


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in MODES:
        return main_mode(argv[0], argv[1:])
    if argv and argv[0] == "basic":
        argv = argv[1:]
    return main_basic(argv)


if __name__ == "__main__":
    sys.exit(main())
