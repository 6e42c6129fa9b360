//! Requests built from trained-tiny's golden sequences (messages, tools and
//! `enable_thinking` as transformers rendered them).

use std::collections::BTreeSet;

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};

use crate::server::Server;

/// A greedy chat completion request for a golden sequence, as an OpenAI client
/// sends it: history tool-call arguments are JSON strings on the wire.
pub fn golden_chat_request(sequence: &Value, max_tokens: usize, stream: bool) -> Result<Value> {
    let mut messages = sequence["messages"].clone();
    for message in messages.as_array_mut().context("messages")? {
        for call in message["tool_calls"].as_array_mut().into_iter().flatten() {
            let arguments = &mut call["function"]["arguments"];
            if arguments.is_object() {
                *arguments = Value::String(serde_json::to_string(arguments)?);
            }
        }
    }
    let mut request = json!({
        "model": "default",
        "messages": messages,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "stream": stream,
    });
    if let Some(tools) = sequence["tools"].as_array().filter(|t| !t.is_empty()) {
        request["tools"] = Value::Array(tools.clone());
    }
    if sequence["enable_thinking"] == json!(false) {
        request["enable_thinking"] = json!(false);
    }
    Ok(request)
}

/// The message assembled from streamed chunks: text fields concatenated, tool
/// calls merged by index (id and name from their first delta).
pub fn assemble(chunks: &[Value]) -> (Value, Option<String>) {
    assemble_choice(chunks, 0)
}

/// [`assemble`] for the choice of index `index` of a request for several.
pub fn assemble_choice(chunks: &[Value], index: u64) -> (Value, Option<String>) {
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut calls: Vec<Value> = Vec::new();
    let mut finish_reason = None;
    let choices = chunks
        .iter()
        .flat_map(|chunk| chunk["choices"].as_array().into_iter().flatten())
        .filter(|choice| choice["index"].as_u64().unwrap_or(0) == index);
    for choice in choices {
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish_reason = Some(reason.to_string());
        }
        let delta = &choice["delta"];
        content.push_str(delta["content"].as_str().unwrap_or_default());
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap_or(0) as usize;
            if calls.len() <= index {
                calls.resize(index + 1, json!({"id": "", "name": "", "arguments": ""}));
            }
            let entry = &mut calls[index];
            for (field, source) in [("id", &call["id"]), ("name", &call["function"]["name"])] {
                if entry[field] == json!("") {
                    if let Some(text) = source.as_str() {
                        entry[field] = json!(text);
                    }
                }
            }
            let arguments = entry["arguments"].as_str().unwrap_or_default().to_string()
                + call["function"]["arguments"].as_str().unwrap_or_default();
            entry["arguments"] = json!(arguments);
        }
    }
    let message = json!({
        "content": if content.trim().is_empty() { Value::Null } else { json!(content) },
        "reasoning_content": if reasoning.is_empty() { Value::Null } else { json!(reasoning) },
        "tool_calls": calls,
    });
    (message, finish_reason)
}

/// The assistant message of a chat completion request and its finish reason:
/// assembled from the chunks when streamed ([`assemble`]), else the
/// response's message with its tool calls in the same `{id, name,
/// arguments}` shape (an empty list when it has none).
pub fn chat_answer(server: &Server, body: &Value) -> Result<(Value, String)> {
    let mut answers = chat_answers(server, body)?;
    ensure!(!answers.is_empty(), "no choice in the answer to {body}");
    Ok(answers.swap_remove(0))
}

/// [`chat_answer`] for each choice of a request (`n` of them), in the order
/// of their indices.
pub fn chat_answers(server: &Server, body: &Value) -> Result<Vec<(Value, String)>> {
    const CHAT: &str = "/v1/chat/completions";
    if body["stream"] == json!(true) {
        let (status, chunks) = server.post_stream(CHAT, body)?;
        ensure!(status == 200, "HTTP {status}: {chunks:?}");
        let indices: BTreeSet<u64> = chunks
            .iter()
            .flat_map(|chunk| chunk["choices"].as_array().into_iter().flatten())
            .filter_map(|choice| choice["index"].as_u64())
            .collect();
        return Ok(indices
            .into_iter()
            .map(|index| {
                let (message, finish_reason) = assemble_choice(&chunks, index);
                (message, finish_reason.unwrap_or_default())
            })
            .collect());
    }
    let (status, response) = server.post(CHAT, body)?;
    ensure!(status == 200, "HTTP {status}: {response}");
    let mut choices = response["choices"].as_array().cloned().unwrap_or_default();
    choices.sort_by_key(|choice| choice["index"].as_u64());
    choices
        .iter()
        .map(|choice| {
            let mut message = choice["message"].clone();
            let calls = message["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|call| {
                    ensure!(call["type"] == json!("function"), "{response}");
                    Ok(json!({
                        "id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"],
                    }))
                })
                .collect::<Result<Vec<_>>>()?;
            message["tool_calls"] = Value::Array(calls);
            let finish_reason = choice["finish_reason"].as_str().unwrap_or_default();
            Ok((message, finish_reason.to_string()))
        })
        .collect()
}

/// A tool call's JSON-string `arguments` parsed (null when not JSON).
pub fn arguments(call_arguments: &Value) -> Value {
    serde_json::from_str(call_arguments.as_str().unwrap_or("null")).unwrap_or(Value::Null)
}

/// An answer of [`chat_answer`] as two runs of one model must agree on: its
/// reasoning, content, tool calls with their arguments parsed (call ids are
/// random) and finish reason.
pub fn comparable(message: &Value, finish_reason: &str) -> Value {
    let calls: Vec<Value> = message["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|call| json!({"name": call["name"], "arguments": arguments(&call["arguments"])}))
        .collect();
    json!({
        "reasoning_content": message["reasoning_content"],
        "content": message["content"],
        "tool_calls": calls,
        "finish_reason": finish_reason,
    })
}

/// An assistant message's `reasoning_content`, trimmed (`None` when it has
/// none).
pub fn reasoning(message: &Value) -> Option<&str> {
    message["reasoning_content"].as_str().map(str::trim)
}

/// Asserts that `call`, in [`chat_answer`]'s `{id, name, arguments}` shape,
/// calls `name` with `expected` arguments.
pub fn assert_call(call: &Value, name: &str, expected: &Value, context: &str) {
    assert_eq!(call["name"], json!(name), "{context}");
    assert_eq!(arguments(&call["arguments"]), *expected, "{context}");
}

/// The assistant message of a non-streamed response that must end in tool
/// calls after the given reasoning (checked: HTTP 200, `finish_reason`
/// `tool_calls`, the trimmed `reasoning_content`).
pub fn tool_call_message<'a>(
    status: u16,
    response: &'a Value,
    expected_reasoning: &str,
) -> &'a Value {
    assert_eq!(status, 200, "{response}");
    let choice = &response["choices"][0];
    assert_eq!(choice["finish_reason"], json!("tool_calls"), "{response}");
    let message = &choice["message"];
    assert_eq!(reasoning(message), Some(expected_reasoning), "{response}");
    message
}

/// Checks an assistant message in [`chat_answer`]'s shape (or [`assemble`]'s)
/// against the model's answer to the golden weather question: a call to
/// `get_weather` with `{"city": "Oslo"}`, ending the turn.
pub fn assert_golden_weather_call(message: &Value, finish_reason: &str) {
    let context = message.to_string();
    assert_eq!(finish_reason, "tool_calls", "{context}");
    let expected = json!({"city": "Oslo"});
    assert_call(
        &message["tool_calls"][0],
        "get_weather",
        &expected,
        &context,
    );
}

/// The chosen tokens of a non-streamed greedy chat completion request with
/// their log-probabilities and the three most likely alternatives at each
/// (`choices[0].logprobs.content`).
pub fn chosen_logprobs(server: &Server, body: &Value) -> Result<Value> {
    let mut request = body.clone();
    request["stream"] = json!(false);
    request["logprobs"] = json!(true);
    request["top_logprobs"] = json!(3);
    let (status, response) = server.post("/v1/chat/completions", &request)?;
    ensure!(status == 200, "HTTP {status}: {response}");
    let content = &response["choices"][0]["logprobs"]["content"];
    ensure!(
        content.as_array().is_some_and(|tokens| !tokens.is_empty()),
        "no logprobs: {response}"
    );
    Ok(content.clone())
}

/// Asserts that two answers' [`chosen_logprobs`] have the same tokens up to
/// a near-tie: where they part, `want`'s two most likely tokens are within
/// twice the reference's own bf16 noise of each other
/// ([`crate::REFERENCE_BF16_MEAN_ABS_LOGPROB`]) and `got` chose the second
/// (bf16 sums in two orders move such a tie either way); without a parting,
/// the same length.
pub fn assert_same_tokens_up_to_a_near_tie(want: &Value, got: &Value) -> Result<()> {
    let (want, got) = (
        want.as_array().context("logprobs")?,
        got.as_array().context("logprobs")?,
    );
    let Some(part) = want
        .iter()
        .zip(got)
        .position(|(a, b)| a["token"] != b["token"])
    else {
        assert_eq!(want.len(), got.len(), "{want:?}\n{got:?}");
        return Ok(());
    };
    let alternatives = &want[part]["top_logprobs"];
    let margin = alternatives[0]["logprob"].as_f64().unwrap_or(f64::NAN)
        - alternatives[1]["logprob"].as_f64().unwrap_or(f64::NAN);
    assert!(
        margin <= 2.0 * crate::REFERENCE_BF16_MEAN_ABS_LOGPROB,
        "the answers part at token {part} where the first's top two are {margin} apart: \
         {alternatives}\n{got:?}"
    );
    assert_eq!(
        got[part]["token"], alternatives[1]["token"],
        "the second answer's token where the answers part"
    );
    Ok(())
}

/// The assistant message of a greedy chat completion (48 tokens at most) of
/// `messages`.
pub fn greedy_chat_message(server: &Server, messages: &Value) -> Result<Value> {
    let request = json!({
        "model": "default",
        "messages": messages,
        "temperature": 0.0,
        "max_tokens": 48,
    });
    let (status, response) = server.post("/v1/chat/completions", &request)?;
    ensure!(status == 200, "HTTP {status}: {response}");
    Ok(response["choices"][0]["message"].clone())
}

/// A conversation extending a finished one: the user's `question`, the
/// `answer` sent back as a client sends it (without the separators the
/// template puts around reasoning and content), then the user's `next`.
pub fn follow_up_messages(question: &str, answer: &Value, next: &str) -> Value {
    json!([
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "reasoning_content": answer["reasoning_content"].as_str().unwrap_or_default().trim(),
            "content": answer["content"].as_str().unwrap_or_default().trim(),
        },
        {"role": "user", "content": next},
    ])
}

/// The response to a Responses API request (`POST /v1/responses`), which must
/// succeed: the body, or when streamed the response of its last event,
/// `response.completed`.
pub fn responses_answer(server: &Server, body: &Value) -> Result<Value> {
    const RESPONSES: &str = "/v1/responses";
    if body["stream"] == json!(true) {
        let (status, events) = server.post_stream(RESPONSES, body)?;
        ensure!(status == 200, "HTTP {status}: {events:?}");
        let last = events.last().context("no event streamed")?;
        ensure!(
            last["type"] == "response.completed",
            "the stream ends with {last}"
        );
        return Ok(last["response"].clone());
    }
    let (status, response) = server.post(RESPONSES, body)?;
    ensure!(status == 200, "HTTP {status}: {response}");
    Ok(response)
}

/// The `function_call` items of a Responses API response's output, in order.
pub fn function_call_items(response: &Value) -> Vec<&Value> {
    response["output"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|item| item["type"] == "function_call")
        .collect()
}
