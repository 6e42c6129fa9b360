//! Model errors through the real server, provoked for real: a checkpoint
//! whose tokenizer holds more ids than its embedding table, a checkpoint with
//! a corrupt (NaN) embedding row, and, on a GPU, device errors injected under
//! the driver (`tools/cuda_fault_shim.c`, preloaded into the server by
//! `tools/gpu-suite.sh model-errors`; nothing in the server's own code path).
//!
//! Each failure reaches only the requests it concerns, as an OpenAI error
//! object (`{"error": {"message", "type", ...}}`: a 4xx for the request's
//! fault, a 5xx or a stream's last event for the model's), frees what those
//! requests held, and the server serves on with unchanged answers; a sticky
//! device error ends the server with status 70 after answering.

use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use berrylm_tests::metrics::{finished_for, KV_BLOCKS_IN_USE, RUNNING, SLOTS_IN_USE, WAITING};
use berrylm_tests::server::Server;
use berrylm_tests::Fixture;
use candle_core::{DType, Device, Tensor};

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

/// The bundled model's token `~`, which the good prompts below never contain.
const TILDE: usize = 102;

/// A copy of the bundled model in a fresh folder, for a test to break.
fn bundled_model_copy(name: &str) -> Result<PathBuf> {
    let fixture = Fixture::load("trained-tiny")?;
    let dir = std::env::temp_dir().join(format!("berrylm-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for entry in std::fs::read_dir(&fixture.model_dir)? {
        let entry = entry?;
        std::fs::copy(entry.path(), dir.join(entry.file_name()))?;
    }
    Ok(dir)
}

fn completion(
    prompt: &str,
    max_tokens: usize,
    temperature: f64,
    stream: bool,
) -> serde_json::Value {
    serde_json::json!({
        "model": "default", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": temperature, "stream": stream,
    })
}

fn chat(content: &str, temperature: f64, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "default", "max_tokens": 24, "temperature": temperature, "stream": stream,
        "messages": [{"role": "user", "content": content}],
    })
}

/// Greedy completions of these prompts never meet the broken parts.
const GOOD_PROMPTS: [&str; 4] = ["1 2 3", "4 5 6 7", "8 9", "3 1 4 1 5"];

fn good_answers(server: &Server) -> Result<Vec<String>> {
    GOOD_PROMPTS
        .iter()
        .map(|prompt| server.complete(prompt, 16))
        .collect()
}

/// What a request returned: its status and body (a streamed request's events).
enum Answer {
    Whole(u16, serde_json::Value),
    Streamed(u16, Vec<serde_json::Value>),
}

fn send(server: &Server, path: &str, body: &serde_json::Value) -> Result<Answer> {
    if body["stream"] == true {
        let (status, events) = server.post_stream(path, body)?;
        Ok(Answer::Streamed(status, events))
    } else {
        let (status, response) = server.post(path, body)?;
        Ok(Answer::Whole(status, response))
    }
}

/// The OpenAI error object a failed request carries: a whole response's
/// body with `status_range`, or a stream's last event.
fn error_object(answer: &Answer, status_range: std::ops::Range<u16>) -> Result<&serde_json::Value> {
    let (status, body) = match answer {
        Answer::Whole(status, body) => (*status, body),
        Answer::Streamed(status, events) => (
            *status,
            events.last().context("a failed stream without events")?,
        ),
    };
    if let Answer::Whole(..) = answer {
        ensure!(
            status_range.contains(&status),
            "HTTP {status}, expected {status_range:?}: {body}"
        );
    }
    let error = &body["error"];
    ensure!(
        error["message"].is_string() && error["type"].is_string(),
        "HTTP {status} without an OpenAI error object: {body}"
    );
    Ok(error)
}

fn metrics_value(server: &Server, name: &str) -> Result<Option<f64>> {
    Ok(server.metrics()?.get(name).copied())
}

/// Polls `/metrics` until nothing runs or waits and every recurrent slot and
/// KV block (where paged) is free again.
fn assert_everything_freed(server: &Server) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let metrics = server.metrics()?;
        let busy: Vec<(&str, f64)> = [RUNNING, WAITING, SLOTS_IN_USE, KV_BLOCKS_IN_USE]
            .into_iter()
            .filter_map(|name| Some((name, *metrics.get(name)?)))
            .filter(|(_, value)| *value != 0.0)
            .collect();
        if busy.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("still in use a minute after the failure: {busy:?}");
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// A prompt holding an id the embedding table does not have (the tokenizer
/// was given two tokens more than the model's 2048) is refused with a 4xx
/// naming the id and the table's size, streamed or not, on both endpoints,
/// before any kernel runs; requests in flight meanwhile keep their answers.
#[test]
fn a_prompt_token_beyond_the_embedding_table_is_refused_before_the_forward() -> Result<()> {
    let dir = bundled_model_copy("token-beyond-table")?;
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let vocab = config["vocab_size"].as_u64().context("vocab_size")?;
    let tokenizer_path = dir.join("tokenizer.json");
    let mut tokenizer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tokenizer_path)?)?;
    let added = tokenizer["added_tokens"]
        .as_array_mut()
        .context("added_tokens")?;
    for (id, content) in [(vocab, "<|beyond|>"), (vocab + 1, "<|far-beyond|>")] {
        added.push(serde_json::json!({
            "id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": false,
        }));
    }
    std::fs::write(&tokenizer_path, tokenizer.to_string())?;

    let server = Server::start(&dir, &["--dtype", "f32"])?;
    let alone = good_answers(&server)?;
    let prompt = "1 2 <|far-beyond|> 3";
    let names = [(vocab + 1).to_string(), vocab.to_string()];
    let bad_requests = [false, true].into_iter().flat_map(|stream| {
        [
            (COMPLETIONS, completion(prompt, 8, 0.0, stream)),
            (CHAT, chat(prompt, 0.0, stream)),
        ]
    });
    let (in_flight, refusals) = thread::scope(|scope| {
        let server = &server;
        let in_flight = scope.spawn(move || good_answers(server));
        let refusals: Vec<_> = bad_requests
            .map(|(path, body)| {
                (
                    path,
                    body["stream"].clone(),
                    server.post_raw(path, &body.to_string()),
                )
            })
            .collect();
        (
            in_flight
                .join()
                .expect("the good requests' thread panicked"),
            refusals,
        )
    });
    for (path, stream, refusal) in refusals {
        let (status, text) = refusal?;
        assert!(
            (400..500).contains(&status),
            "{path}, stream {stream}: expected a 4xx, got {status}: {text}"
        );
        for name in &names {
            assert!(
                text.contains(name.as_str()),
                "{path}, stream {stream}: {text}"
            );
        }
        let body: serde_json::Value = serde_json::from_str(&text)?;
        assert_eq!(body["error"]["type"], "invalid_request_error", "{text}");
    }
    assert_eq!(
        in_flight?, alone,
        "answers changed while the bad prompts were refused"
    );
    assert_everything_freed(&server)?;
    assert_eq!(good_answers(&server)?, alone);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// A checkpoint whose embedding row of `~` is NaN: a sampled request whose
/// prompt holds `~` gets NaN logits, which the sampler refuses. Only those
/// requests fail (a 5xx with an OpenAI error object, or an error event
/// ending the stream), the others running beside them keep their answers,
/// the failed sequences' slots and blocks are freed, and the next requests
/// (reusing those slots) answer as before.
#[test]
fn a_sequence_whose_logits_are_not_finite_fails_alone_and_frees_its_slot() -> Result<()> {
    let dir = bundled_model_copy("nan-embedding-row")?;
    corrupt_embedding_row(&dir, TILDE)?;

    let server = Server::start(&dir, &["--dtype", "f32"])?;
    let alone = good_answers(&server)?;
    let failed_before = finished_with_error(&server)?;
    let bad_prompt = "the tilde ~ is a sign";
    let bad_requests = [
        (COMPLETIONS, completion(bad_prompt, 8, 1.0, false)),
        (COMPLETIONS, completion(bad_prompt, 8, 1.0, true)),
        (CHAT, chat(bad_prompt, 1.0, false)),
        (CHAT, chat(bad_prompt, 1.0, true)),
    ];
    let (good, bad) = thread::scope(|scope| {
        let server = &server;
        let good: Vec<_> = GOOD_PROMPTS
            .iter()
            .map(|prompt| scope.spawn(move || server.complete(prompt, 16)))
            .collect();
        let bad: Vec<_> = bad_requests
            .iter()
            .map(|(path, body)| scope.spawn(move || send(server, path, body)))
            .collect();
        (
            good.into_iter()
                .map(joined)
                .collect::<Result<Vec<String>>>(),
            bad.into_iter().map(joined).collect::<Result<Vec<Answer>>>(),
        )
    });
    for ((path, body), answer) in bad_requests.iter().zip(bad?) {
        let error = error_object(&answer, 500..600)
            .with_context(|| format!("{path}, stream {}", body["stream"]))?;
        assert_eq!(error["type"], "server_error", "{error}");
        assert!(
            error["message"]
                .as_str()
                .unwrap_or_default()
                .contains("NaN"),
            "{path}: the error does not say why: {error}"
        );
    }
    assert_eq!(good?, alone, "answers changed beside the failing requests");
    assert_everything_freed(&server)?;
    assert_eq!(
        finished_with_error(&server)? - failed_before,
        bad_requests.len() as f64
    );
    assert_eq!(
        good_answers(&server)?,
        alone,
        "answers changed after the failures"
    );
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

/// What a request thread returned.
fn joined<T>(handle: thread::ScopedJoinHandle<'_, T>) -> T {
    handle.join().expect("a request thread panicked")
}

fn finished_with_error(server: &Server) -> Result<f64> {
    Ok(metrics_value(server, &finished_for("error"))?.unwrap_or(0.0))
}

/// Sets row `row` of the embedding table of the checkpoint in `dir` to NaN.
fn corrupt_embedding_row(dir: &Path, row: usize) -> Result<()> {
    const EMBEDDING: &str = "model.embed_tokens.weight";
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        dir.join("model.safetensors.index.json"),
    )?)?;
    let file = dir.join(
        index["weight_map"][EMBEDDING]
            .as_str()
            .context("the embedding's file")?,
    );
    let mut tensors = candle_core::safetensors::load(&file, &Device::Cpu)?;
    let embedding = tensors.get(EMBEDDING).context("the embedding")?;
    let (rows, width) = embedding.dims2()?;
    let nan_row = Tensor::full(f32::NAN, (1, width), &Device::Cpu)?.to_dtype(embedding.dtype())?;
    let corrupted = Tensor::cat(
        &[
            embedding.narrow(0, 0, row)?,
            nan_row,
            embedding.narrow(0, row + 1, rows - row - 1)?,
        ],
        0,
    )?;
    ensure!(corrupted.to_dtype(DType::F32)?.get(row)?.to_vec1::<f32>()?[0].is_nan());
    tensors.insert(EMBEDDING.to_string(), corrupted);
    candle_core::safetensors::save(&tensors, &file)?;
    Ok(())
}

/// The fault injector and a trigger file it watches; `tools/gpu-suite.sh
/// model-errors` builds it and names it in `BERRYLM_CUDA_FAULT_SHIM`.
struct FaultInjector {
    shim: String,
    trigger: PathBuf,
}

impl FaultInjector {
    fn new(name: &str) -> Result<FaultInjector> {
        let shim = std::env::var("BERRYLM_CUDA_FAULT_SHIM").context(
            "BERRYLM_CUDA_FAULT_SHIM must name the fault injector (tools/cuda_fault_shim.c, \
             built by tools/gpu-suite.sh model-errors)",
        )?;
        let trigger =
            std::env::temp_dir().join(format!("berrylm-fault-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&trigger);
        Ok(FaultInjector { shim, trigger })
    }

    fn start_server(&self) -> Result<Server> {
        let fixture = Fixture::load("trained-tiny")?;
        let trigger = self.trigger.to_str().context("trigger path")?;
        Server::start_with_environment(
            &fixture.model_dir,
            &["--dtype", "f32"],
            &[
                ("LD_PRELOAD", &self.shim),
                ("BERRYLM_FAULT_TRIGGER", trigger),
            ],
        )
    }

    /// Starts two long streams on `server`, then makes the driver fail
    /// (`once`: the next kernel launch, out of memory; `sticky`: every launch
    /// from then on, an illegal address), and asserts that each stream ended
    /// with an OpenAI error object naming `driver_error`.
    fn fail_streams(&self, server: &Server, mode: &str, driver_error: &str) -> Result<()> {
        let answers = thread::scope(|scope| -> Result<Vec<Answer>> {
            let streams = long_streams(scope, server, 2)?;
            std::fs::write(&self.trigger, mode)?;
            streams.into_iter().map(joined).collect()
        })?;
        for answer in &answers {
            let error = error_object(answer, 500..600)?;
            let message = error["message"].as_str().unwrap_or_default();
            ensure!(message.contains(driver_error), "{mode}: {error}");
        }
        Ok(())
    }
}

/// Streams that run for a while (the bundled model continues this prompt for
/// hundreds of tokens), started together; returns once `/metrics` counts
/// them all running.
fn long_streams<'scope>(
    scope: &'scope thread::Scope<'scope, '_>,
    server: &'scope Server,
    count: usize,
) -> Result<Vec<thread::ScopedJoinHandle<'scope, Result<Answer>>>> {
    let body = completion("GNU LESSER GENERAL PUBLIC LICENSE", 1500, 0.0, true);
    let handles: Vec<_> = (0..count)
        .map(|_| {
            let body = body.clone();
            scope.spawn(move || send(server, COMPLETIONS, &body))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics_value(server, RUNNING)?.unwrap_or(0.0) < count as f64 {
        ensure!(
            Instant::now() < deadline,
            "the streams did not start within a minute"
        );
        thread::sleep(Duration::from_millis(50));
    }
    thread::sleep(Duration::from_millis(500));
    Ok(handles)
}

/// A forward step that fails (one kernel launch refused by the driver, as
/// when the device runs out of memory) fails the requests of that step with
/// its error; their slots and blocks are freed and the server answers the
/// next requests as before.
#[test]
#[ignore = "CUDA only: run by tools/gpu-suite.sh model-errors with the fault injector"]
fn a_failed_forward_step_fails_its_requests_and_the_server_serves_on() -> Result<()> {
    let injector = FaultInjector::new("once")?;
    let server = injector.start_server()?;
    let alone = good_answers(&server)?;
    injector.fail_streams(&server, "once", "CUDA_ERROR_OUT_OF_MEMORY")?;
    assert_everything_freed(&server)?;
    assert_eq!(
        good_answers(&server)?,
        alone,
        "answers changed after the failed step"
    );
    Ok(())
}

/// A sticky device error (every launch fails from then on, as after an
/// illegal address): the requests in flight get the error, and the server
/// logs why and exits with status 70 for a supervisor to restart it, without
/// a panic.
#[test]
#[ignore = "CUDA only: run by tools/gpu-suite.sh model-errors with the fault injector"]
fn a_sticky_device_error_answers_the_requests_in_flight_and_ends_the_server_with_status_70(
) -> Result<()> {
    let injector = FaultInjector::new("sticky")?;
    let mut server = injector.start_server()?;
    good_answers(&server)?;
    injector.fail_streams(&server, "sticky", "CUDA_ERROR_ILLEGAL_ADDRESS")?;
    let status = server
        .wait_for_exit(Duration::from_secs(30))?
        .context("the server still runs 30 s after a sticky device error")?;
    assert_eq!(status.code(), Some(70), "{}", server.log());
    let log = server.log();
    assert!(log.contains("exiting with status 70"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    Ok(())
}
