//! The host CLI's own commands besides `serve` on the bundled model: `mistralrs
//! run` (one question with `-i`, or a chat read from standard input) prints
//! the reference's greedy reasoning and answer, and `mistralrs bench` reports
//! its prefill and decode rows.

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::{Context, Result};
use berrylm_tests::{fixtures_dir, host_binary, run_successfully, without_ansi_escapes, Fixture};

/// `mistralrs <command> --dtype f32 -m <the bundled model>` with `args`, the
/// host's log kept to errors (it writes to standard error).
fn host_command(command: &str, args: &[&str]) -> Result<Command> {
    let mut host = Command::new(host_binary()?);
    host.args([command, "--dtype", "f32", "-m"])
        .arg(fixtures_dir().join("trained-tiny/model"))
        .args(args)
        .env("RUST_LOG", "error");
    Ok(host)
}

/// Asserts that `output` holds the reference's reasoning and then its answer
/// to golden sequence `index`, after `from` (a byte offset); returns where
/// the answer ends.
fn assert_answer(fixture: &Fixture, index: usize, output: &str, from: usize) -> Result<usize> {
    let (reasoning, answer) = fixture.reference_answer(index)?;
    let reasoning_at = from
        + output[from..].find(&reasoning).with_context(|| {
            format!("no reasoning {reasoning:?} after byte {from} of:\n{output}")
        })?;
    let answer_from = reasoning_at + reasoning.len();
    let answer_at = answer_from
        + output[answer_from..]
            .find(&answer)
            .with_context(|| format!("no answer {answer:?} after the reasoning in:\n{output}"))?;
    Ok(answer_at + answer.len())
}

#[test]
fn run_answers_one_question_with_the_reference_reasoning_and_answer() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let question = fixture.facts["sequences"][0]["messages"][0]["content"]
        .as_str()
        .context("sequence 0's question")?;
    let output = run_successfully(&mut host_command("run", &["-i", question])?)?;
    assert_answer(&fixture, 0, &without_ansi_escapes(&output), 0)?;
    Ok(())
}

/// Interactive mode, its input piped: a greeting, `/clear` (a new
/// conversation), then the arithmetic question; each answer is the
/// reference's to that chat alone. The end of the input ends the session.
#[test]
fn run_chats_from_standard_input_turn_by_turn() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let question = |index: usize| {
        fixture.facts["sequences"][index]["messages"][0]["content"]
            .as_str()
            .with_context(|| format!("sequence {index}'s question"))
    };
    let mut child = host_command("run", &[])?
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting mistralrs run")?;
    let input = format!("{}\n/clear\n{}\n", question(1)?, question(0)?);
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(input.as_bytes())?;
    let output = child.wait_with_output()?;
    let stdout = without_ansi_escapes(&String::from_utf8_lossy(&output.stdout));
    assert!(
        output.status.success(),
        "mistralrs run failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let greeting_end = assert_answer(&fixture, 1, &stdout, 0)?;
    assert_answer(&fixture, 0, &stdout, greeting_end)?;
    Ok(())
}

#[test]
fn bench_reports_prefill_and_decode_rates() -> Result<()> {
    let output = run_successfully(&mut host_command(
        "bench",
        &["--prompt-len", "64", "--gen-len", "16", "--iterations", "2"],
    )?)?;
    for row in ["Prefill (64 tokens)", "Decode (16 tokens)"] {
        let line = output
            .lines()
            .find(|line| line.contains(row))
            .with_context(|| format!("no {row:?} row in:\n{output}"))?;
        // `│ Prefill (64 tokens) ┆ 1802.2 ± 38.8 ┆ 35.53 ms (TTFT) │`
        let rate: f64 = line
            .split('┆')
            .nth(1)
            .and_then(|cell| cell.split_whitespace().next())
            .and_then(|value| value.parse().ok())
            .with_context(|| format!("no tokens/s in {line:?}"))?;
        assert!(rate > 0.0, "{line}");
    }
    Ok(())
}
