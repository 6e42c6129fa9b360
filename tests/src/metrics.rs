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
