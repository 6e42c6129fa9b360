//! Every name in registry.toml resolves through the host's loader lookup (and
//! its chat output parser registry) after `register()`, and a name the
//! registry does not hold does not (nor can it be selected as the parser).

use anyhow::Result;
use berrylm::Registry;
use mistralrs::{ModelDType, TextModelBuilder};
use mistralrs_core::plugin_api::{
    chat_output_parser_named, lookup_normal_loader, registered_chat_output_parsers,
    select_chat_output_parser, ChatOutputRequest,
};
use mistralrs_core::ToolChoice;

/// Loads, through the host, a folder holding `config.json` and the tokenizer
/// and weights of the small-hybrid fixture (which do not fit a default-shaped
/// config), and returns the error.
async fn load_error(config: serde_json::Value) -> String {
    let dir = std::env::temp_dir().join(format!(
        "berrylm-registration-{}-{}",
        std::process::id(),
        config.to_string().len()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config");
    let tokenizer_source = berrylm_tests::fixtures_dir().join("small-hybrid/model");
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        std::fs::copy(tokenizer_source.join(file), dir.join(file)).expect("copy tokenizer");
    }
    let result = TextModelBuilder::new(dir.display().to_string())
        .with_dtype(ModelDType::F32)
        .build()
        .await;
    let _ = std::fs::remove_dir_all(&dir);
    match result {
        Ok(_) => panic!("a folder without weights loaded"),
        Err(error) => format!("{error:#}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn registered_names_resolve_and_unknown_names_do_not() -> Result<()> {
    berrylm::register()?;
    let registry = Registry::bundled()?;
    assert_eq!(registry.host.version, "0.8.1");
    for model_type in &registry.model.model_types {
        let config = serde_json::json!({ "model_type": model_type });
        assert!(
            lookup_normal_loader(&config.to_string()).is_some(),
            "{model_type}"
        );
    }
    for architecture in &registry.model.architectures {
        let config = serde_json::json!({ "architectures": [architecture] });
        assert!(
            lookup_normal_loader(&config.to_string()).is_some(),
            "{architecture}"
        );
        // Through the host's loader the model is recognised and the load
        // proceeds to the weights, which do not fit the default config.
        let error = load_error(serde_json::json!({ "architectures": [architecture] })).await;
        assert!(!error.contains("Unsupported"), "{architecture}: {error}");
    }
    let unknown = serde_json::json!({ "architectures": ["NotARealModelForCausalLM"], "model_type": "not_real" });
    assert!(lookup_normal_loader(&unknown.to_string()).is_none());
    let error = load_error(unknown).await;
    assert!(error.contains("NotARealModelForCausalLM"), "{error}");

    // The parsers: a request whose prompt opened `<think>` starts in reasoning.
    let request = ChatOutputRequest {
        prompt: "<|im_start|>assistant\n<think>\n",
        tools: &[],
        tool_choice: &ToolChoice::Auto,
    };
    for name in [&registry.parsers.reasoning, &registry.parsers.tool_call] {
        let mut parser = chat_output_parser_named(name, &request)
            .unwrap_or_else(|| panic!("parser {name} is not registered"));
        let parsed = parser.parse_complete("Thinking.\n</think>\n\nHi.");
        assert_eq!(
            parsed.reasoning_content.as_deref().map(str::trim),
            Some("Thinking.")
        );
        assert_eq!(parsed.content.as_deref().map(str::trim), Some("Hi."));
    }
    assert!(chat_output_parser_named("not_a_parser", &request).is_none());

    // What `--reasoning-parser` / `--tool-call-parser` read: the registered
    // names, and an error listing them for a name not among them.
    let registered = registered_chat_output_parsers();
    assert!(
        registered.contains(&registry.parsers.tool_call),
        "{registered:?}"
    );
    let error = select_chat_output_parser("not_a_parser").unwrap_err();
    assert_eq!(error.registered, registered);
    assert!(
        error.to_string().contains(&registry.parsers.tool_call),
        "{error}"
    );
    Ok(())
}
