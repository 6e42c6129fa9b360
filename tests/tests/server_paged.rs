//! Paged attention against the contiguous KV cache through the real server:
//! the same greedy tokens on every fixture, and on the trained model the same
//! log-probabilities within 1e-3 (f32) and the same answers in bf16, also
//! from an FP8 KV cache and after a prefix-cache hit; the recurrent state of `--max-seqs`
//! sequences reserved before the paged KV cache is sized, and enough for any
//! load; a long prompt arriving while another sequence decodes runs in
//! chunks between that sequence's decode steps and is answered as it is run
//! whole. The host pages only in CUDA builds, so these tests are ignored in
//! CI and run on the GPU machine (docs/performance.md): `test-server_paged
//! --ignored` with the CUDA `mistralrs` as BERRYLM_HOST_BIN.

use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use berrylm_tests::chat::{
    assert_golden_weather_call, assert_same_tokens_up_to_a_near_tie, chat_answer, chosen_logprobs,
    comparable, follow_up_messages, golden_chat_request, greedy_chat_message,
};
use berrylm_tests::metrics::{recurrent_bytes_per_sequence, SLOTS_IN_USE, SLOTS_TOTAL};
use berrylm_tests::server::Server;
use berrylm_tests::{fixtures_dir, Fixture, FIXTURES, REFERENCE_BF16_MEAN_ABS_LOGPROB};
use serde_json::{json, Value};

const PAGED: [&str; 6] = [
    "--dtype",
    "f32",
    "--paged-attn",
    "on",
    "--pa-memory-mb",
    "1024",
];
const CONTIGUOUS: [&str; 4] = ["--dtype", "f32", "--paged-attn", "off"];

/// `args` with `--dtype bf16` for `--dtype f32`.
fn in_bf16(args: &[&'static str]) -> Vec<&'static str> {
    args.iter()
        .map(|arg| if *arg == "f32" { "bf16" } else { arg })
        .collect()
}

/// A bf16 server of `fixture` with paged attention and one without.
fn bf16_servers(fixture: &Fixture) -> Result<(Server, Server)> {
    Ok((
        Server::start(&fixture.model_dir, &in_bf16(&PAGED))?,
        Server::start(&fixture.model_dir, &in_bf16(&CONTIGUOUS))?,
    ))
}

/// A prompt of words every fixture's tokenizer knows.
fn prompt_for(fixture: &str) -> &'static str {
    match fixture {
        // Word-level vocabularies `w9` ... `w98`.
        "tiny-hf" | "no-attnres" => "w10 w21 w32 w43 w54 w65 w76 w87 w12 w23",
        _ => "The quick brown fox jumps over the lazy dog, then 7 + 5 is",
    }
}

/// The chosen tokens and their log-probabilities of a greedy chat completion.
fn chat_logprobs(server: &Server, messages: &Value) -> Result<Vec<(String, f64)>> {
    let request = json!({
        "model": "default",
        "messages": messages,
        "temperature": 0.0,
        "max_tokens": 48,
        "logprobs": true,
    });
    let (status, response) = server.post("/v1/chat/completions", &request)?;
    anyhow::ensure!(status == 200, "HTTP {status}: {response}");
    response["choices"][0]["logprobs"]["content"]
        .as_array()
        .context("logprobs.content")?
        .iter()
        .map(|entry| {
            Ok((
                entry["token"].as_str().context("token")?.to_string(),
                entry["logprob"].as_f64().context("logprob")?,
            ))
        })
        .collect()
}

/// Head sizes of the host's paged attention decode kernels.
const PAGED_HEAD_SIZES: [u64; 8] = [64, 80, 96, 112, 128, 192, 256, 512];

fn head_dim(fixture: &Fixture) -> Result<u64> {
    let config: Value = serde_json::from_str(&std::fs::read_to_string(
        fixture.model_dir.join("config.json"),
    )?)?;
    config["head_dim"].as_u64().context("head_dim")
}

#[test]
#[ignore = "needs a CUDA build of the host (paged attention); run on the GPU machine"]
fn paged_and_contiguous_kv_give_the_same_greedy_tokens_on_every_fixture() -> Result<()> {
    for name in FIXTURES {
        let fixture = Fixture::load(name)?;
        let prompt = prompt_for(name);
        let paged_server = Server::start(&fixture.model_dir, &PAGED)?;
        let paged = paged_server.complete(prompt, 40)?;
        let contiguous = Server::start(&fixture.model_dir, &CONTIGUOUS)?.complete(prompt, 40)?;
        assert_eq!(paged, contiguous, "{name}: paged and contiguous KV differ");
        // A head size without a paged kernel keeps the contiguous cache, and says so.
        let fell_back = paged_server.log().contains("has no paged attention kernel");
        assert_eq!(
            fell_back,
            !PAGED_HEAD_SIZES.contains(&head_dim(&fixture)?),
            "{name}"
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA build of the host (paged attention); run on the GPU machine"]
fn paged_and_contiguous_kv_give_the_same_logprobs_on_the_trained_model() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let paged = Server::start(&fixture.model_dir, &PAGED)?;
    let contiguous = Server::start(&fixture.model_dir, &CONTIGUOUS)?;
    let sequences = fixture.facts["sequences"].as_array().context("sequences")?;
    for sequence in sequences.iter().take(2) {
        let messages = &sequence["messages"];
        let a = chat_logprobs(&paged, messages)?;
        let b = chat_logprobs(&contiguous, messages)?;
        assert_eq!(a.len(), b.len(), "{messages}");
        for ((token_a, logprob_a), (token_b, logprob_b)) in a.iter().zip(&b) {
            assert_eq!(token_a, token_b, "{messages}");
            assert!(
                (logprob_a - logprob_b).abs() <= 1e-3,
                "{messages}: token {token_a:?} log-probability {logprob_a} (paged) vs {logprob_b}"
            );
        }
    }
    Ok(())
}

/// bf16, the serving dtype: a prompt's keys and values are written into its
/// paged blocks by the plugin and its attention is the tiled kernel's, as
/// without paging; the decode steps then read the blocks in the host's paged
/// kernel instead of the contiguous cache. The trained model's greedy answers
/// are the same token for token, and the chosen tokens' log-probabilities
/// differ by at most twice the reference's own bf16 noise on average (mean
/// |Δ log-probability| 7.39e-2 between its bf16 and f32 runs, alignment.md):
/// the two decode kernels sum in different orders and round to bf16, which
/// moves a near-tied token's probability by a few percent.
#[test]
#[ignore = "needs a CUDA build of the host (paged attention); run on the GPU machine"]
fn paged_and_contiguous_kv_give_the_same_answers_in_bf16_on_the_trained_model() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let (paged, contiguous) = bf16_servers(&fixture)?;
    let sequences = fixture.facts["sequences"].as_array().context("sequences")?;
    let mut differences = Vec::new();
    for sequence in sequences.iter().take(2) {
        let messages = &sequence["messages"];
        let a = chat_logprobs(&paged, messages)?;
        let b = chat_logprobs(&contiguous, messages)?;
        let tokens = |answer: &[(String, f64)]| -> Vec<String> {
            answer.iter().map(|(token, _)| token.clone()).collect()
        };
        assert_eq!(tokens(&a), tokens(&b), "{messages}");
        differences.extend(a.iter().zip(&b).map(|((_, a), (_, b))| (a - b).abs()));
    }
    anyhow::ensure!(!differences.is_empty(), "no tokens compared");
    let mean = differences.iter().sum::<f64>() / differences.len() as f64;
    eprintln!(
        "bf16 paged vs contiguous: {} tokens, mean |Δ log-probability| {mean:.3e}, max {:.3e}",
        differences.len(),
        differences.iter().cloned().fold(0.0, f64::max)
    );
    assert!(
        mean <= 2.0 * REFERENCE_BF16_MEAN_ABS_LOGPROB,
        "mean |Δ log-probability| {mean} over {differences:?}"
    );
    Ok(())
}

/// A conversation extending a finished one hits the paged server's prefix
/// cache: the new turn's prompt runs after the cached positions, their keys
/// and values read from the paged blocks. In bf16 it is answered as the
/// contiguous cache answers the whole conversation, token for token up to a
/// near-tie (the prefix-hit prompt runs the recurrence from the cached
/// state in other chunks, which rounds otherwise).
#[test]
#[ignore = "needs a CUDA build of the host (paged attention); run on the GPU machine"]
fn a_prompt_after_a_prefix_hit_gives_the_contiguous_answer_in_bf16() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let (paged, contiguous) = bf16_servers(&fixture)?;
    prefix_hit_answers_as_the_contiguous_server(&paged, &contiguous)
}

/// The same over an FP8 paged KV cache: the prompt after the hit reads the
/// cached keys and values dequantized with the scales they were written with.
#[test]
#[ignore = "needs a CUDA build of the host (paged attention); run on the GPU machine"]
fn a_prompt_after_a_prefix_hit_over_an_fp8_kv_cache_gives_the_contiguous_answer_in_bf16(
) -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let mut fp8 = in_bf16(&PAGED);
    fp8.extend(["--pa-cache-type", "f8e4m3"]);
    let paged = Server::start(&fixture.model_dir, &fp8)?;
    let contiguous = Server::start(&fixture.model_dir, &in_bf16(&CONTIGUOUS))?;
    prefix_hit_answers_as_the_contiguous_server(&paged, &contiguous)
}

/// A conversation extending one `paged` finished hits its prefix cache and is
/// answered as `contiguous` answers the whole conversation, up to a near-tie.
fn prefix_hit_answers_as_the_contiguous_server(paged: &Server, contiguous: &Server) -> Result<()> {
    let question = "What is 7 + 5?";
    let answer = greedy_chat_message(paged, &json!([{"role": "user", "content": question}]))?;
    let follow_up = json!({
        "model": "default",
        "messages": follow_up_messages(question, &answer, "And what is 12 + 30? Explain it step by step."),
        "temperature": 0.0,
        "max_tokens": 48,
    });
    let after_hit = chosen_logprobs(paged, &follow_up)?;
    let hits = paged.prompt_forwards_after_a_cache_hit();
    assert!(
        !hits.is_empty(),
        "the extended conversation did not hit the prefix cache"
    );
    let whole = chosen_logprobs(contiguous, &follow_up)?;
    assert_same_tokens_up_to_a_near_tie(&whole, &after_hit)
}

/// An FP8 paged KV cache (`--pa-cache-type f8e4m3`, blocks the host's paged
/// attention reads in FP8 whatever the activations' dtype) answers the
/// trained model's golden weather question (its tools offered) with the
/// reasoning and the `get_weather` call of the bf16 cache, in bf16 and in f32
/// (whose automatic device map once counted the FP8 cache at 4 bytes an
/// element and refused to load).
#[test]
#[ignore = "needs a CUDA build of the host (paged attention); run on the GPU machine"]
fn an_fp8_kv_cache_gives_the_answer_of_the_bf16_one_on_the_trained_model() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let weather = golden_chat_request(&fixture.facts["sequences"][2], 96, false)?;
    let (message, finish_reason) = chat_answer(
        &Server::start(&fixture.model_dir, &["--dtype", "bf16"])?,
        &weather,
    )?;
    assert_golden_weather_call(&message, &finish_reason);
    let expected = comparable(&message, &finish_reason);
    for dtype in ["bf16", "f32"] {
        let server = Server::start(
            &fixture.model_dir,
            &["--dtype", dtype, "--pa-cache-type", "f8e4m3"],
        )?;
        let (message, finish_reason) = chat_answer(&server, &weather)?;
        assert_eq!(
            comparable(&message, &finish_reason),
            expected,
            "--dtype {dtype} with an FP8 KV cache"
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA build of the host (paged attention); run on the GPU machine"]
fn the_recurrent_state_of_max_seqs_sequences_is_reserved_before_the_kv_cache_and_suffices(
) -> Result<()> {
    const MAX_SEQS: usize = 12;
    const REQUESTS: usize = 30;
    let model_dir = fixtures_dir().join("trained-tiny/model");
    let max_seqs = MAX_SEQS.to_string();
    let args: Vec<&str> = PAGED
        .iter()
        .copied()
        .chain(["--max-seqs", &max_seqs])
        .collect();
    let server = Server::start(&model_dir, &args)?;

    let reserved = recurrent_bytes_per_sequence(&model_dir)? * MAX_SEQS as u64;
    let reserved_line = format!(
        "Recurrent state reserved for {MAX_SEQS} sequences: {:.1} MiB",
        reserved as f64 / (1024.0 * 1024.0)
    );
    let log = server.log();
    let reserved_at = log
        .find(&reserved_line)
        .with_context(|| format!("no `{reserved_line}` in the log:\n{log}"))?;
    let kv_sized_at = log
        .find("for PagedAttention KV cache")
        .with_context(|| format!("no paged KV cache in the log:\n{log}"))?;
    assert!(
        reserved_at < kv_sized_at,
        "the KV cache was sized before the recurrent state was reserved:\n{log}"
    );
    assert_eq!(server.metrics()?[SLOTS_TOTAL], MAX_SEQS as f64);

    // More requests than sequences run at once: those beyond wait, all complete.
    let server = &server;
    thread::scope(|scope| {
        let requests: Vec<_> = (0..REQUESTS)
            .map(|i| scope.spawn(move || server.completion(&format!("{i} + 5 is"), 24)))
            .collect();
        for request in requests {
            let response = request.join().expect("request thread panicked")?;
            let reason = &response["choices"][0]["finish_reason"];
            anyhow::ensure!(reason == "stop" || reason == "length", "{response}");
        }
        Ok(())
    })?;
    // The last step's slots are freed just after its responses went out.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut served = server.metrics()?;
    while served[SLOTS_IN_USE] > 0.0 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
        served = server.metrics()?;
    }
    assert_eq!(served[SLOTS_TOTAL], MAX_SEQS as f64, "{served:#?}");
    assert_eq!(served[SLOTS_IN_USE], 0.0, "{served:#?}");
    assert!(
        !server.log().contains("Recurrent state pool grew"),
        "{}",
        server.log()
    );
    Ok(())
}

/// One forward the server logged: how many sequences, how many tokens each,
/// and the first sequence's first position.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Forward {
    sequences: usize,
    tokens: usize,
    position: usize,
}

/// The forwards of the server's `berrylm forward` debug lines, in order
/// (`{rows} sequences x {tokens} tokens at positions [{first}, ...]`).
fn forwards(server: &Server) -> Vec<Forward> {
    server
        .log()
        .lines()
        .filter_map(|line| line.split("berrylm forward: ").nth(1))
        .filter_map(|rest| {
            let mut words = rest.split_whitespace();
            let sequences = words.next()?.parse().ok()?;
            let tokens = words.nth(2)?.parse().ok()?;
            let position = rest
                .split("positions [")
                .nth(1)?
                .split([',', ']'])
                .next()?
                .trim()
                .parse()
                .ok()?;
            Some(Forward {
                sequences,
                tokens,
                position,
            })
        })
        .collect()
}

/// A long prompt that arrives while another sequence decodes runs in chunks
/// of `--chunked-prefill-size` tokens, each in a step of its own with a
/// decode step of the other sequence after it, and is answered as it is when
/// it arrives alone and runs whole: token for token up to a near-tie (bf16;
/// the recurrence and the attention sum over other chunks). One server
/// answers both, without a prefix cache, so the second computes the prompt again.
#[test]
#[ignore = "needs a CUDA build of the host (paged attention); run on the GPU machine"]
fn a_long_prompt_arriving_while_another_decodes_runs_in_chunks_between_its_steps() -> Result<()> {
    const CHUNK: usize = 256;
    let chunk = CHUNK.to_string();
    let mut args = in_bf16(&PAGED);
    args.extend(["--chunked-prefill-size", &chunk, "--prefix-cache-n", "0"]);
    let server = Server::start(&fixtures_dir().join("trained-tiny/model"), &args)?;
    let content =
        "The quick brown fox jumps over the lazy dog. ".repeat(120) + "What did the fox do?";
    let long_request = json!({
        "model": "default",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "max_tokens": 24,
    });
    let whole = chosen_logprobs(&server, &long_request)?;
    let alone = forwards(&server);
    assert!(
        alone
            .iter()
            .all(|forward| forward.position == 0 || forward.tokens == 1),
        "the prompt ran in chunks with nothing else running: {alone:?}"
    );

    // A sequence that decodes all along (its end-of-sequence tokens banned).
    let decoding = json!({
        "model": "default",
        "prompt": "Once upon a time",
        "temperature": 0.0,
        "max_tokens": 2000,
        "logit_bias": {"0": -100, "2": -100},
    });
    let server = &server;
    let chunked = thread::scope(|scope| -> Result<Value> {
        let other = scope.spawn(move || server.post("/v1/completions", &decoding));
        let deadline = Instant::now() + Duration::from_secs(60);
        while forwards(server)[alone.len()..]
            .iter()
            .filter(|forward| forward.tokens == 1)
            .count()
            < 8
        {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the other sequence never decoded"
            );
            thread::sleep(Duration::from_millis(20));
        }
        let chunked = chosen_logprobs(server, &long_request)?;
        let (status, response) = other
            .join()
            .expect("the decoding request's thread panicked")?;
        anyhow::ensure!(status == 200, "HTTP {status}: {response}");
        Ok(chunked)
    })?;

    let during = forwards(server).split_off(alone.len());
    let first_chunk = during
        .iter()
        .position(|forward| forward.tokens == CHUNK && forward.position == 0)
        .with_context(|| format!("no first chunk of {CHUNK} tokens in {during:?}"))?;
    let mut chunks = vec![first_chunk];
    chunks.extend((first_chunk + 1..during.len()).filter(|&i| during[i].tokens > 1));
    assert!(chunks.len() >= 4, "{chunks:?} of {during:?}");
    for (n, pair) in chunks.windows(2).enumerate() {
        let next = during[pair[1]];
        assert_eq!(
            (next.sequences, next.position),
            (1, (n + 1) * CHUNK),
            "chunk {} of {during:?}",
            n + 1
        );
        assert!(
            during[pair[0] + 1..pair[1]]
                .iter()
                .any(|forward| forward.tokens == 1),
            "no decode step between chunks {n} and {} of {during:?}",
            n + 1
        );
    }
    assert_same_tokens_up_to_a_near_tie(&whole, &chunked)
}
