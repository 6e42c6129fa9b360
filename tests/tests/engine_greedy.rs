//! Greedy generation through the host engine (the loader registry, the
//! scheduler, the hybrid cache manager, the sampler) reproduces the
//! reference's greedy tokens on every fixture, up to the first EOS.

use anyhow::{bail, Context, Result};
use berrylm_tests::{Fixture, FIXTURES};
use mistralrs::{ModelDType, TextModelBuilder};
use mistralrs_core::{NormalRequest, Request, RequestMessage, Response, SamplingParams};

fn eos_ids(fixture: &Fixture) -> Vec<u32> {
    let path = fixture.model_dir.join("generation_config.json");
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    let Ok(config) = serde_json::from_str::<serde_json::Value>(&text) else {
        return Vec::new();
    };
    match &config["eos_token_id"] {
        serde_json::Value::Number(n) => n.as_u64().map(|id| vec![id as u32]).unwrap_or_default(),
        serde_json::Value::Array(ids) => ids
            .iter()
            .filter_map(|id| id.as_u64().map(|id| id as u32))
            .collect(),
        _ => Vec::new(),
    }
}

async fn greedy_text(model: &mistralrs::Model, prompt: Vec<u32>, max_len: usize) -> Result<String> {
    let (tx, mut rx) = tokio::sync::mpsc::channel(1);
    let mut sampling = SamplingParams::deterministic();
    sampling.max_len = Some(max_len);
    let request = NormalRequest::new_simple(
        RequestMessage::CompletionTokens(prompt),
        sampling,
        tx,
        0,
        None,
        None,
    );
    model
        .inner()
        .get_sender(None)?
        .send(Request::Normal(Box::new(request)))
        .await
        .context("sending the request")?;
    match rx.recv().await.context("no response")? {
        Response::CompletionDone(done) => Ok(done.choices[0].text.clone()),
        Response::CompletionModelError(message, _) => bail!("model error: {message}"),
        Response::InternalError(error) | Response::ValidationError(error) => bail!("{error}"),
        _ => bail!("unexpected response kind to a completion request"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn engine_greedy_generation_matches_reference() -> Result<()> {
    berrylm::register()?;
    for name in FIXTURES {
        let fixture = Fixture::load(name)?;
        let prompt = fixture.ids("gen.prompt_ids")?;
        let mut expected = fixture.ids("gen.output_ids")?;
        let eos = eos_ids(&fixture);
        let eos_position = expected.iter().position(|id| eos.contains(id));
        if let Some(position) = eos_position {
            expected.truncate(position + 1);
        }
        let model = TextModelBuilder::new(fixture.model_dir.display().to_string())
            .with_dtype(ModelDType::F32)
            .build()
            .await
            .with_context(|| format!("{name}: building the engine"))?;
        let text = greedy_text(&model, prompt, expected.len()).await?;
        // The engine may or may not render the final EOS token in the text, and
        // it trims leading whitespace from a completion.
        let with_eos = model.detokenize(expected.clone(), false).await?;
        let without_eos = match eos_position {
            Some(_) => {
                model
                    .detokenize(expected[..expected.len() - 1].to_vec(), false)
                    .await?
            }
            None => with_eos.clone(),
        };
        let (with_eos, without_eos) = (with_eos.trim_start(), without_eos.trim_start());
        assert!(
            text == with_eos || text == without_eos,
            "{name}: engine greedy text {text:?} differs from the reference {with_eos:?}"
        );
    }
    Ok(())
}
