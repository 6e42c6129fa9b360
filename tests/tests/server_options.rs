//! Host options BerryLM cannot honour fail at load, naming the option,
//! instead of being ignored; the others change nothing in its answers.

use anyhow::{Context, Result};
use berrylm_tests::chat::{chat_answer, comparable, golden_chat_request};
use berrylm_tests::server::Server;
use berrylm_tests::{fixtures_dir, Fixture, TempDir};

/// Starts the bundled model with `args`, which must fail at load with an
/// error naming `option`.
fn assert_refused(args: &[&str], option: &str) -> Result<()> {
    let model = fixtures_dir().join("trained-tiny/model");
    let Err(error) = Server::start(&model, args) else {
        panic!("the server came up with {args:?}, which BerryLM does not honour");
    };
    let message = format!("{error:#}");
    assert!(
        message.contains("exited") && message.contains(option),
        "expected the server to exit naming {option}:\n{message}"
    );
    assert!(
        !message.contains("panicked at"),
        "the server panicked:\n{message}"
    );
    Ok(())
}

/// An imatrix asks the host to quantize after loading the whole checkpoint.
#[test]
fn an_imatrix_is_refused_at_load() -> Result<()> {
    let imatrix = std::env::temp_dir().join(format!("berrylm-{}.imatrix", std::process::id()));
    assert_refused(
        &["--isq", "q4k", "--imatrix", &imatrix.to_string_lossy()],
        "`--imatrix`",
    )
}

/// A calibration file asks the host to collect an imatrix by running the model.
#[test]
fn a_calibration_file_is_refused_at_load() -> Result<()> {
    let dir = TempDir::new("berrylm-calibration")?;
    let calibration = dir.0.join("calibration.txt");
    std::fs::write(&calibration, "What is the weather in Oslo?")?;
    assert_refused(
        &[
            "--isq",
            "q4k",
            "--calibration-file",
            &calibration.to_string_lossy(),
        ],
        "`--calibration-file`",
    )
}

/// mistral.rs 0.8.1's `serve` parses `--mcp-port` but runs no MCP protocol
/// server on it.
#[test]
fn an_mcp_port_is_refused_at_start() -> Result<()> {
    assert_refused(&["--mcp-port", "4321"], "`--mcp-port 4321`")
}

/// An MCP client configuration the server cannot read fails naming the
/// option and the file (0.8.1 ignored `--mcp-config` altogether).
#[test]
fn an_mcp_config_that_cannot_be_read_is_refused_naming_it() -> Result<()> {
    let dir = TempDir::new("berrylm-mcp-config")?;
    let missing = dir.0.join("no-such.json");
    assert_refused(
        &["--mcp-config", &missing.to_string_lossy()],
        "`--mcp-config`",
    )?;
    let malformed = dir.0.join("mcp.json");
    std::fs::write(&malformed, r#"{"servers": []}"#)?;
    assert_refused(
        &["--mcp-config", &malformed.to_string_lossy()],
        "is not an MCP client configuration",
    )
}

/// A device map that leaves layers on the CPU next to a GPU: BerryLM runs
/// every layer on one device. The host maps only where a GPU is, so this runs
/// on the GPU machine (`test-server_options --ignored`).
#[test]
#[ignore = "needs a CUDA build of the host and a GPU; run on the GPU machine"]
fn a_device_map_over_several_devices_is_refused_at_load() -> Result<()> {
    assert_refused(&["--device-layers", "0:4"], "`--device-layers`")
}

/// `--no-kv-cache`: the host keeps no cache and every step recomputes each
/// sequence from its first token, without recurrent state slots; the
/// recurrent layers then run on slots taken for the step. The golden chats
/// (reasoning, tool calls, final answers) get the greedy answers of the
/// cached server, streamed and not.
#[test]
fn without_a_kv_cache_the_golden_chats_get_the_cached_answers() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let sequences = fixture.facts["sequences"]
        .as_array()
        .context("golden sequences")?;
    let answers = |args: &[&str]| -> Result<Vec<serde_json::Value>> {
        let server = Server::start(&fixture.model_dir, args)?;
        let mut answers = Vec::new();
        for sequence in sequences {
            for stream in [false, true] {
                let (message, finish_reason) =
                    chat_answer(&server, &golden_chat_request(sequence, 64, stream)?)?;
                answers.push(comparable(&message, &finish_reason));
            }
        }
        Ok(answers)
    };
    let cached = answers(&["--dtype", "f32"])?;
    assert_eq!(answers(&["--dtype", "f32", "--no-kv-cache"])?, cached);
    Ok(())
}
