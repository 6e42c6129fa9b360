//! Sampling parameters through the real server (CPU, float32, the bundled
//! model), judged by the transformers reference's greedy completions and
//! logits (trained-tiny's golden files):
//! - sampling at temperature 1 that keeps only the most likely token
//!   (`top_k: 1`, a tiny `top_p`, `min_p: 1`) gives each golden prompt the
//!   reference's greedy completion, the prompts sent together so that one
//!   batch samples them all on the host's path;
//! - `logit_bias` moves the first token where the reference's logits with
//!   the bias added say, and the OpenAI presence and frequency penalties move
//!   the next token after a golden prompt's first tokens where the reference's
//!   logits penalized by OpenAI's formula say;
//! - a stop sequence ends the answer where it begins in the reference's
//!   greedy completion, streamed or not;
//! - the same `seed` samples the same tokens.
//!
//! mistral.rs 0.8.1 ignored `logit_bias`, `min_p` unless `top_p` was below 1
//! and `seed`, and streamed stop sequences (docs/host-seam.md, "Sampling
//! parameters", "Stop sequences", "A request's seed").

use std::collections::HashMap;
use std::thread;

use anyhow::{ensure, Context, Result};
use berrylm_tests::chat::{chat_answer, golden_chat_request};
use berrylm_tests::server::Server;
use berrylm_tests::Fixture;
use candle_core::IndexOp;
use serde_json::{json, Value};

const COMPLETIONS: &str = "/v1/completions";

fn start(fixture: &Fixture) -> Result<Server> {
    Server::start(&fixture.model_dir, &["--dtype", "f32"])
}

/// A completion of `prompt` (which the server must count as
/// `prompt_tokens` tokens) with `sampling`; returns its choice.
fn complete(
    server: &Server,
    prompt: &str,
    prompt_tokens: usize,
    max_tokens: usize,
    sampling: &Value,
) -> Result<Value> {
    let mut body = json!({"model": "default", "prompt": prompt, "max_tokens": max_tokens});
    if let (Some(body), Some(sampling)) = (body.as_object_mut(), sampling.as_object()) {
        body.extend(sampling.clone());
    }
    let (status, response) = server.post(COMPLETIONS, &body)?;
    ensure!(status == 200, "{sampling}: HTTP {status}: {response}");
    let counted = response["usage"]["prompt_tokens"].as_u64();
    ensure!(
        counted == Some(prompt_tokens as u64),
        "the prompt took {counted:?} tokens, not {prompt_tokens}: {prompt:?}"
    );
    Ok(response["choices"][0].clone())
}

/// Golden sequence `index`'s prompt as the chat template renders it, and the
/// number of its golden ids.
fn golden_prompt(fixture: &Fixture, index: usize) -> Result<(String, usize)> {
    let sequence = &fixture.facts["sequences"][index];
    let prompt = sequence["rendered_prompt"]
        .as_str()
        .with_context(|| format!("sequence {index}: rendered_prompt"))?;
    let len = sequence["len"]
        .as_u64()
        .with_context(|| format!("sequence {index}: len"))?;
    Ok((prompt.to_string(), usize::try_from(len)?))
}

#[test]
fn sampling_that_keeps_only_the_most_likely_token_gives_the_greedy_completions() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = start(&fixture)?;
    let keep_the_most_likely = [
        json!({"temperature": 1.0, "top_k": 1}),
        json!({"temperature": 1.0, "top_p": 1e-6}),
        json!({"temperature": 1.0, "min_p": 1.0}),
    ];
    let sequences = fixture.facts["sequences"]
        .as_array()
        .context("sequences")?
        .len();
    let requests: Vec<(usize, &Value)> = (0..sequences)
        .flat_map(|index| {
            keep_the_most_likely
                .iter()
                .map(move |sampling| (index, sampling))
        })
        .collect();
    let answers = thread::scope(|scope| {
        let running: Vec<_> = requests
            .iter()
            .map(|&(index, sampling)| {
                let (server, fixture) = (&server, &fixture);
                scope.spawn(move || {
                    let (prompt, len) = golden_prompt(fixture, index)?;
                    complete(server, &prompt, len, 64, sampling)
                })
            })
            .collect();
        running
            .into_iter()
            .map(|answer| answer.join().expect("a request thread panicked"))
            .collect::<Vec<_>>()
    });
    for (&(index, sampling), answer) in requests.iter().zip(answers) {
        let choice = answer?;
        let expected = fixture.reference_completion(index)?;
        // The host trims a completion's leading whitespace (for every model).
        assert_eq!(
            choice["text"].as_str(),
            Some(expected.trim_start()),
            "sequence {index}, {sampling}"
        );
        assert_eq!(
            choice["finish_reason"].as_str(),
            Some("stop"),
            "sequence {index}, {sampling}"
        );
    }
    assert!(
        server.largest_batch() > 1,
        "the requests never shared a forward, so no batch was sampled:\n{}",
        server.log()
    );
    Ok(())
}

/// The token of the largest value, and that value's margin over the next.
fn argmax_with_margin(values: &[f32]) -> (usize, f32) {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
    (order[0], values[order[0]] - values[order[1]])
}

/// Token ids to their text, from the tokenizer's byte-level vocabulary (`Ġ`
/// a space, `Ċ` a newline) and its added tokens; tokens with other bytes
/// than plain ASCII are left out.
fn vocabulary(fixture: &Fixture) -> Result<HashMap<u32, String>> {
    let tokenizer: Value = serde_json::from_str(&std::fs::read_to_string(
        fixture.model_dir.join("tokenizer.json"),
    )?)?;
    let as_text = |piece: &str| -> Option<String> {
        piece
            .chars()
            .map(|c| match c {
                'Ġ' => Some(' '),
                'Ċ' => Some('\n'),
                c if c.is_ascii_graphic() => Some(c),
                _ => None,
            })
            .collect()
    };
    let mut vocabulary: HashMap<u32, String> = tokenizer["model"]["vocab"]
        .as_object()
        .context("tokenizer.json: model.vocab")?
        .iter()
        .filter_map(|(piece, id)| Some((u32::try_from(id.as_u64()?).ok()?, as_text(piece)?)))
        .collect();
    for added in tokenizer["added_tokens"].as_array().into_iter().flatten() {
        if let (Some(id), Some(text)) = (added["id"].as_u64(), added["content"].as_str()) {
            vocabulary.insert(u32::try_from(id)?, text.to_string());
        }
    }
    Ok(vocabulary)
}

/// A golden prompt's first tokens as the reference saw them: their text,
/// their ids, and the reference's f32 logits for the token after them.
struct Prefix {
    text: String,
    ids: Vec<u32>,
    logits: Vec<f32>,
}

/// Golden sequence `index`'s prompt cut after `len` tokens, when its text is
/// known and the cut falls where a word starts (so that the server's
/// tokenizer cuts the text into the same tokens).
fn prefix(
    fixture: &Fixture,
    vocabulary: &HashMap<u32, String>,
    index: usize,
    len: usize,
) -> Result<Option<Prefix>> {
    let ids = fixture.ids(&format!("seq{index}.input_ids"))?;
    let text: Option<String> = ids[..len]
        .iter()
        .map(|id| vocabulary.get(id).cloned())
        .collect();
    let word_starts = ids
        .get(len)
        .and_then(|next| vocabulary.get(next))
        .is_none_or(|next| next.starts_with([' ', '\n']));
    let Some(text) = text.filter(|_| word_starts) else {
        return Ok(None);
    };
    let logits = fixture.tensor(&format!("seq{index}.logits_f32"))?;
    Ok(Some(Prefix {
        text,
        ids: ids[..len].to_vec(),
        logits: logits.i(len - 1)?.to_vec1::<f32>()?,
    }))
}

/// The first token greedy decoding picks after `prefix` with `sampling`, as
/// its log-probabilities name it (`logprobs.tokens`).
fn first_token(server: &Server, prefix: &Prefix, sampling: Value) -> Result<String> {
    let mut sampling = sampling;
    sampling["temperature"] = json!(0.0);
    sampling["logprobs"] = json!(1);
    let choice = complete(server, &prefix.text, prefix.ids.len(), 1, &sampling)?;
    Ok(choice["logprobs"]["tokens"][0]
        .as_str()
        .with_context(|| format!("no log-probability entry: {choice}"))?
        .to_string())
}

/// Token `id`'s text.
fn token_text(vocabulary: &HashMap<u32, String>, id: usize) -> Result<String> {
    vocabulary
        .get(&u32::try_from(id)?)
        .cloned()
        .with_context(|| format!("token {id}'s text is not plain ASCII"))
}

#[test]
fn logit_bias_moves_the_first_token_where_the_reference_logits_say() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let vocabulary = vocabulary(&fixture)?;
    let server = start(&fixture)?;
    let (_, len) = golden_prompt(&fixture, 0)?;
    let prompt = prefix(&fixture, &vocabulary, 0, len)?.context("golden prompt 0's text")?;
    let logits = &prompt.logits;
    let (best, margin) = argmax_with_margin(logits);
    ensure!(
        margin > 1e-3,
        "the reference's first token is a near tie ({margin})"
    );
    assert_eq!(
        first_token(&server, &prompt, json!({}))?,
        token_text(&vocabulary, best)?
    );

    // The most likely token pushed down by 100: the next one.
    let mut biased = logits.clone();
    biased[best] -= 100.0;
    let (second, margin) = argmax_with_margin(&biased);
    ensure!(
        margin > 1e-3,
        "the reference's second token is a near tie ({margin})"
    );
    assert_eq!(
        first_token(
            &server,
            &prompt,
            json!({"logit_bias": {best.to_string(): -100}})
        )?,
        token_text(&vocabulary, second)?,
        "logit_bias -100 on the greedy token {best}"
    );

    // A token 20 ranks down, raised by 100 above the rest.
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let raised = *order[20..]
        .iter()
        .find(|&&id| token_text(&vocabulary, id).is_ok())
        .context("no plain-ASCII token among the less likely")?;
    let mut biased = logits.clone();
    biased[raised] += 100.0;
    let (winner, margin) = argmax_with_margin(&biased);
    ensure!(
        winner == raised && margin > 1e-3,
        "+100 does not make token {raised} the most likely"
    );
    assert_eq!(
        first_token(
            &server,
            &prompt,
            json!({"logit_bias": {raised.to_string(): 100}})
        )?,
        token_text(&vocabulary, raised)?,
        "logit_bias +100 on token {raised}"
    );
    Ok(())
}

/// OpenAI's penalties: every token of the context (here the prompt) loses
/// the presence penalty once and the frequency penalty per occurrence. The
/// reference is confident of every golden prompt's first token, so each
/// penalty is tried on the first cut of a golden prompt where the reference's
/// penalized logits pick another token than its logits.
#[test]
fn penalties_move_the_next_token_where_the_reference_logits_say() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let vocabulary = vocabulary(&fixture)?;
    let server = start(&fixture)?;
    let penalty = 2.0f32;
    for (name, per_occurrence) in [("presence_penalty", false), ("frequency_penalty", true)] {
        let penalized = |prefix: &Prefix| -> Vec<f32> {
            let mut logits = prefix.logits.clone();
            let mut seen = vec![false; logits.len()];
            for &id in &prefix.ids {
                let id = id as usize;
                if per_occurrence || !seen[id] {
                    logits[id] -= penalty;
                }
                seen[id] = true;
            }
            logits
        };
        let mut found = None;
        'search: for index in 0..fixture.num_sequences() {
            let (_, len) = golden_prompt(&fixture, index)?;
            for cut in 1..=len {
                let Some(prefix) = prefix(&fixture, &vocabulary, index, cut)? else {
                    continue;
                };
                let (unpenalized, margin) = argmax_with_margin(&prefix.logits);
                let (expected, penalized_margin) = argmax_with_margin(&penalized(&prefix));
                if expected != unpenalized
                    && margin.min(penalized_margin) > 1e-2
                    && token_text(&vocabulary, unpenalized).is_ok()
                    && token_text(&vocabulary, expected).is_ok()
                {
                    found = Some((index, prefix, unpenalized, expected));
                    break 'search;
                }
            }
        }
        let (index, prefix, unpenalized, expected) =
            found.with_context(|| format!("{name} {penalty} changes no golden next token"))?;
        let place = format!("sequence {index} after {} tokens", prefix.ids.len());
        assert_eq!(
            first_token(&server, &prefix, json!({}))?,
            token_text(&vocabulary, unpenalized)?,
            "no penalty, {place}"
        );
        assert_eq!(
            first_token(&server, &prefix, json!({name: penalty}))?,
            token_text(&vocabulary, expected)?,
            "{name} {penalty}, {place}"
        );
    }
    Ok(())
}

/// A stop sequence ends the completion just before its first occurrence in
/// the reference's greedy completion, streamed or not, through completions
/// and chat completions, with `finish_reason` `stop` (the host trims a
/// completion's leading whitespace). mistral.rs 0.8.1 noticed a stop
/// sequence one token after the token that completed it, and streamed it and
/// that token.
#[test]
fn a_stop_sequence_ends_the_completion_before_it() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = start(&fixture)?;
    let (prompt, len) = golden_prompt(&fixture, 0)?;
    let reference = fixture.facts["sequences"][0]["greedy_completion_text"]
        .as_str()
        .context("greedy_completion_text")?;
    // Within a token and across two ("5 is 13" is `5`, ` is`, ` 13`).
    for stop in ["s 1", "5 is 13"] {
        let (expected, _) = reference
            .split_once(stop)
            .with_context(|| format!("{stop:?} is not in the reference's completion"))?;
        let sampling = json!({"temperature": 0.0, "stop": [stop]});
        let choice = complete(&server, &prompt, len, 64, &sampling)?;
        assert_eq!(
            choice["text"].as_str(),
            Some(expected.trim_start()),
            "stop {stop:?}"
        );
        assert_eq!(
            choice["finish_reason"].as_str(),
            Some("stop"),
            "stop {stop:?}"
        );

        let mut body =
            json!({"model": "default", "prompt": prompt, "max_tokens": 64, "stream": true});
        if let (Some(body), Some(sampling)) = (body.as_object_mut(), sampling.as_object()) {
            body.extend(sampling.clone());
        }
        let (status, events) = server.post_stream(COMPLETIONS, &body)?;
        ensure!(status == 200, "streamed, stop {stop:?}: HTTP {status}");
        let streamed: String = events
            .iter()
            .filter_map(|event| event["choices"][0]["text"].as_str())
            .collect();
        let finish = events
            .iter()
            .find_map(|event| event["choices"][0]["finish_reason"].as_str());
        assert_eq!(streamed, expected.trim_start(), "streamed, stop {stop:?}");
        assert_eq!(finish, Some("stop"), "streamed, stop {stop:?}");

        // The chat endpoint: the stop sequence falls in the reasoning.
        for stream in [false, true] {
            let mut body = golden_chat_request(&fixture.facts["sequences"][0], 64, stream)?;
            body["stop"] = json!([stop]);
            let (message, finish) = chat_answer(&server, &body)?;
            let context = format!("chat, stop {stop:?}, stream {stream}: {message}");
            assert_eq!(
                message["reasoning_content"].as_str().map(str::trim),
                Some(expected.trim()),
                "{context}"
            );
            assert!(
                message["content"]
                    .as_str()
                    .is_none_or(|content| content.trim().is_empty()),
                "{context}"
            );
            assert_eq!(finish, "stop", "{context}");
        }
    }
    Ok(())
}

/// The same request with the same `seed` samples the same tokens, alone or
/// sharing its steps with other sampled requests (each seeded request draws
/// from a stream of its own); other seeds sample other tokens. mistral.rs
/// 0.8.1 ignored `seed`: every sampled request drew from the server's one
/// random stream.
#[test]
fn a_seed_makes_sampling_repeatable() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = start(&fixture)?;
    let (prompt, len) = golden_prompt(&fixture, 0)?;
    let sampled = |seed: u64| -> Result<String> {
        let sampling = json!({"temperature": 1.5, "seed": seed});
        let choice = complete(&server, &prompt, len, 32, &sampling)?;
        Ok(choice["text"].as_str().context("text")?.to_string())
    };
    let alone = sampled(7)?;
    let sampled = &sampled;
    let together = thread::scope(|scope| {
        let running: Vec<_> = [7, 11, 7, 13]
            .into_iter()
            .map(|seed| scope.spawn(move || sampled(seed)))
            .collect();
        running
            .into_iter()
            .map(|answer| answer.join().expect("a request thread panicked"))
            .collect::<Result<Vec<_>>>()
    })?;
    assert_eq!(together[0], alone, "seed 7 in a batch");
    assert_eq!(together[2], alone, "seed 7 twice in a batch");
    let others = (101..=108).map(sampled).collect::<Result<Vec<_>>>()?;
    assert!(
        others.iter().any(|text| *text != alone),
        "eight other seeds all sampled {alone:?}"
    );
    Ok(())
}
