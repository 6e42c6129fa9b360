//! Names of the series the server's `GET /metrics` reports (the seam's
//! metrics endpoint, docs/host-seam.md).

pub const RUNNING: &str = "mistralrs:num_requests_running";
pub const WAITING: &str = "mistralrs:num_requests_waiting";
pub const SLOTS_IN_USE: &str = "mistralrs:recurrent_state_slots_in_use";
pub const SLOTS_TOTAL: &str = "mistralrs:recurrent_state_slots_total";
pub const KV_BLOCKS_IN_USE: &str = "mistralrs:kv_cache_blocks_in_use";
pub const TOKENS: &str = "mistralrs:generation_tokens_total";
pub const TTFT: &str = "mistralrs:time_to_first_token_seconds";
pub const ITL: &str = "mistralrs:inter_token_latency_seconds";
pub const RSS: &str = "mistralrs:process_resident_memory_bytes";

/// The series counting requests finished for `reason` (`stop`, `length`,
/// `error`, `cancelled`, ...).
pub fn finished_for(reason: &str) -> String {
    format!("mistralrs:request_finished_total{{finished_reason=\"{reason}\"}}")
}

/// The bytes of one sequence's recurrent state, from the checkpoint's
/// config (docs/spec: per KDA layer an f32 conv state over q|k|v, `(2 Hk dk +
/// Hv dv) x kernel`, and an f32 state `Hv x dk x dv`).
pub fn recurrent_bytes_per_sequence(model_dir: &std::path::Path) -> anyhow::Result<u64> {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model_dir.join("config.json"))?)?;
    let field = |name: &str| {
        config[name]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("config.json has no {name}"))
    };
    let (key_heads, key_dim) = (
        field("linear_num_key_heads")?,
        field("linear_key_head_dim")?,
    );
    let (value_heads, value_dim) = (
        field("linear_num_value_heads")?,
        field("linear_value_head_dim")?,
    );
    let kda_layers = config["layer_types"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("config.json has no layer_types"))?
        .iter()
        .filter(|kind| *kind == "linear_attention")
        .count() as u64;
    let conv =
        (2 * key_heads * key_dim + value_heads * value_dim) * field("linear_conv_kernel_dim")?;
    let state = value_heads * key_dim * value_dim;
    Ok(kda_layers * (conv + state) * 4)
}
