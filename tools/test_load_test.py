#!/usr/bin/env python3
"""Tests of tools/load_test.py against a fake OpenAI-style SSE server started here in a thread.

Run (standard library only):

    python3 tools/test_load_test.py -v        # unittest
    python3 -m pytest tools/test_load_test.py # where pytest is installed

The fake server (http.server, HTTP/1.1, chunked SSE) answers /v1/completions and
/v1/chat/completions: the first chunk after a delay that grows with the prompt's length, then one
chunk per token at a fixed interval; a prompt at or over `long_threshold` tokens stalls every
stream for `long_stall_s` (a long prefill). Like mistral.rs 0.8.1 it rejects token-id prompts
(422) unless told otherwise, and answers /metrics with 404 unless given a Prometheus text (or a
function of the server that returns one).
"""

import asyncio
import contextlib
import io
import json
import os
import socket
import sys
import tempfile
import threading
import time
import unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load_test  # noqa: E402


def invalid_value(request):
    """What is invalid in a request (the values the soak's --invalid-fraction sends), or None."""
    if (request.get("temperature") or 0) < 0:
        return "temperature must be at least 0"
    if request.get("top_logprobs") is not None and not 0 <= request["top_logprobs"] <= 20:
        return "top_logprobs must be 0-20"
    if (request.get("n") or 1) > 128:
        return "n is too large"
    if request.get("model", "default") != "default":
        return "unknown model"
    if (request.get("max_tokens") or 1) < 0:
        return "max_tokens must be positive"
    return None


class FakeServer:
    def __init__(self, *, accept_token_ids=False, metrics=None, fail_every=0, fail_status=500,
                 ttft_base_s=0.005, ttft_per_token_s=0.0002, itl_s=0.004, long_threshold=None,
                 long_stall_s=0.5, garbage=None, validates=True):
        self.accept_token_ids = accept_token_ids
        self.metrics = metrics
        self.fail_every = fail_every
        self.fail_status = fail_status
        self.ttft_base_s = ttft_base_s
        self.ttft_per_token_s = ttft_per_token_s
        self.itl_s = itl_s
        self.long_threshold = long_threshold
        self.long_stall_s = long_stall_s
        self.garbage = garbage  # None, "not-json", "truncate", "bad-chunk"
        self.validates = validates  # refuse invalid values with a 4xx, as mistral.rs with the seam does
        self.lock = threading.Lock()
        self.stall_until = 0.0
        self.streams = 0
        self.disconnects = 0
        self.prompt_types = set()
        self.prompts = []
        self.chat_roles = []
        self.metrics_hits = 0
        self.active = 0  # streams being answered
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/metrics" and server.metrics is not None:
                    server.metrics_hits += 1
                    text = server.metrics(server) if callable(server.metrics) else server.metrics
                    self.reply(200, text.encode(), "text/plain; version=0.0.4")
                else:
                    server.metrics_hits += self.path == "/metrics"
                    self.reply(404, b"", "text/plain")

            def reply(self, status, body, content_type="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                length = int(self.headers.get("Content-Length", "0"))
                request = json.loads(self.rfile.read(length))
                chat = self.path.endswith("/chat/completions")
                if chat:
                    messages = request.get("messages") or []
                    with server.lock:
                        server.chat_roles.append([m.get("role") for m in messages])
                    prompt_tokens = sum(len(str(m.get("content") or "").split()) for m in messages)
                else:
                    prompt = request.get("prompt")
                    with server.lock:
                        server.prompt_types.add(type(prompt).__name__)
                        server.prompts.append(prompt)
                    if isinstance(prompt, list) and not server.accept_token_ids:
                        self.reply(422, b"Failed to deserialize the JSON body into the target type: prompt: "
                                        b"invalid type: sequence, expected a string", "text/plain")
                        return
                    prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
                if server.validates and invalid_value(request):
                    self.reply(422, json.dumps({"error": {"message": invalid_value(request),
                                                          "type": "invalid_request_error"}}).encode())
                    return
                max_tokens = int(request.get("max_tokens") or 16)
                if not request.get("stream"):
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}
                    if chat:
                        choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}
                    else:
                        choice = {"index": 0, "text": " ok", "finish_reason": "length"}
                    self.reply(200, json.dumps({"choices": [choice], "usage": usage}).encode())
                    return
                with server.lock:
                    server.streams += 1
                    number = server.streams
                if server.fail_every and number % server.fail_every == 0:
                    self.reply(server.fail_status, b'{"message": "injected failure"}')
                    return
                with server.lock:
                    server.active += 1
                try:
                    self.stream(chat, request, prompt_tokens, max_tokens)
                finally:
                    with server.lock:
                        server.active -= 1

            def chunk(self, data):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def event(self, obj):
                self.chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

            def wait_stall(self):
                while True:
                    left = server.stall_until - time.monotonic()
                    if left <= 0:
                        return
                    time.sleep(left)

            def stream(self, chat, request, prompt_tokens, max_tokens):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    if server.long_threshold and prompt_tokens >= server.long_threshold:
                        with server.lock:
                            server.stall_until = time.monotonic() + server.long_stall_s
                        time.sleep(server.long_stall_s)
                    else:
                        time.sleep(server.ttft_base_s + server.ttft_per_token_s * prompt_tokens)
                    self.chunk(b": keep-alive\n\n")
                    if server.garbage == "not-json":
                        self.event(b"Model error: CUDA out of memory")
                        self.event(b"[DONE]")
                        self.chunk(b"")
                        return
                    tool_call = chat and request.get("tools") and "weather" in json.dumps(request.get("messages"))
                    for index in range(max_tokens):
                        self.wait_stall()
                        if index:
                            time.sleep(server.itl_s)
                        last = index == max_tokens - 1
                        if server.garbage == "truncate" and index == 2:
                            self.chunk(b"")  # ends the body without [DONE]
                            return
                        if server.garbage == "bad-chunk" and index == 2:
                            self.event({"choices": "nonsense"})
                            continue
                        if chat:
                            delta = {"content": f" w{index}"}
                            if tool_call and index == 0:
                                delta = {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {
                                    "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}
                            data = {"choices": [{"index": 0, "delta": delta, "finish_reason": "length" if last else None}]}
                            if last:
                                data["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens}
                        else:
                            data = {"choices": [{"index": 0, "text": f" w{index}", "finish_reason": "length" if last else None}]}
                        self.event(data)
                    self.event(b"[DONE]")
                    self.chunk(b"")
                except (BrokenPipeError, ConnectionResetError):
                    with server.lock:
                        server.disconnects += 1
                    self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def run_tool(argv):
    """(exit status, stdout, JSON figures) of load_test.main(argv + --json)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "out.json")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = load_test.main(list(argv) + ["--json", path])
        figures = None
        if os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                figures = json.load(handle)
    return status, out.getvalue(), figures


# ----------------------------------------------------------------------------- units


def test_chunked_decoder_and_sse_parser_take_any_split():
    body = b"data: {\"a\": 1}\r\n\r\n: comment\n\ndata: line one\ndata: line two\n\nevent: error\ndata: boom\n\ndata: [DONE]\n\n"
    wire = b""
    for start in range(0, len(body), 7):
        piece = body[start:start + 7]
        wire += b"%x;ext=1\r\n%s\r\n" % (len(piece), piece)
    wire += b"0\r\n\r\n"
    for step in (1, 3, 64, len(wire)):
        decoder, parser, events = load_test.ChunkedDecoder(), load_test.SSEParser(), []
        for start in range(0, len(wire), step):
            events += parser.feed(decoder.feed(wire[start:start + step]))
        assert decoder.done
        assert events == [("", '{"a": 1}'), ("", "line one\nline two"), ("error", "boom"), ("", "[DONE]")], events


def test_malformed_chunk_size_is_an_error_not_a_crash():
    decoder = load_test.ChunkedDecoder()
    try:
        decoder.feed(b"zz\r\nhello\r\n")
    except load_test.RequestFailed as error:
        assert error.kind == "malformed"
    else:
        raise AssertionError("expected RequestFailed")


def test_prometheus_lines_kept_by_prefix_and_process_memory():
    text = (
        "# HELP mistralrs_requests_total Requests.\n# TYPE mistralrs_requests_total counter\n"
        'mistralrs_requests_total{endpoint="chat"} 12\n'
        'mistralrs_kv_blocks{kind="used gpu"} 7.5 1700000000000\n'
        "other_metric 3\nprocess_resident_memory_bytes 1.2e9\nprocess_cpu_seconds_total 4\nbroken_line\n"
        "mistralrs_bad not-a-number\n"
    )
    samples = load_test.parse_prometheus(text, ["mistralrs_"])
    assert samples == {
        'mistralrs_requests_total{endpoint="chat"}': 12.0,
        'mistralrs_kv_blocks{kind="used gpu"}': 7.5,
        "process_resident_memory_bytes": 1.2e9,
    }, samples


def test_only_loopback_urls():
    for mode in ([], ["sweep"], ["interference"], ["soak"]):
        with contextlib.redirect_stderr(io.StringIO()):
            assert load_test.main(mode + ["--url", "http://8.8.8.8:1234"]) == 2


# ----------------------------------------------------------------------------- sweep


def test_sweep_table_and_json_figures():
    with FakeServer(ttft_per_token_s=0.0002, itl_s=0.004) as server:
        status, out, figures = run_tool([
            "sweep", "--url", server.url, "--concurrency", "1,3", "--prompt-tokens", "16,400",
            "--output-tokens", "6", "--requests-per-client", "2", "--timeout-s", "20",
        ])
    assert status == 0, out
    assert figures["mode"] == "sweep"
    # Like mistral.rs 0.8.1: token ids rejected (422), `t<id>` words counted one token each.
    assert figures["server_support"]["token_id_prompt"]["status"] == 422
    assert figures["prompt_kind"] == "tword"
    assert server.prompt_types == {"list", "str"}
    cells = figures["cells"]
    assert [(c["concurrency"], c["prompt_tokens"], c["max_tokens"]) for c in cells] == [
        (1, 16, 6), (1, 400, 6), (3, 16, 6), (3, 400, 6)]
    for cell in cells:
        assert cell["requests"] == cell["concurrency"] * 2 and cell["completed"] == cell["requests"]
        assert cell["errors"] == 0 and cell["errors_by_kind"] == {}
        assert cell["output_tokens"] == cell["requests"] * 6
        assert cell["output_tokens_counted_from_chunks"] is True
        assert cell["prompt_tokens_measured"] == cell["prompt_tokens"]
        assert abs(cell["output_tokens_per_s"] - cell["output_tokens"] / cell["wall_s"]) < 0.02 * cell["output_tokens_per_s"] + 0.1
        assert cell["itl_samples"] == cell["requests"] * 5
        assert 3.5 <= cell["itl_p50_ms"] <= cell["itl_p99_ms"] < 250
        assert cell["ttft_p50_ms"] <= cell["ttft_p99_ms"]
    # TTFT grows with the prompt (fake prefill: 5 ms + 0.2 ms per token).
    by_key = {(c["concurrency"], c["prompt_tokens"]): c for c in cells}
    for concurrency in (1, 3):
        short, long = by_key[(concurrency, 16)], by_key[(concurrency, 400)]
        assert short["ttft_p50_ms"] + 40 < long["ttft_p50_ms"], (short, long)
        assert long["ttft_p50_ms"] >= 85
    assert "out tok/s" in out and "TTFT p50" in out and "ITL p99" in out
    assert out.count("\n| ") >= 5  # header + 4 cells


def test_sweep_warmup_rounds_run_before_each_cell_and_are_not_counted():
    def streams_of_a_run(rounds):
        with FakeServer(accept_token_ids=True) as server:
            status, out, figures = run_tool([
                "sweep", "--url", server.url, "--concurrency", "3,2", "--prompt-tokens", "8",
                "--output-tokens", "6", "--requests-per-client", "2", "--warmup-rounds", str(rounds),
            ])
            assert status == 0, out
            return server.streams, figures["cells"]

    plain_streams, plain_cells = streams_of_a_run(0)
    warm_streams, warm_cells = streams_of_a_run(2)
    # Two rounds of 3 and of 2 clients: 10 more completions, none of them in a cell.
    assert warm_streams - plain_streams == 2 * 3 + 2 * 2
    for plain, warm in zip(plain_cells, warm_cells):
        assert (warm["requests"], warm["completed"], warm["output_tokens"]) == (
            plain["requests"], plain["completed"], plain["output_tokens"])
        assert warm["requests"] == warm["concurrency"] * 2 and warm["output_tokens"] == warm["requests"] * 6
        assert (plain["warmup_rounds"], warm["warmup_rounds"]) == (0, 2)
        assert warm["warmup_errors"] == 0


def test_sweep_warmup_round_failures_fail_the_run():
    with FakeServer(accept_token_ids=True, fail_every=3) as server:
        status, out, figures = run_tool([
            "sweep", "--url", server.url, "--concurrency", "3", "--prompt-tokens", "8", "--output-tokens", "2",
            "--requests-per-client", "1", "--warmup-rounds", "1", "--no-probe", "--warmup", "0",
        ])
    # Every third stream fails, so one of the warm-up round's three does: reported, and the exit status is 1.
    assert status == 1, out
    assert figures["cells"][0]["warmup_errors"] >= 1
    assert "warm-up rounds at concurrency 3" in out


def test_sweep_sends_token_ids_when_the_server_takes_them():
    with FakeServer(accept_token_ids=True) as server:
        status, out, figures = run_tool([
            "sweep", "--url", server.url, "--concurrency", "4", "--prompt-tokens", "32", "--output-tokens", "3",
            "--requests-per-client", "2", "--vocab-range", "5:10", "--seed", "7", "--processes", "2",
        ])
    assert status == 0, out
    assert figures["prompt_kind"] == "ids"
    assert server.prompt_types == {"list"}
    cell = figures["cells"][0]
    assert cell["prompt_tokens_measured"] == 32
    # The cell's clients ran in two processes; their records came back and were counted together.
    assert cell["client_processes"] == 2 and "2 client processes" in out
    assert cell["requests"] == 8 and cell["completed"] == 8 and cell["output_tokens"] == 24


def test_sweep_prompts_share_a_prefix_when_asked():
    with FakeServer() as server:
        status, out, figures = run_tool([
            "sweep", "--url", server.url, "--concurrency", "2", "--prompt-tokens", "24,40", "--output-tokens", "2",
            "--requests-per-client", "2", "--shared-prefix-tokens", "10",
        ])
    assert status == 0, out
    assert [c["prompt_tokens_measured"] for c in figures["cells"]] == [24, 40]
    # After the probes of the prompt kind, the prefix alone, then the warm-up, the length probes and the
    # cells' requests.
    words = [p.split() for p in server.prompts if isinstance(p, str) and len(p.split()) in (10, 24, 40)]
    prefix, prompts = words[0], words[1:]
    assert len(prefix) == 10 and len(prompts) == 1 + 2 + 2 * 2 * 2, len(prompts)
    assert all(words[:10] == prefix for words in prompts)
    assert len({tuple(words[10:]) for words in prompts}) == len(prompts)


def test_a_shared_prefix_must_be_shorter_than_every_prompt():
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            load_test.main(["sweep", "--url", "http://127.0.0.1:9", "--prompt-tokens", "64,16",
                            "--shared-prefix-tokens", "16"])
            code = 0
        except SystemExit as exit:
            code = exit.code
    assert code == 2 and "--shared-prefix-tokens" in errors.getvalue(), errors.getvalue()


def test_malformed_streams_are_counted_errors():
    for garbage, kind in (("not-json", "sse_error"), ("truncate", "truncated"), ("bad-chunk", "malformed")):
        with FakeServer(accept_token_ids=True, garbage=garbage) as server:
            status, out, figures = run_tool([
                "sweep", "--url", server.url, "--concurrency", "2", "--prompt-tokens", "8",
                "--output-tokens", "5", "--requests-per-client", "2", "--warmup", "0", "--timeout-s", "10",
            ])
        assert status == 1, (garbage, out)
        cell = figures["cells"][0]
        assert cell["errors"] == 4 and list(cell["errors_by_kind"]) == [kind], (garbage, cell)
        if garbage == "not-json":
            assert "CUDA out of memory" in cell["errors_by_kind"][kind]["samples"][0]


def test_a_request_that_times_out_is_an_error():
    with FakeServer(accept_token_ids=True, itl_s=0.5) as server:
        started = time.monotonic()
        status, out, figures = run_tool([
            "sweep", "--url", server.url, "--concurrency", "1", "--prompt-tokens", "4", "--output-tokens", "20",
            "--requests-per-client", "1", "--warmup", "0", "--timeout-s", "1",
        ])
    assert status == 1 and time.monotonic() - started < 8
    assert list(figures["cells"][0]["errors_by_kind"]) == ["timeout"]


def test_a_request_cancelled_by_the_tool_is_not_an_error():
    """A run's end cancels the requests in flight. One cancelled after its connection was made but
    before `create_connection` returned (a window the interference mode's end sometimes hit) was
    counted as "connection closed before the response headers" when the tool aborted its connection."""
    async def scenario(listener):
        loop = asyncio.get_running_loop()
        connect = loop.create_connection
        made = asyncio.Event()

        async def connect_then_wait(factory, host, port):
            result = await connect(factory, host, port)
            made.set()
            await asyncio.sleep(3600)  # the cancellation lands here
            return result

        loop.create_connection = connect_then_wait
        client = load_test.Client(("127.0.0.1", listener.getsockname()[1], ""), "default", 10.0)
        record = load_test.Record("background")
        task = asyncio.ensure_future(
            load_test.stream_request(client, "/v1/completions", {"prompt": "t1", "stream": True}, record))
        await made.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.05)  # the aborted connection's callbacks run
        return record

    # A server that takes the connection (the kernel's backlog) and never answers.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        record = asyncio.run(scenario(listener))
    assert record.cancelled and not record.failed and not record.ok, (record.error_kind, record.error_text)


# ----------------------------------------------------------------------------- interference


def test_interference_phases():
    with FakeServer(itl_s=0.01, long_threshold=1000, long_stall_s=0.6) as server:
        status, out, figures = run_tool([
            "interference", "--url", server.url, "--clients", "3", "--prompt-tokens", "8", "--output-tokens", "30",
            "--long-prompt-tokens", "2000", "--long-output-tokens", "2", "--warmup-s", "0.8", "--window-s", "0.5",
            "--no-probe", "--timeout-s", "20",
        ])
    assert status == 0, out
    phases = figures["phases"]
    before, during, after = phases["before"], phases["during"], phases["after"]
    assert before["itl_samples"] > 10 and after["itl_samples"] > 10 and during["itl_samples"] >= 3
    # Every running stream stalls for the 0.6 s prefill: the stall shows in "during" only.
    assert during["itl_max_ms"] >= 500, during
    assert before["itl_p99_ms"] < 200 and after["itl_p99_ms"] < 200, (before, after)
    assert before["itl_p50_ms"] < 50 and after["itl_p50_ms"] < 50
    assert figures["long_prompt"]["ok"] and figures["long_prompt"]["ttft_ms"] >= 550
    assert abs(during["duration_s"] * 1000 - figures["long_prompt"]["ttft_ms"]) < 5
    assert figures["background_errors"] == 0
    assert "during" in out and "long prompt: TTFT" in out


# ----------------------------------------------------------------------------- soak


def soak_args(server, *extra):
    return ["soak", "--url", server.url, "--clients", "4", "--minutes", "0.04", "--max-prompt-tokens", "64",
            "--output-tokens", "8", "--metrics-interval", "0.5", "--timeout-s", "20", *extra]


def test_soak_hangups_are_not_errors_and_rss_falls_back_to_proc():
    with FakeServer(itl_s=0.01) as server:
        status, out, figures = run_tool(soak_args(
            server, "--hangup-fraction", "0.3", "--hangup-after-chunks", "3", "--tools-fraction", "0.4",
            "--reasoning-fraction", "0.1", "--continue-fraction", "0.4", "--server-pid", str(os.getpid())))
    assert status == 0, out
    assert figures["errors"] == 0 and figures["errors_by_kind"] == {}
    assert figures["hung_up"] > 0 and figures["completed"] > 0
    assert figures["requests"] == figures["completed"] + figures["hung_up"]
    assert figures["metrics_endpoint"] == "404"
    assert figures["rss_source"].startswith("VmRSS")
    assert figures["rss_first_minute_bytes"] > 0 and figures["rss_end_bytes"] > 0
    assert len(figures["timeseries"]) >= 3 and all(s["rss_bytes"] for s in figures["timeseries"])
    # The server saw every hang-up as a connection closed mid-stream (or finished first).
    time.sleep(0.2)
    assert server.disconnects > 0
    kinds = figures["by_request_kind"]
    assert {"tools", "plain"} <= set(kinds), kinds
    assert kinds.get("continue", {}).get("requests", 0) > 0, kinds
    # Continued conversations carried the assistant's answer (and tool results after a tool call).
    assert any("assistant" in roles for roles in server.chat_roles)
    assert any("tool" in roles for roles in server.chat_roles)
    assert "hung up" in out and "/metrics: 404" in out


def test_soak_http_500_is_an_error_and_a_nonzero_exit():
    with FakeServer(fail_every=3, itl_s=0.005) as server:
        status, out, figures = run_tool(soak_args(server, "--hangup-fraction", "0.2"))
    assert status == 1, out
    assert figures["errors"] > 0
    assert set(figures["errors_by_kind"]) == {"http_500"}
    assert "injected failure" in figures["errors_by_kind"]["http_500"]["samples"][0]
    assert "errors by kind" in out


def test_soak_invalid_requests_must_be_refused():
    with FakeServer() as server:
        status, out, figures = run_tool(soak_args(server, "--hangup-fraction", "0", "--invalid-fraction", "0.4"))
    assert status == 0, out
    assert figures["refused"] > 0 and figures["errors"] == 0
    assert figures["by_request_kind"]["invalid"]["refused"] == figures["refused"]
    assert figures["completed"] + figures["refused"] == figures["requests"]
    assert "refused with a 4xx" in out
    # A server that accepts them fails the soak: each answered invalid request is an error.
    with FakeServer(validates=False) as server:
        status, out, figures = run_tool(soak_args(server, "--hangup-fraction", "0", "--invalid-fraction", "0.4"))
    assert status == 1, out
    assert figures["refused"] == 0 and set(figures["errors_by_kind"]) == {"invalid_not_refused"}


def test_soak_scrapes_prometheus_metrics():
    metrics = ("# TYPE mistralrs:generation_tokens_total counter\nmistralrs:generation_tokens_total 3\n"
               "unrelated_total 9\nprocess_resident_memory_bytes 123456789\n")
    with FakeServer(metrics=metrics) as server:
        status, out, figures = run_tool(soak_args(server, "--hangup-fraction", "0"))
    assert status == 0, out
    assert figures["metrics_endpoint"] == "200"
    samples = figures["timeseries"]
    assert len(samples) >= 3 and server.metrics_hits == len(samples)
    assert all(s["metrics"] == {"mistralrs:generation_tokens_total": 3.0,
                                "process_resident_memory_bytes": 123456789.0} for s in samples)
    assert figures["rss_end_bytes"] == 123456789
    assert figures["hung_up"] == 0
    # Without the occupancy gauges there is nothing to wait for or report.
    assert figures["occupancy"] == {"peak": {}, "end": {}, "idle_at_end": None}


def test_soak_reports_occupancy_and_ends_on_an_idle_server():
    def metrics(server):
        return ("# TYPE mistralrs:num_requests_running gauge\n"
                f"mistralrs:num_requests_running {server.active}\nmistralrs:num_requests_waiting 0\n"
                f"mistralrs:recurrent_state_slots_in_use {server.active}\n"
                "mistralrs:recurrent_state_slots_total 8\nmistralrs:process_resident_memory_bytes 5e6\n")
    with FakeServer(metrics=metrics, itl_s=0.01) as server:
        status, out, figures = run_tool(soak_args(server, "--hangup-fraction", "0.3"))
    assert status == 0, out
    occupancy = figures["occupancy"]
    assert occupancy["idle_at_end"] is True, occupancy
    assert occupancy["end"] == {"running": 0.0, "waiting": 0.0, "recurrent_slots_in_use": 0.0,
                                "recurrent_slots_total": 8.0}, occupancy
    assert occupancy["peak"]["running"] >= 1 and occupancy["peak"]["recurrent_slots_in_use"] >= 1, occupancy
    assert figures["timeseries"][-1]["idle"] is True
    assert figures["rss_first_minute_bytes"] == figures["rss_end_bytes"] == 5000000
    assert figures["rss_first_minute_peak_bytes"] == 5000000
    assert "recurrent slots in use: peak / end" in out and "kv blocks" not in out


def test_soak_reports_the_first_minutes_peak_resident_memory():
    scrapes = []

    def metrics(server):
        # 5 MB, then 9 MB on the second scrape only, then 6 MB: the peak is the second scrape's.
        scrapes.append(len(scrapes))
        rss = {1: 9e6}.get(len(scrapes) - 1, 5e6 if len(scrapes) == 1 else 6e6)
        return ("mistralrs:num_requests_running 0\nmistralrs:num_requests_waiting 0\n"
                f"mistralrs:process_resident_memory_bytes {rss}\n")
    with FakeServer(metrics=metrics, itl_s=0.01) as server:
        status, out, figures = run_tool(soak_args(server))
    assert status == 0, out
    assert len(scrapes) >= 3, scrapes
    assert figures["rss_first_minute_peak_bytes"] == 9000000
    assert figures["rss_end_bytes"] == 6000000
    assert "RSS at first minute (its peak) / end" in out


# ----------------------------------------------------------------------------- basic (the default mode)


def test_basic_mode_unchanged():
    with FakeServer() as server:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = load_test.main(["--url", server.url, "--requests", "4", "--concurrency", "2", "--stream"])
    assert status == 0, out.getvalue()
    assert "requests ok" in out.getvalue() and "time to first token p50" in out.getvalue()


# ----------------------------------------------------------------------------- unittest runner


class LoadToolTests(unittest.TestCase):
    """The test functions above, for `python3 tools/test_load_test.py` (pytest collects the functions)."""

    __test__ = False  # pytest: the functions are collected directly


for _name, _function in list(globals().items()):
    if _name.startswith("test_") and callable(_function):
        setattr(LoadToolTests, _name, (lambda f: lambda self: f())(_function))
del _name, _function


if __name__ == "__main__":
    LoadToolTests.__test__ = True
    unittest.main()
