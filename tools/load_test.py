#!/usr/bin/env python3
"""Bounded load test of a running `mistralrs serve` (OpenAI chat completions) on this machine.

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

import argparse
import http.client
import ipaddress
import json
import math
import socket
import sys
import threading
import time
import urllib.parse

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


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:1234", help="server base URL (loopback only)")
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


class Result:
    def __init__(self):
        self.ok = False
        self.error = None
        self.latency_s = None
        self.ttft_s = None
        self.completion_tokens = None
        self.tokens_estimated = False


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
    body.update({"model": "default", "max_tokens": args.max_tokens, "temperature": 0.0, "stream": args.stream})
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


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
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


if __name__ == "__main__":
    sys.exit(main())
