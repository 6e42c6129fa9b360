"""A minimal MCP server over stdio (JSON-RPC 2.0, one message a line) offering the
golden chats' two tools, get_weather and get_time. Each tools/call is appended
to the file named by the first argument as one JSON line {"name", "arguments"},
and answered with a fixed text: for get_weather, the tool result of the golden
chat about Paris's weather, whatever the city.

Usage: python3 mcp_weather_server.py CALLS_FILE
"""

import json
import sys

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather and forecast for a city",
        "inputSchema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
    {
        "name": "get_time",
        "description": "Current local time in a city",
        "inputSchema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
]

ANSWERS = {
    "get_weather": json.dumps({"city": "Paris", "temperature": 18, "sky": "cloudy"}),
    "get_time": "12:00",
}


def result_of(method, params, calls_file):
    if method == "initialize":
        return {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "berrylm-test-weather", "version": "1"},
        }
    if method == "tools/list":
        return {"tools": TOOLS}
    if method == "tools/call":
        with open(calls_file, "a", encoding="utf-8") as calls:
            calls.write(json.dumps({"name": params["name"], "arguments": params.get("arguments")}) + "\n")
        return {"content": [{"type": "text", "text": ANSWERS[params["name"]]}]}
    if method == "ping":
        return {}
    return None


def main():
    calls_file = sys.argv[1]
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        if "id" not in message:
            continue  # a notification: no answer
        result = result_of(message["method"], message.get("params") or {}, calls_file)
        if result is None:
            reply = {"jsonrpc": "2.0", "id": message["id"],
                     "error": {"code": -32601, "message": f"unknown method {message['method']}"}}
        else:
            reply = {"jsonrpc": "2.0", "id": message["id"], "result": result}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
