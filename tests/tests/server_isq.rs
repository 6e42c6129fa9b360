//! In-situ quantization through the real server: the bundled model served
//! with `--isq q8_0` quantizes exactly the projections BerryLM lets the host
//! quantize (counted from the config, sized from the checkpoint) and answers
//! the golden chats (reasoning, tool calls with typed arguments, final
//! answers) as the unquantized model does, streamed and not; MoQE quantizes
//! the experts and the LM head only; `mistralrs quantize` writes a UQFF file
//! that `serve --from-uqff` loads into the same tokens and log-probabilities
//! as `--isq q8_0`. And every projection quantized while loading hands out
//! its GGUF blocks, which BerryLM's CUDA kernels read in place.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use berrylm_tests::chat::{
    assert_golden_weather_call, assert_same_tokens_up_to_a_near_tie, chat_answer, chosen_logprobs,
    comparable, golden_chat_request,
};
use berrylm_tests::server::Server;
use berrylm_tests::{checkpoint_tensors, host_binary, Fixture, TempDir};
use candle_core::quantized::GgmlDType;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use mistralrs_quant::IsqType;
use serde_json::{json, Value};

/// Bytes of q8_0 data per 32 weights (32 int8 and an f16 scale).
const Q8_0_BLOCK_BYTES: usize = 34;
const Q8_0_BLOCK: usize = 32;
/// An upper bound on the header UQFF puts before a quantized tensor's data.
const UQFF_HEADER_BYTES: usize = 64;

/// Whether the host quantizes a checkpoint tensor by default (docs/usage.md):
/// the attention and KDA projections but β's and the forget gate's, the
/// routed and shared experts, the LM head.
fn quantized_by_default(name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    match parts.as_slice() {
        ["lm_head", _] => true,
        [.., "self_attn", projection, _] => {
            matches!(*projection, "q_proj" | "k_proj" | "v_proj" | "o_proj")
        }
        [.., "linear_attn", projection, _] => {
            matches!(*projection, "in_proj_qkv" | "in_proj_z" | "out_proj")
        }
        [.., "shared_expert", _, _] => true,
        _ => parts.contains(&"experts"),
    }
}

/// Projections the host quantizes per the config: `(default, moqe)`. An
/// attention layer has q, k, v and o; a KDA layer `in_proj_qkv`, `in_proj_z`
/// and `out_proj`; every layer 3 per routed expert and 3 for the shared
/// expert; the LM head 1.
fn quantized_projections(fixture: &Fixture) -> Result<(usize, usize)> {
    let config: Value = serde_json::from_str(&std::fs::read_to_string(
        fixture.model_dir.join("config.json"),
    )?)?;
    let experts = config["num_experts"].as_u64().context("num_experts")? as usize;
    let layer_types = config["layer_types"].as_array().context("layer_types")?;
    let lm_head = usize::from(config["tie_word_embeddings"] != json!(true));
    let moe = layer_types.len() * (3 * experts + 3);
    let mixers: usize = layer_types
        .iter()
        .map(|kind| if kind == "full_attention" { 4 } else { 3 })
        .sum();
    Ok((lm_head + mixers + moe, lm_head + moe))
}

/// The numbers of BerryLM's quantization line in the server log:
/// `(quantized, projections, bytes, full-precision bytes)`.
fn quantization_line(log: &str) -> Result<(usize, usize, usize, usize)> {
    const MARKER: &str = "BerryLM: in-situ quantization quantized";
    let line = log
        .lines()
        .find_map(|line| line.split_once(MARKER).map(|(_, rest)| rest))
        .with_context(|| format!("no quantization line in the log:\n{log}"))?;
    // Whole numbers only (the MiB figures have a decimal point).
    let numbers: Vec<usize> = line
        .split(|c: char| !c.is_ascii_digit() && c != '.')
        .filter(|word| !word.is_empty() && !word.contains('.'))
        .filter_map(|word| word.parse().ok())
        .collect();
    match numbers.as_slice() {
        [quantized, projections, bytes, full_precision] => {
            Ok((*quantized, *projections, *bytes, *full_precision))
        }
        _ => anyhow::bail!("unexpected quantization line: {line}"),
    }
}

/// The golden chats (arithmetic, greeting, a tool call with thinking and one
/// without, an answer from a tool result), streamed and not.
fn golden_chats(fixture: &Fixture) -> Result<Vec<(String, Value)>> {
    let sequences = fixture.facts["sequences"]
        .as_array()
        .context("golden sequences")?;
    let mut chats = Vec::new();
    for (index, sequence) in sequences.iter().enumerate() {
        for stream in [false, true] {
            chats.push((
                format!("golden sequence {index}, stream {stream}"),
                golden_chat_request(sequence, 128, stream)?,
            ));
        }
    }
    Ok(chats)
}

fn answers(server: &Server, chats: &[(String, Value)]) -> Result<Vec<Value>> {
    chats
        .iter()
        .map(|(context, request)| {
            let (message, finish_reason) =
                chat_answer(server, request).with_context(|| context.clone())?;
            Ok(comparable(&message, &finish_reason))
        })
        .collect()
}

#[test]
fn q8_0_quantizes_the_projections_and_answers_as_the_unquantized_model() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let chats = golden_chats(&fixture)?;
    let expected = {
        let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
        answers(&server, &chats)?
    };
    // The golden chats hold tool calls with typed arguments and final answers.
    assert!(
        expected
            .iter()
            .any(|answer| answer["tool_calls"][0]["arguments"]["city"].is_string()),
        "{expected:?}"
    );

    let server = Server::start(&fixture.model_dir, &["--dtype", "f32", "--isq", "q8_0"])?;
    let (quantized, projections, bytes, full_precision_bytes) = quantization_line(&server.log())?;
    let (expected_projections, _) = quantized_projections(&fixture)?;
    assert_eq!(
        (quantized, projections),
        (expected_projections, expected_projections)
    );
    let tensors = checkpoint_tensors(&fixture.model_dir)?;
    let total: usize = tensors.iter().map(|(_, count)| count).sum();
    assert_eq!(full_precision_bytes, 4 * total, "f32 weights");
    let kept: usize = tensors
        .iter()
        .filter(|(name, _)| !quantized_by_default(name))
        .map(|(_, count)| count)
        .sum();
    let q8_0_data = (total - kept) / Q8_0_BLOCK * Q8_0_BLOCK_BYTES;
    let least = 4 * kept + q8_0_data;
    assert!(
        (least..=least + UQFF_HEADER_BYTES * quantized).contains(&bytes),
        "{bytes} bytes after quantization, expected {least} and at most a header per tensor more"
    );

    for ((context, _), (want, got)) in chats
        .iter()
        .zip(expected.iter().zip(answers(&server, &chats)?))
    {
        assert_eq!(&got, want, "{context}");
    }
    Ok(())
}

#[test]
fn moqe_quantizes_the_experts_and_the_lm_head_only() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(
        &fixture.model_dir,
        &[
            "--dtype",
            "f32",
            "--isq",
            "q8_0",
            "--isq-organization",
            "moqe",
        ],
    )?;
    let (quantized, projections, _, _) = quantization_line(&server.log())?;
    let (_, expected_projections) = quantized_projections(&fixture)?;
    assert_eq!(
        (quantized, projections),
        (expected_projections, expected_projections)
    );
    let weather = golden_chat_request(&fixture.facts["sequences"][2], 128, false)?;
    let (message, finish_reason) = chat_answer(&server, &weather)?;
    assert_golden_weather_call(&message, &finish_reason);
    Ok(())
}

/// Greedy answers with every token's log-probability and top 3.
fn tokens_and_logprobs(server: &Server, chats: &[(String, Value)]) -> Result<Vec<Value>> {
    chats
        .iter()
        .filter(|(_, request)| request["stream"] == json!(false))
        .map(|(context, request)| chosen_logprobs(server, request).with_context(|| context.clone()))
        .collect()
}

#[test]
fn a_uqff_file_from_mistralrs_quantize_serves_the_tokens_of_isq() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let out = TempDir::new("berrylm-uqff")?;
    let quantize = Command::new(host_binary()?)
        .args(["quantize", "-m"])
        .arg(&fixture.model_dir)
        .args(["--isq", "q8_0", "--dtype", "f32", "-o"])
        .arg(out.0.join("q8_0.uqff"))
        .output()
        .context("running mistralrs quantize")?;
    assert!(
        quantize.status.success(),
        "mistralrs quantize failed:\n{}\n{}",
        String::from_utf8_lossy(&quantize.stdout),
        String::from_utf8_lossy(&quantize.stderr)
    );

    // The residual holds exactly the tensors the host does not quantize.
    // SAFETY: the file is not modified while it is mapped.
    let residual = unsafe { MmapedSafetensors::new(out.0.join("residual.safetensors"))? };
    let mut held: Vec<String> = residual
        .tensors()
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    let mut kept: Vec<String> = checkpoint_tensors(&fixture.model_dir)?
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| !quantized_by_default(name))
        .collect();
    held.sort();
    kept.sort();
    assert_eq!(held, kept);

    let chats = golden_chats(&fixture)?;
    let from_uqff = {
        let server = Server::start(&out.0, &["--dtype", "f32", "--from-uqff", "q8_0-0.uqff"])?;
        let (expected_projections, _) = quantized_projections(&fixture)?;
        assert!(
            server.log().contains(&format!(
                "BerryLM: {expected_projections} of its {expected_projections} quantizable \
                 projections come from the UQFF file"
            )),
            "{}",
            server.log()
        );
        tokens_and_logprobs(&server, &chats)?
    };
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32", "--isq", "q8_0"])?;
    assert_eq!(from_uqff, tokens_and_logprobs(&server, &chats)?);
    Ok(())
}

/// The answers' tokens, without their log-probabilities.
fn tokens(answers: &[Value]) -> Vec<Vec<Value>> {
    answers
        .iter()
        .map(|content| {
            content
                .as_array()
                .into_iter()
                .flatten()
                .map(|token| token["token"].clone())
                .collect()
        })
        .collect()
}

/// `--isq q4k` on the bundled model: q4_K's 256-weight blocks do not divide
/// the experts' 128-wide down rows, which the host quantizes to its fallback
/// q4_1 instead, and experts of that type run in the host's kernels. On CUDA
/// such a server's decode steps run without CUDA graphs (the host's kernels
/// replayed from one read freed memory and ended the first request on an
/// illegal address). The server answers every golden chat, streamed as not,
/// and as the same server without paged attention does, token for token up
/// to a near-tie: where the two answers part (in bf16 on CUDA the paged and
/// contiguous attention sum in different orders), the contiguous server's
/// two most likely tokens are within twice the reference's own bf16 noise of
/// each other and the paged server chose the second.
#[test]
fn q4k_with_its_q4_1_fallback_answers_as_without_decode_graphs() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let chats = golden_chats(&fixture)?;
    let q4k = ["--dtype", "bf16", "--isq", "q4k"];
    let contiguous = {
        let server = Server::start(
            &fixture.model_dir,
            &[&q4k[..], &["--paged-attn", "off"]].concat(),
        )?;
        tokens_and_logprobs(&server, &chats)?
    };
    let server = Server::start(&fixture.model_dir, &q4k)?;
    let answered = answers(&server, &chats)?;
    // The host's device map names the device the layers load on; the model
    // decides on graphs at its first decode step.
    if server.log().contains(": cuda[") {
        assert!(
            server
                .log()
                .contains("decode steps run without CUDA graphs"),
            "a q4k server with q4_1 experts must not replay decode graphs"
        );
    }
    for (pair, answer) in chats.chunks(2).zip(answered.chunks(2)) {
        assert_eq!(answer[0], answer[1], "{} streamed", pair[0].0);
    }
    let paged = tokens_and_logprobs(&server, &chats)?;
    for (want, got) in contiguous.iter().zip(&paged) {
        assert_same_tokens_up_to_a_near_tie(want, got)?;
    }
    Ok(())
}

/// `POST /re_isq` re-quantizes the served model in place: the host hands it
/// the layers BerryLM holds for it (q8_0 here) and quantizes them again, to
/// q4_K, and the model answers from the new blocks: its log-probabilities
/// move, and its greedy tokens are those of a server re-quantized the same
/// way without paged attention (on CUDA, in bf16, the first server replays
/// its q8_0 decode steps from CUDA graphs, drops them when the host takes its
/// layers and, its experts then in q4_1, runs the q4k steps without; the
/// second never replays a graph).
#[test]
fn re_isq_quantizes_the_served_model_again() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let chats = golden_chats(&fixture)?;
    let requantized = |args: &[&str]| -> Result<(Vec<Value>, Vec<Value>)> {
        let server = Server::start(&fixture.model_dir, args)?;
        let before = tokens_and_logprobs(&server, &chats)?;
        let (status, response) = server.post_raw("/re_isq", r#"{"ggml_type": "q4k"}"#)?;
        anyhow::ensure!(status == 200, "POST /re_isq: HTTP {status}: {response}");
        server.wait_for_log("Finished quantization pass", Duration::from_secs(120))?;
        let after = tokens_and_logprobs(&server, &chats)?;
        Ok((before, after))
    };
    let (q8_0, q4k) = requantized(&["--dtype", "bf16", "--isq", "q8_0"])?;
    assert_ne!(
        q8_0, q4k,
        "the log-probabilities of q8_0 after re-quantizing to q4k"
    );
    let (_, q4k_eager) = requantized(&["--dtype", "bf16", "--isq", "q8_0", "--paged-attn", "off"])?;
    assert_eq!(tokens(&q4k), tokens(&q4k_eager));
    Ok(())
}

/// The host quantizes while loading on a thread pool and holds each layer as
/// a placeholder that waits for its quantization; through it, as through a
/// layer loaded from UQFF, every quantized projection must hand out its q8_0
/// blocks (on CUDA, BerryLM's decode kernels run on them; a projection
/// without them falls back to the host's quantized matmul, which rounds its
/// inputs to q8_1).
#[test]
fn every_projection_quantized_while_loading_hands_out_its_gguf_blocks() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let (mut model, report) = berrylm::driver::load_checkpoint_quantized(
        &fixture.model_dir,
        DType::F32,
        &Device::Cpu,
        IsqType::Q8_0,
    )?;
    let (expected_projections, _) = quantized_projections(&fixture)?;
    assert_eq!(report.quantized, expected_projections);
    let mut with_blocks = 0;
    for (layer, index) in model.host_layers_mut() {
        let (blocks, _) = layer
            .gguf_blocks()
            .with_context(|| format!("a projection of layer {index:?} holds no GGUF blocks"))?;
        assert_eq!(blocks.dtype(), GgmlDType::Q8_0, "layer {index:?}");
        with_blocks += layer.projections();
    }
    assert_eq!(with_blocks, expected_projections);
    Ok(())
}
