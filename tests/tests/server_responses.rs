//! The Responses API (`POST /v1/responses`) through the real server: the
//! bundled model answers its golden chats as the reference wrote them, its
//! reasoning as a `reasoning` item (and in `reasoning`), its text as a message
//! item and its tool call as a `function_call` item, whole and streamed, and
//! continues a conversation from a response's output given back as input, the
//! tool's output as a `function_call_output` item. Streamed, a tool call
//! arrives as OpenAI streams one: its item (call id and name) added, its
//! arguments in deltas, done, and in the completed response (mistral.rs 0.8.1
//! sent only the argument deltas, without the call's name, and a completed
//! response without the call).

use anyhow::{Context, Result};
use berrylm_tests::chat::{function_call_items, golden_chat_request, responses_answer};
use berrylm_tests::server::Server;
use berrylm_tests::Fixture;
use serde_json::{json, Value};

/// The bundled trained model and an f32 server of it.
fn served() -> Result<(Fixture, Server)> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    Ok((fixture, server))
}

/// The Responses request for golden sequence `index`: its messages as input
/// and its tools in the chat completions' shape (the endpoint also reads the
/// Responses API's, which `tests/e2e/openai_client.py` sends).
fn responses_request(fixture: &Fixture, index: usize, stream: bool) -> Result<Value> {
    let chat = golden_chat_request(&fixture.facts["sequences"][index], 128, false)?;
    let mut request = json!({
        "model": "default",
        "input": chat["messages"],
        "temperature": 0.0,
        "max_output_tokens": 128,
        "stream": stream,
    });
    if !chat["tools"].is_null() {
        request["tools"] = chat["tools"].clone();
    }
    Ok(request)
}

fn text_of(value: &Value) -> &str {
    value.as_str().map(str::trim).unwrap_or_default()
}

/// "What is 7 + 5?" and "Hello!": the reasoning and the text of the
/// reference, whole and streamed (the text deltas add up to it).
#[test]
fn answers_in_text_as_the_reference_whole_and_streamed() -> Result<()> {
    let (fixture, server) = served()?;
    for index in [0, 1] {
        let (reasoning, text) = fixture.reference_answer(index)?;
        let (status, whole) =
            server.post("/v1/responses", &responses_request(&fixture, index, false)?)?;
        assert_eq!(status, 200, "{whole}");
        assert_eq!(whole["status"], "completed", "{whole}");
        assert_answer(&whole, &reasoning, &text);
        let output = whole["output"].as_array().context("output")?;
        assert_eq!(output.len(), 2, "{whole}");
        assert_eq!(output[1]["type"], "message", "{whole}");

        let (status, events) =
            server.post_stream("/v1/responses", &responses_request(&fixture, index, true)?)?;
        assert_eq!(status, 200, "{events:?}");
        let streamed: String = events
            .iter()
            .filter(|event| event["type"] == "response.output_text.delta")
            .filter_map(|event| event["delta"].as_str())
            .collect();
        assert_eq!(streamed.trim(), text, "{events:?}");
        let streamed_reasoning: String = events
            .iter()
            .filter(|event| event["type"] == "response.reasoning_text.delta")
            .filter_map(|event| event["delta"].as_str())
            .collect();
        assert_eq!(streamed_reasoning.trim(), reasoning, "{events:?}");
        // The reasoning item (output 0) is added and done before the message
        // (output 1) is added.
        let positions: Vec<(String, u64)> = events
            .iter()
            .filter(|event| {
                event["type"] == "response.output_item.added"
                    || event["type"] == "response.output_item.done"
            })
            .map(|event| {
                let kind = format!("{} {}", event["type"], event["item"]["type"]);
                (kind, event["output_index"].as_u64().unwrap_or(u64::MAX))
            })
            .collect();
        let expected: Vec<(String, u64)> = [
            ("\"response.output_item.added\" \"reasoning\"", 0),
            ("\"response.output_item.done\" \"reasoning\"", 0),
            ("\"response.output_item.added\" \"message\"", 1),
            ("\"response.output_item.done\" \"message\"", 1),
        ]
        .into_iter()
        .map(|(kind, index)| (kind.to_string(), index))
        .collect();
        assert_eq!(positions, expected, "{events:?}");
        let completed = completed_response(&events)?;
        assert_answer(completed, &reasoning, &text);
    }
    Ok(())
}

/// "What is the weather in Oslo?" with `get_weather` offered: the reference
/// reasons, then calls `get_weather` with `{"city": "Oslo"}`.
#[test]
fn calls_the_reference_tool_whole_and_streamed() -> Result<()> {
    let (fixture, server) = served()?;
    let (reasoning, rest) = fixture.reference_answer(2)?;
    assert!(
        rest.contains("<function=get_weather>") && rest.contains("Oslo"),
        "{rest}"
    );
    let expected_arguments = json!({"city": "Oslo"});

    let (status, whole) = server.post("/v1/responses", &responses_request(&fixture, 2, false)?)?;
    assert_eq!(status, 200, "{whole}");
    assert_reasoning(&whole, &reasoning);
    let output = whole["output"].as_array().context("output")?;
    assert_eq!(output.len(), 2, "{whole}");
    assert_function_call(&output[1], &expected_arguments);

    let (status, events) =
        server.post_stream("/v1/responses", &responses_request(&fixture, 2, true)?)?;
    assert_eq!(status, 200, "{events:?}");
    let of_type = |kind: &str| -> Vec<&Value> {
        events
            .iter()
            .filter(|event| event["type"] == kind)
            .collect()
    };
    let calls_of = |kind: &str| -> Vec<&Value> {
        of_type(kind)
            .into_iter()
            .filter(|event| event["item"]["type"] == "function_call")
            .collect()
    };
    let added = calls_of("response.output_item.added");
    assert_eq!(added.len(), 1, "{events:?}");
    assert_eq!(added[0]["output_index"], 1, "{events:?}");
    let item = &added[0]["item"];
    assert_eq!(item["type"], "function_call", "{events:?}");
    assert_eq!(item["name"], "get_weather", "{events:?}");
    assert_eq!(item["status"], "in_progress", "{events:?}");
    let call_id = item["call_id"].as_str().context("call_id")?;
    assert!(!call_id.is_empty(), "{events:?}");

    let deltas = of_type("response.function_call_arguments.delta");
    assert!(!deltas.is_empty(), "{events:?}");
    assert!(
        deltas.iter().all(|delta| delta["call_id"] == call_id),
        "every argument delta names the call: {events:?}"
    );
    let streamed: String = deltas
        .iter()
        .filter_map(|delta| delta["delta"].as_str())
        .collect();
    let done = of_type("response.function_call_arguments.done");
    assert_eq!(done.len(), 1, "{events:?}");
    assert_eq!(done[0]["arguments"], streamed.as_str(), "{events:?}");
    assert_eq!(
        serde_json::from_str::<Value>(&streamed)?,
        expected_arguments
    );
    let item_done = calls_of("response.output_item.done");
    assert_eq!(item_done.len(), 1, "{events:?}");
    assert_function_call(&item_done[0]["item"], &expected_arguments);
    assert_eq!(item_done[0]["item"]["call_id"], call_id, "{events:?}");

    let completed = completed_response(&events)?;
    assert_reasoning(completed, &reasoning);
    let output = completed["output"].as_array().context("output")?;
    assert_eq!(output.len(), 2, "{completed}");
    assert_function_call(&output[1], &expected_arguments);
    assert_eq!(output[1]["call_id"], call_id, "{completed}");
    Ok(())
}

/// The weather question's second turn as the OpenAI client gives back a
/// response's output: the reasoning (`reasoning` item), the call the model
/// made (`function_call`, with its item id and status) and the tool's result
/// (`function_call_output`, golden sequence 4's tool message). The endpoint
/// renders the reasoning and the call as one assistant turn, as the reference
/// rendered golden sequence 4 (its 318 prompt tokens), and the model answers
/// with the reference's text and reasoning.
#[test]
fn answers_after_a_function_call_output_as_the_reference() -> Result<()> {
    let (fixture, server) = served()?;
    let (reasoning, text) = fixture.reference_answer(4)?;
    let sequence = &fixture.facts["sequences"][4];
    let messages = sequence["messages"].as_array().context("messages")?;
    let call = &messages[1]["tool_calls"][0]["function"];
    let mut request = responses_request(&fixture, 4, false)?;
    request["input"] = json!([
        messages[0],
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": messages[1]["reasoning_content"]}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": call["name"],
            "arguments": serde_json::to_string(&call["arguments"])?,
            "status": "completed",
        },
        {
            "type": "function_call_output",
            "call_id": "call_1",
            "output": messages[2]["content"],
        },
    ]);
    let (status, response) = server.post("/v1/responses", &request)?;
    assert_eq!(status, 200, "{response}");
    assert_eq!(
        response["usage"]["input_tokens"], sequence["len"],
        "{response}"
    );
    assert_answer(&response, &reasoning, &text);
    Ok(())
}

/// A conversation's next turn with the earlier answer as a response's message
/// item gives it back (`output_text` parts, an item id and status): the
/// endpoint renders it as the chat completions endpoint renders the same
/// conversation (as many prompt tokens) and answers as it does.
#[test]
fn continues_a_conversation_from_an_answer_given_back_as_its_message_item() -> Result<()> {
    let (fixture, server) = served()?;
    let greeting = &fixture.facts["sequences"][1]["messages"][0];
    let question = &fixture.facts["sequences"][0]["messages"][0];
    let (_, answer) = fixture.reference_answer(1)?;
    let request = json!({
        "model": "default",
        "temperature": 0.0,
        "max_output_tokens": 64,
        "input": [
            greeting,
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": answer, "annotations": []}],
            },
            question,
        ],
    });
    let (status, response) = server.post("/v1/responses", &request)?;
    assert_eq!(status, 200, "{response}");

    let chat = json!({
        "model": "default",
        "temperature": 0.0,
        "max_tokens": 64,
        "messages": [greeting, {"role": "assistant", "content": answer}, question],
    });
    let (status, expected) = server.post("/v1/chat/completions", &chat)?;
    assert_eq!(status, 200, "{expected}");
    assert_eq!(
        response["usage"]["input_tokens"], expected["usage"]["prompt_tokens"],
        "{response}\n{expected}"
    );
    let message = &expected["choices"][0]["message"];
    assert_answer(
        &response,
        text_of(&message["reasoning_content"]),
        text_of(&message["content"]),
    );
    Ok(())
}

/// The weather question in two turns as a client of the Responses API makes
/// them: the first streamed, its completed response's output given back as it
/// came (the reasoning item, the call) with the tool's output. The endpoint
/// renders the conversation as the chat completions endpoint renders the same
/// turns (as many prompt tokens), and the model answers as the reference.
#[test]
fn continues_after_a_call_from_a_streamed_response_given_back_whole() -> Result<()> {
    let (fixture, server) = served()?;
    let sequence = &fixture.facts["sequences"][4];
    let messages = sequence["messages"].as_array().context("messages")?;
    let (reasoning, text) = fixture.reference_answer(4)?;
    let mut first = responses_request(&fixture, 4, true)?;
    first["input"] = json!([messages[0]]);
    let output = responses_answer(&server, &first)?["output"]
        .as_array()
        .cloned()
        .context("output")?;
    assert_eq!(output.len(), 2, "{output:?}");
    let call_id = output[1]["call_id"].clone();

    let mut second = responses_request(&fixture, 4, false)?;
    let mut input = vec![messages[0].clone()];
    input.extend(output.iter().cloned());
    input.push(json!({
        "type": "function_call_output",
        "call_id": call_id,
        "output": messages[2]["content"],
    }));
    second["input"] = Value::Array(input);
    let (status, response) = server.post("/v1/responses", &second)?;
    assert_eq!(status, 200, "{response}");
    assert_answer(&response, &reasoning, &text);

    let chat = json!({
        "model": "default",
        "temperature": 0.0,
        "max_tokens": 128,
        "tools": second["tools"],
        "messages": [
            messages[0],
            {
                "role": "assistant",
                "reasoning_content": output[0]["content"][0]["text"],
                "content": "",
                "tool_calls": [{
                    "id": call_id,
                    "type": "function",
                    "function": {"name": output[1]["name"], "arguments": output[1]["arguments"]},
                }],
            },
            {"role": "tool", "tool_call_id": call_id, "content": messages[2]["content"]},
        ],
    });
    let (status, expected) = server.post("/v1/chat/completions", &chat)?;
    assert_eq!(status, 200, "{expected}");
    assert_eq!(
        response["usage"]["input_tokens"], expected["usage"]["prompt_tokens"],
        "{response}\n{expected}"
    );
    Ok(())
}

/// The weather question's second turn through the server's own store
/// (`previous_response_id`, the input only the tool's output): the stored
/// history holds the first answer's reasoning and call as its output gives
/// them back, so the prompt is the one of the same turns given back whole
/// (as many tokens), and the model answers as the reference. mistral.rs 0.8.1
/// stored an answer's text only: a call's turn was left out of the history.
#[test]
fn continues_after_a_call_from_a_stored_response() -> Result<()> {
    let (fixture, server) = served()?;
    let sequence = &fixture.facts["sequences"][4];
    let messages = sequence["messages"].as_array().context("messages")?;
    let (reasoning, text) = fixture.reference_answer(4)?;
    for stream in [false, true] {
        let mut first = responses_request(&fixture, 4, stream)?;
        first["input"] = json!([messages[0]]);
        first["store"] = json!(true);
        let answer = responses_answer(&server, &first)?;
        let output = answer["output"].as_array().context("output")?;
        let tool_output = json!({
            "type": "function_call_output",
            "call_id": output.last().context("no output")?["call_id"],
            "output": messages[2]["content"],
        });

        let mut stored = responses_request(&fixture, 4, false)?;
        stored["previous_response_id"] = answer["id"].clone();
        stored["input"] = json!([tool_output]);
        let (status, response) = server.post("/v1/responses", &stored)?;
        assert_eq!(status, 200, "{response}");
        assert_answer(&response, &reasoning, &text);

        let mut whole = responses_request(&fixture, 4, false)?;
        let mut input = vec![messages[0].clone()];
        input.extend(output.iter().cloned());
        input.push(tool_output);
        whole["input"] = Value::Array(input);
        let (status, expected) = server.post("/v1/responses", &whole)?;
        assert_eq!(status, 200, "{expected}");
        assert_eq!(
            response["usage"]["input_tokens"], expected["usage"]["input_tokens"],
            "stream {stream}: {response}\n{expected}"
        );
    }
    Ok(())
}

/// `tool_choice` naming a function in the Responses API's shape
/// (`{"type": "function", "name"}`, as OpenAI's clients send it) forces a
/// call to it as the chat completions' shape does, whole and streamed; a
/// parameter the server cannot honour (`max_tool_calls`) is refused with a
/// 422 naming it.
#[test]
fn a_named_tool_choice_in_the_responses_shape_forces_its_call() -> Result<()> {
    let (fixture, server) = served()?;
    for stream in [false, true] {
        let mut request = responses_request(&fixture, 1, stream)?;
        request["tools"] = fixture.facts["sequences"][2]["tools"].clone();
        request["tool_choice"] = json!({"type": "function", "name": "get_time"});
        let response = responses_answer(&server, &request)?;
        let calls = function_call_items(&response);
        assert_eq!(calls.len(), 1, "{response}");
        assert_eq!(calls[0]["name"], "get_time", "{response}");
    }

    let mut request = responses_request(&fixture, 1, false)?;
    request["max_tool_calls"] = json!(1);
    server.assert_unprocessable("/v1/responses", &request, "max_tool_calls")?;
    Ok(())
}

/// A `previous_response_id` the server does not hold is refused with a 422
/// naming it (mistral.rs 0.8.1 answered without the history), and the server
/// holds the last 1,024 stored responses: the first of 1,025 is forgotten, the
/// last continues its conversation. (0.8.1 kept every stored response and its
/// history for as long as it ran.)
#[test]
fn stored_responses_are_bounded_and_an_unknown_one_is_refused() -> Result<()> {
    let (fixture, server) = served()?;
    let mut request = responses_request(&fixture, 1, false)?;
    request["max_output_tokens"] = json!(1);
    request["store"] = json!(true);
    let mut ids = Vec::new();
    for _ in 0..1025 {
        let (status, response) = server.post("/v1/responses", &request)?;
        assert_eq!(status, 200, "{response}");
        ids.push(response["id"].as_str().context("id")?.to_string());
    }
    for (id, expected) in [
        (ids[0].as_str(), 422),
        (ids[1024].as_str(), 200),
        ("resp_unknown", 422),
    ] {
        let mut next = responses_request(&fixture, 0, false)?;
        next["previous_response_id"] = json!(id);
        next["max_output_tokens"] = json!(1);
        let (status, body) = server.post_raw("/v1/responses", &next.to_string())?;
        assert_eq!(status, expected, "{id}: {body}");
        if expected == 422 {
            assert!(
                body.contains("previous_response_id") && body.contains(id),
                "{body}"
            );
        }
    }
    Ok(())
}

/// A tool in either shape that lacks its function's name is refused with a
/// 422 naming the field, and the server answers the next request.
#[test]
fn a_tool_without_a_name_is_refused_naming_it() -> Result<()> {
    let (fixture, server) = served()?;
    let parameters = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    for tool in [
        json!({"type": "function", "parameters": parameters}),
        json!({"type": "function", "function": {"parameters": parameters}}),
    ] {
        let mut request = responses_request(&fixture, 2, false)?;
        request["tools"] = json!([tool]);
        server.assert_unprocessable("/v1/responses", &request, "missing field `name`")?;
    }
    let (status, response) =
        server.post("/v1/responses", &responses_request(&fixture, 0, false)?)?;
    assert_eq!(status, 200, "{response}");
    Ok(())
}

/// A response whose reasoning and text are the reference's.
fn assert_answer(response: &Value, reasoning: &str, text: &str) {
    assert_reasoning(response, reasoning);
    assert_eq!(text_of(&response["output_text"]), text, "{response}");
}

/// A response whose reasoning is `reasoning`: in `reasoning` and as its first
/// output item, a completed `reasoning` item of one `reasoning_text` part.
fn assert_reasoning(response: &Value, reasoning: &str) {
    assert_eq!(text_of(&response["reasoning"]), reasoning, "{response}");
    let item = &response["output"][0];
    assert_eq!(item["type"], "reasoning", "{response}");
    assert_eq!(item["status"], "completed", "{response}");
    assert!(
        item["id"].as_str().is_some_and(|id| id.starts_with("rs_")),
        "{response}"
    );
    assert_eq!(item["content"][0]["type"], "reasoning_text", "{response}");
    assert_eq!(
        text_of(&item["content"][0]["text"]),
        reasoning,
        "{response}"
    );
}

/// The `response` of a stream's last event, `response.completed`.
fn completed_response(events: &[Value]) -> Result<&Value> {
    let last = events.last().context("no event streamed")?;
    anyhow::ensure!(
        last["type"] == "response.completed",
        "the stream ends with {last}"
    );
    Ok(&last["response"])
}

/// A completed `function_call` item calling `get_weather` with `arguments`.
fn assert_function_call(item: &Value, arguments: &Value) {
    assert_eq!(item["type"], "function_call", "{item}");
    assert_eq!(item["name"], "get_weather", "{item}");
    assert_eq!(item["status"], "completed", "{item}");
    assert!(
        item["call_id"].as_str().is_some_and(|id| !id.is_empty()),
        "{item}"
    );
    let parsed: Value = item["arguments"]
        .as_str()
        .and_then(|text| serde_json::from_str(text).ok())
        .unwrap_or(Value::Null);
    assert_eq!(&parsed, arguments, "{item}");
}
