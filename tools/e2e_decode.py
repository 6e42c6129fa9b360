#!/usr/bin/env python3
"""Batch-1 decode speed of a running `mistralrs serve`, end to end over HTTP.

Usage:

    python3 tools/e2e_decode.py [--url http://127.0.0.1:18500] [--prompt-tokens 32]
                                [--max-tokens 129] [--repeats 5] [--warmup 2]
                                [--compare-forward-ms X] [--json OUT] [--timeout-s 300]

Meant for a checkpoint written by `berrylm-bench --save-checkpoint DIR` (a word-level tokenizer
over `t0 ... t{vocab-1}`, eos the last word), served alone, one request at a time. The prompt is
--prompt-tokens words `tK t1 t2 ...` (K differs per request so that no request reuses another's
prefix cache). For each repetition it sends, one after the other, a completion (`/v1/completions`,
temperature 0) with `max_tokens` 1 and one with `max_tokens` M (--max-tokens), checks that the
server generated exactly that many tokens (`usage.completion_tokens`; a shorter completion, e.g. an
early eos, fails the run) and times each request from sending to the complete response. With t_1
and t_M the medians over the repetitions:

    decode ms/step = (t_M - t_1) / (M - 1)      (prefill and request overhead cancel out)
    prefill + first token = t_1                 (one request's fixed cost, HTTP included)
    decode tokens/s = 1000 / ms per step

--compare-forward-ms X (the model forward ms/step at batch 1 that `berrylm-bench` measured at the
same shape, dtype and device) adds the engine's overhead per step: e2e ms/step - X.
The exit status is 1 when any request failed, 2 on bad arguments. Standard library only.
"""

import argparse
import http.client
import json
import statistics
import sys
import time
import urllib.parse


def parse_args(argv):
    parser = argparse.ArgumentParser(description="batch-1 decode ms/step through a running server")
    parser.add_argument("--url", default="http://127.0.0.1:18500")
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=129)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compare-forward-ms", type=float, default=None)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    args = parser.parse_args(argv)
    if args.prompt_tokens < 1 or args.max_tokens < 2 or args.repeats < 1 or args.warmup < 0:
        parser.error("--prompt-tokens >= 1, --max-tokens >= 2, --repeats >= 1, --warmup >= 0")
    return args


def prompt(tokens, request):
    """`tK t1 t2 ...`: a distinct first word per request, ids far below the vocabulary's end."""
    words = [f"t{tokens + 1 + request}"] + [f"t{i}" for i in range(1, tokens)]
    return " ".join(words)


class Client:
    def __init__(self, url, timeout):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"--url must be http://HOST:PORT, not {url}")
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.base = parsed.path.rstrip("/")
        self.timeout = timeout

    def post(self, path, body):
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            payload = json.dumps(body).encode()
            started = time.perf_counter()
            connection.request(
                "POST", self.base + path, body=payload, headers={"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            data = response.read()
            elapsed = time.perf_counter() - started
        finally:
            connection.close()
        if response.status != 200:
            raise RuntimeError(f"{path}: HTTP {response.status}: {data[:500]!r}")
        return json.loads(data), elapsed


def complete(client, args, request, max_tokens):
    """One timed completion; returns seconds. Fails unless exactly max_tokens were generated."""
    body = {
        "model": args.model,
        "prompt": prompt(args.prompt_tokens, request),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": False,
    }
    response, elapsed = client.post("/v1/completions", body)
    usage = response.get("usage") or {}
    generated = usage.get("completion_tokens")
    prompt_tokens = usage.get("prompt_tokens")
    if generated != max_tokens:
        choice = (response.get("choices") or [{}])[0]
        raise RuntimeError(
            f"asked for {max_tokens} tokens, the server generated {generated} "
            f"(finish_reason {choice.get('finish_reason')!r}); an early eos makes the figure wrong"
        )
    if prompt_tokens is not None and prompt_tokens != args.prompt_tokens:
        raise RuntimeError(
            f"the prompt is {prompt_tokens} tokens, expected {args.prompt_tokens}: "
            "is the served checkpoint the word-level one of berrylm-bench --save-checkpoint?"
        )
    return elapsed


def main(argv=None):
    args = parse_args(argv)
    try:
        client = Client(args.url, args.timeout_s)
    except ValueError as error:
        print(f"e2e_decode: {error}", file=sys.stderr)
        return 2
    m = args.max_tokens
    request = 0
    t1, tm = [], []
    try:
        for _ in range(args.warmup):
            complete(client, args, request, m)
            request += 1
        for _ in range(args.repeats):
            t1.append(complete(client, args, request, 1))
            request += 1
            tm.append(complete(client, args, request, m))
            request += 1
    except (OSError, http.client.HTTPException, ValueError, RuntimeError) as error:
        print(f"e2e_decode: request {request} failed: {error}", file=sys.stderr)
        return 1

    t1_s, tm_s = statistics.median(t1), statistics.median(tm)
    step_ms = (tm_s - t1_s) * 1e3 / (m - 1)
    figures = {
        "url": args.url,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": m,
        "repeats": args.repeats,
        "t1_ms": [round(t * 1e3, 3) for t in t1],
        "tm_ms": [round(t * 1e3, 3) for t in tm],
        "prefill_and_first_token_ms": t1_s * 1e3,
        "decode_ms_per_step": step_ms,
        "decode_tokens_per_s": 1e3 / step_ms if step_ms > 0 else None,
        "request_tokens_per_s": m / tm_s,
    }
    print(f"batch-1 decode through {args.url}: prompt {args.prompt_tokens} tokens, "
          f"{m} generated tokens, median of {args.repeats}")
    print(f"  max_tokens 1:   {t1_s * 1e3:9.2f} ms  (prefill + first token + request overhead)")
    print(f"  max_tokens {m}: {tm_s * 1e3:9.2f} ms  ({m / tm_s:.1f} tokens/s over the request)")
    print(f"  decode:         {step_ms:9.3f} ms/step  ({figures['decode_tokens_per_s'] or 0:.1f} tokens/s)")
    if args.compare_forward_ms is not None:
        overhead = step_ms - args.compare_forward_ms
        figures["forward_ms_per_step"] = args.compare_forward_ms
        figures["engine_overhead_ms_per_step"] = overhead
        print(f"  model forward:  {args.compare_forward_ms:9.3f} ms/step (berrylm-bench)")
        share = f" ({100 * overhead / step_ms:.0f}% of the e2e step)" if step_ms > 0 else ""
        print(f"  engine overhead:{overhead:9.3f} ms/step{share}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)
            out.write("\n")
    print("E2E_DECODE_JSON " + json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
