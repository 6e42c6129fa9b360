//! `cargo xtask parse`: what the server returns for a raw model output.

use std::io::Read;
use std::path::PathBuf;

use anyhow::{Context, Result};
use berrylm_parsers::{
    parse_message, BerryLmStreamParser, MessageAssembler, ParserOptions, RandomToolCallIds,
};

/// Characters fed per piece with `--stream`, so tags split across pieces.
const STREAM_PIECE_CHARS: usize = 3;

/// `cargo xtask parse`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct ParseOptions {
    /// The request's `tools`: a JSON array of OpenAI tool definitions
    #[arg(long, value_name = "FILE")]
    pub tools: Option<PathBuf>,
    /// The request disabled thinking (the template did not open `<think>`)
    #[arg(long)]
    pub no_thinking: bool,
    /// Also print the streamed deltas (one JSON object a line), feeding the
    /// output a few characters at a time
    #[arg(long)]
    pub stream: bool,
}

impl ParseOptions {
    pub fn thinking_enabled(&self) -> bool {
        !self.no_thinking
    }
}

/// Reads the model output from stdin and prints the OpenAI assistant message
/// (after one delta per line with `--stream`).
pub fn run(options: &ParseOptions) -> Result<()> {
    let tools = match &options.tools {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", path.display()))?
        }
        None => serde_json::Value::Null,
    };
    let parser_options = ParserOptions::from_request_tools(options.thinking_enabled(), &tools)
        .context("--tools must be a JSON array of OpenAI tool definitions")?;
    let mut output = String::new();
    std::io::stdin()
        .read_to_string(&mut output)
        .context("reading the model output from stdin")?;

    let message = if options.stream {
        let mut parser = BerryLmStreamParser::new(parser_options);
        let mut assembler = MessageAssembler::new();
        let chars: Vec<char> = output.chars().collect();
        let pieces = chars.chunks(STREAM_PIECE_CHARS).map(String::from_iter);
        let mut deltas = Vec::new();
        for piece in pieces {
            deltas.extend(parser.push(&piece));
        }
        deltas.extend(parser.finish());
        for delta in &deltas {
            println!("{}", serde_json::to_string(delta)?);
            assembler.push(delta);
        }
        assembler.finish()
    } else {
        parse_message(&output, &parser_options, RandomToolCallIds::default())
    };
    println!("{}", serde_json::to_string_pretty(&message)?);
    Ok(())
}
