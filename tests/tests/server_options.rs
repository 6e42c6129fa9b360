//! Host options BerryLM cannot honour fail at load, naming the option,
//! instead of being ignored.

use anyhow::Result;
use berrylm_tests::fixtures_dir;
use berrylm_tests::server::Server;

/// `--isq`: the host would load the weights unquantized and serve them so.
#[test]
fn in_situ_quantization_is_refused_at_load() -> Result<()> {
    let model = fixtures_dir().join("trained-tiny/model");
    let Err(error) = Server::start(&model, &["--isq", "q8_0"]) else {
        panic!("the server came up with --isq q8_0, which BerryLM does not apply");
    };
    let message = format!("{error:#}");
    assert!(
        message.contains("exited") && message.contains("does not support in-situ quantization"),
        "expected the server to exit naming in-situ quantization:\n{message}"
    );
    assert!(
        !message.contains("panicked at"),
        "the server panicked:\n{message}"
    );
    Ok(())
}
