//! The host CLI built with the `berrylm` feature serves the bundled trained
//! model through the OpenAI API (`mistralrs serve -m DIR`).

use anyhow::Result;
use berrylm_tests::chat::{
    assert_golden_weather_call, chat_answers, golden_chat_request, reasoning,
};
use berrylm_tests::server::Server;
use berrylm_tests::{fixtures_dir, Fixture};

#[test]
fn serves_the_bundled_model_and_answers_like_the_reference() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;

    let (status, models) = server.get("/v1/models")?;
    assert_eq!(status, 200, "{models}");
    let listed = models["data"].as_array().map(Vec::len).unwrap_or(0);
    assert!(listed >= 1, "no model listed: {models}");
    // Each listed model by its id (which may hold slashes), and an id no model has.
    for model in models["data"].as_array().into_iter().flatten() {
        let id = model["id"].as_str().unwrap_or_default();
        let (status, retrieved) = server.get(&format!("/v1/models/{id}"))?;
        assert_eq!((status, &retrieved), (200, model), "GET /v1/models/{id}");
    }
    let (status, missing) = server.get("/v1/models/no-such-model")?;
    assert_eq!(status, 404, "{missing}");
    let message = missing["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("no-such-model"), "{missing}");

    // "What is 7 + 5?" (golden sequence 0): the reference's greedy completion is
    // "7 plus 5 is 13.\n</think>\n\n7 + 5 = 13.<|im_end|>".
    let sequence = &fixture.facts["sequences"][0];
    let request = serde_json::json!({
        "model": "default",
        "messages": sequence["messages"],
        "temperature": 0.0,
        "max_tokens": 64,
    });
    let (status, response) = server.post("/v1/chat/completions", &request)?;
    assert_eq!(status, 200, "{response}");
    let message = &response["choices"][0]["message"];
    let (reasoning, content) = fixture.reference_answer(0)?;
    assert_eq!(
        message["reasoning_content"].as_str().map(str::trim),
        Some(reasoning.as_str()),
        "{response}"
    );
    assert_eq!(
        message["content"].as_str().map(str::trim),
        Some(content.as_str()),
        "{response}"
    );
    Ok(())
}

/// A request for several choices (`n`) runs each as a sequence of its own,
/// with a recurrent state of its own: decoded greedily, every choice is the
/// reference's answer (the weather question's reasoning and call, the
/// greeting's reasoning and reply), streamed and not; whole, the choices are
/// in the order of their indices and the usage counts all of them.
#[test]
fn every_choice_of_a_request_for_several_is_the_reference_answer() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    for stream in [false, true] {
        let mut weather = golden_chat_request(&fixture.facts["sequences"][2], 96, stream)?;
        weather["n"] = serde_json::json!(3);
        let answers = chat_answers(&server, &weather)?;
        assert_eq!(answers.len(), 3, "{answers:?}");
        let (expected_reasoning, _) = fixture.reference_answer(2)?;
        for (message, finish_reason) in &answers {
            assert_eq!(
                reasoning(message),
                Some(expected_reasoning.as_str()),
                "{message}"
            );
            assert_golden_weather_call(message, finish_reason);
        }

        let mut greeting = golden_chat_request(&fixture.facts["sequences"][1], 96, stream)?;
        greeting["n"] = serde_json::json!(2);
        let answers = chat_answers(&server, &greeting)?;
        assert_eq!(answers.len(), 2, "{answers:?}");
        let (expected_reasoning, expected_content) = fixture.reference_answer(1)?;
        for (message, finish_reason) in &answers {
            assert_eq!(finish_reason, "stop", "{message}");
            assert_eq!(
                reasoning(message),
                Some(expected_reasoning.as_str()),
                "{message}"
            );
            assert_eq!(
                message["content"].as_str().map(str::trim),
                Some(expected_content.as_str()),
                "{message}"
            );
        }
    }

    // Whole, the usage counts every choice's generated tokens (three greedy
    // choices: three times the one answer's), and the choices come in the
    // order of their indices, whichever finishes first (sampled, they end at
    // different steps).
    let weather = golden_chat_request(&fixture.facts["sequences"][2], 96, false)?;
    let (status, one) = server.post("/v1/chat/completions", &weather)?;
    assert_eq!(status, 200, "{one}");
    let mut three = weather.clone();
    three["n"] = serde_json::json!(3);
    let (status, response) = server.post("/v1/chat/completions", &three)?;
    assert_eq!(status, 200, "{response}");
    let tokens = |response: &serde_json::Value, field: &str| response["usage"][field].as_u64();
    assert_eq!(
        tokens(&response, "completion_tokens"),
        tokens(&one, "completion_tokens").map(|one| 3 * one),
        "{response}\n{one}"
    );
    assert_eq!(
        tokens(&response, "prompt_tokens"),
        tokens(&one, "prompt_tokens"),
        "{response}"
    );
    for _ in 0..8 {
        let sampled = serde_json::json!({
            "model": "default",
            "messages": [{"role": "user", "content": "What is 17 + 25?"}],
            "temperature": 1.5,
            "max_tokens": 40,
            "n": 4,
        });
        let (status, response) = server.post("/v1/chat/completions", &sampled)?;
        assert_eq!(status, 200, "{response}");
        let indices: Vec<u64> = response["choices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|choice| choice["index"].as_u64())
            .collect();
        assert_eq!(indices, [0, 1, 2, 3], "{response}");
    }
    Ok(())
}

/// A config with `model_type: berrylm` and no `architectures` (which the host's
/// own detection rejects) is served through the registry.
#[test]
fn serves_a_checkpoint_identified_by_model_type_alone() -> Result<()> {
    let source = fixtures_dir().join("small-hybrid/model");
    let dir = std::env::temp_dir().join(format!("berrylm-model-type-only-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for entry in std::fs::read_dir(&source)? {
        let path = entry?.path();
        if let Some(name) = path.file_name() {
            std::fs::copy(&path, dir.join(name))?;
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("config.json"))?)?;
    if let Some(object) = config.as_object_mut() {
        object.remove("architectures");
    }
    std::fs::write(dir.join("config.json"), config.to_string())?;
    let server = Server::start(&dir, &["--dtype", "f32"])?;
    let request = serde_json::json!({
        "model": "default",
        "prompt": "Hello",
        "temperature": 0.0,
        "max_tokens": 4,
    });
    let (status, response) = server.post("/v1/completions", &request)?;
    assert_eq!(status, 200, "{response}");
    assert!(response["choices"][0]["text"].is_string(), "{response}");
    drop(server);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// A streamed completion ends with its usage, as a streamed chat completion
/// does (mistral.rs 0.8.1 sent none): the golden prompt's token count and the
/// tokens of the same request answered whole.
#[test]
fn a_streamed_completion_reports_its_usage_on_its_last_chunk() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let sequence = &fixture.facts["sequences"][0];
    let mut request = serde_json::json!({
        "model": "default",
        "prompt": sequence["rendered_prompt"],
        "temperature": 0.0,
        "max_tokens": 64,
    });
    let (status, whole) = server.post("/v1/completions", &request)?;
    assert_eq!(status, 200, "{whole}");
    request["stream"] = serde_json::json!(true);
    let (status, events) = server.post_stream("/v1/completions", &request)?;
    assert_eq!(status, 200, "{events:?}");
    let streamed: String = events
        .iter()
        .filter_map(|event| event["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(
        Some(streamed.as_str()),
        whole["choices"][0]["text"].as_str()
    );
    let last = events.last().expect("no chunk streamed");
    assert_eq!(last["usage"]["prompt_tokens"], sequence["len"], "{last}");
    assert_eq!(
        last["usage"]["completion_tokens"], whole["usage"]["completion_tokens"],
        "{last}"
    );
    assert!(
        events[..events.len() - 1]
            .iter()
            .all(|event| event["usage"].is_null()),
        "usage before the last chunk: {events:?}"
    );
    Ok(())
}

/// A greedy `/v1/completions` request of `prompt` (text, token ids or a list
/// of either) for the reference's 64-token completions.
fn greedy_completion(prompt: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "model": "default",
        "prompt": prompt,
        "temperature": 0.0,
        "max_tokens": 64,
    })
}

/// `/v1/completions` takes its prompt as token ids too (OpenAI's `prompt`
/// does; evaluation harnesses such as lm-evaluation-harness send them):
/// golden sequence 0's ids as the reference tokenized its prompt give the
/// reference's greedy completion, counted as that many prompt tokens. `echo`
/// (which needs the prompt's text) with token ids is refused naming it.
#[test]
fn a_completion_of_a_prompt_given_as_token_ids_is_the_reference_answer() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let ids = fixture.ids("seq0.input_ids")?;
    let expected = fixture.reference_completion(0)?;
    let request = greedy_completion(serde_json::json!(ids));
    let (status, response) = server.post("/v1/completions", &request)?;
    assert_eq!(status, 200, "{response}");
    assert_eq!(
        response["choices"][0]["text"].as_str(),
        Some(expected),
        "{response}"
    );
    assert_eq!(
        response["usage"]["prompt_tokens"].as_u64(),
        Some(ids.len() as u64),
        "{response}"
    );

    let mut echoed = request.clone();
    echoed["echo"] = serde_json::json!(true);
    server.assert_unprocessable("/v1/completions", &echoed, "`echo`")?;
    Ok(())
}

/// `/v1/completions` takes a list of prompts, as texts or as token ids:
/// golden sequences 0 and 1 (their rendered prompts, or their ids as the
/// reference tokenized them) get each the reference's greedy completion at its
/// prompt's index, and the usage counts both prompts' tokens. A streamed list
/// is refused, naming what to do instead.
#[test]
fn a_list_of_completion_prompts_gets_each_prompts_reference_answer() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let sequences = [0, 1];
    let expected = sequences
        .iter()
        .map(|&index| fixture.reference_completion(index))
        .collect::<Result<Vec<_>>>()?;
    let texts: Vec<&str> = sequences
        .iter()
        .filter_map(|&index| fixture.facts["sequences"][index]["rendered_prompt"].as_str())
        .collect();
    let ids = sequences
        .iter()
        .map(|&index| fixture.ids(&format!("seq{index}.input_ids")))
        .collect::<Result<Vec<_>>>()?;
    let prompt_tokens: usize = ids.iter().map(Vec::len).sum();
    for prompt in [serde_json::json!(texts), serde_json::json!(ids)] {
        let request = greedy_completion(prompt);
        let (status, response) = server.post("/v1/completions", &request)?;
        assert_eq!(status, 200, "{response}");
        let answers: Vec<(u64, &str)> = response["choices"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|choice| {
                (
                    choice["index"].as_u64().unwrap_or(u64::MAX),
                    choice["text"].as_str().unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(answers, [(0, expected[0]), (1, expected[1])], "{response}");
        assert_eq!(
            response["usage"]["prompt_tokens"].as_u64(),
            Some(prompt_tokens as u64),
            "{response}"
        );

        let mut streamed = request.clone();
        streamed["stream"] = serde_json::json!(true);
        server.assert_unprocessable("/v1/completions", &streamed, "one prompt a request")?;
    }
    Ok(())
}
