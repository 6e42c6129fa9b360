//! Greedy generation through the host engine (the loader registry, the
//! scheduler, the hybrid cache manager, the sampler) reproduces the
//! reference's greedy tokens on every fixture, up to the first EOS.

use anyhow::{Context, Result};
use berrylm_align::modes::greedy_completion;
use berrylm_tests::{Fixture, FIXTURES};
use mistralrs::{ModelDType, TextModelBuilder};

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
        let text = greedy_completion(&model, prompt, expected.len()).await?;
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
