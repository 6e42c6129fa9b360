//! `GET /metrics`: the engine's serving metrics in the Prometheus text
//! exposition format (0.0.4), named as vLLM names its own with a `mistralrs:`
//! prefix. Gauges of pools a server does not have (the recurrent-state slots
//! of a model without recurrent layers, KV blocks without paged attention,
//! device memory off CUDA) are left out rather than reported as 0.

use std::fmt::Write;

use axum::http::header;
use axum::response::IntoResponse;
use mistralrs_core::metrics::{snapshot, FinishReason, Histogram, MetricsSnapshot};

const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The handler of `GET /metrics`.
pub async fn metrics() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], render(&snapshot()))
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn gauge(out: &mut String, name: &str, help: &str, value: impl std::fmt::Display) {
    header(out, name, "gauge", help);
    let _ = writeln!(out, "{name} {value}");
}

fn histogram(out: &mut String, name: &str, help: &str, histogram: &Histogram) {
    header(out, name, "histogram", help);
    let mut cumulative = 0;
    for (bound, count) in histogram.bounds.iter().zip(&histogram.counts) {
        cumulative += count;
        let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", histogram.count);
    let _ = writeln!(out, "{name}_sum {}", histogram.sum_seconds);
    let _ = writeln!(out, "{name}_count {}", histogram.count);
}

/// `snapshot` in the Prometheus text format.
pub fn render(snapshot: &MetricsSnapshot) -> String {
    let mut out = String::new();
    gauge(
        &mut out,
        "mistralrs:num_requests_running",
        "Sequences in the running batch.",
        snapshot.running,
    );
    gauge(
        &mut out,
        "mistralrs:num_requests_waiting",
        "Sequences waiting to be scheduled.",
        snapshot.waiting,
    );
    if let Some(slots) = snapshot.recurrent_slots {
        gauge(
            &mut out,
            "mistralrs:recurrent_state_slots_in_use",
            "Recurrent-state slots of the hybrid cache held by sequences.",
            slots.in_use,
        );
        gauge(
            &mut out,
            "mistralrs:recurrent_state_slots_total",
            "Recurrent-state slots of the hybrid cache (the pool grows when full).",
            slots.total,
        );
    }
    if let Some(blocks) = snapshot.kv_blocks {
        gauge(
            &mut out,
            "mistralrs:kv_cache_blocks_in_use",
            "Paged KV-cache blocks held by sequences.",
            blocks.in_use,
        );
        gauge(
            &mut out,
            "mistralrs:kv_cache_blocks_total",
            "Paged KV-cache blocks.",
            blocks.total,
        );
    }
    histogram(
        &mut out,
        "mistralrs:time_to_first_token_seconds",
        "Time from a sequence's acceptance by the engine to its first token.",
        &snapshot.time_to_first_token,
    );
    histogram(
        &mut out,
        "mistralrs:inter_token_latency_seconds",
        "Time between two tokens of a sequence.",
        &snapshot.inter_token_latency,
    );
    let finished = "mistralrs:request_finished_total";
    header(
        &mut out,
        finished,
        "counter",
        "Sequences finished, by reason (stop, length, error, cancelled).",
    );
    for reason in FinishReason::ALL {
        let _ = writeln!(
            out,
            "{finished}{{finished_reason=\"{}\"}} {}",
            reason.as_str(),
            snapshot.finished[reason as usize]
        );
    }
    header(
        &mut out,
        "mistralrs:generation_tokens_total",
        "counter",
        "Tokens generated.",
    );
    let _ = writeln!(
        out,
        "mistralrs:generation_tokens_total {}",
        snapshot.generated_tokens
    );
    if let Some(bytes) = snapshot.resident_memory_bytes {
        gauge(
            &mut out,
            "mistralrs:process_resident_memory_bytes",
            "Resident memory of the server process.",
            bytes,
        );
    }
    if let Some(memory) = snapshot.device_memory_bytes {
        gauge(
            &mut out,
            "mistralrs:gpu_memory_used_bytes",
            "Memory in use on the engine's CUDA device (all processes).",
            memory.in_use,
        );
        gauge(
            &mut out,
            "mistralrs:gpu_memory_total_bytes",
            "Memory of the engine's CUDA device.",
            memory.total,
        );
    }
    out
}
