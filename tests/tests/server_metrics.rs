//! `/metrics` through the real server (CPU, the bundled model): occupancy
//! gauges, latency histograms, finished sequences by reason and generated
//! tokens agree with what the requests got back, and the pools it reports are
//! free again once the requests are done.

use std::collections::BTreeMap;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use berrylm_tests::fixtures_dir;
use berrylm_tests::metrics::{
    finished_for, recurrent_bytes_per_sequence, ITL, RSS, RUNNING, SLOTS_IN_USE, SLOTS_TOTAL,
    TOKENS, TTFT, WAITING,
};
use berrylm_tests::server::Server;

type Metrics = BTreeMap<String, f64>;

fn value(metrics: &Metrics, name: &str) -> f64 {
    *metrics
        .get(name)
        .unwrap_or_else(|| panic!("/metrics has no {name}: {metrics:#?}"))
}

fn finished(metrics: &Metrics, reason: &str) -> f64 {
    value(metrics, &finished_for(reason))
}

/// Polls `/metrics` until no sequence runs or waits and the recurrent slots
/// are free.
fn wait_until_idle(server: &Server) -> Result<Metrics> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let metrics = server.metrics()?;
        if value(&metrics, RUNNING) == 0.0
            && value(&metrics, WAITING) == 0.0
            && value(&metrics, SLOTS_IN_USE) == 0.0
        {
            return Ok(metrics);
        }
        if Instant::now() > deadline {
            bail!("the server was not idle 2 minutes after its requests: {metrics:#?}");
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// A histogram's buckets are cumulative, end at `+Inf` with its count, and
/// its sum is positive when it has observations.
fn assert_histogram(metrics: &Metrics, name: &str, count: f64) {
    let buckets: Vec<f64> = metrics
        .iter()
        .filter(|(key, _)| key.starts_with(&format!("{name}_bucket{{")))
        .map(|(_, value)| *value)
        .collect();
    assert!(buckets.len() > 10, "{name}: {} buckets", buckets.len());
    let infinity = value(metrics, &format!("{name}_bucket{{le=\"+Inf\"}}"));
    assert!(
        buckets.iter().all(|bucket| *bucket <= infinity),
        "{name}: a bucket holds more than +Inf"
    );
    assert_eq!(infinity, count, "{name}: +Inf bucket");
    assert_eq!(
        value(metrics, &format!("{name}_count")),
        count,
        "{name}_count"
    );
    assert_eq!(
        value(metrics, &format!("{name}_sum")) > 0.0,
        count > 0.0,
        "{name}_sum"
    );
}

#[test]
fn metrics_agree_with_the_requests_served_and_the_pools_are_free_afterwards() -> Result<()> {
    let server = Server::start(
        &fixtures_dir().join("trained-tiny/model"),
        &["--dtype", "f32"],
    )?;
    assert!(
        server.log().contains(&format!(
            "BerryLM: each sequence holds {} bytes",
            recurrent_bytes_per_sequence(&fixtures_dir().join("trained-tiny/model"))?
        )),
        "no or another recurrent state size in the log:\n{}",
        server.log()
    );
    let start = server.metrics()?;
    assert_eq!(value(&start, RUNNING), 0.0);
    assert_eq!(value(&start, WAITING), 0.0);
    assert_eq!(value(&start, SLOTS_IN_USE), 0.0);
    assert!(value(&start, SLOTS_TOTAL) >= 1.0);
    assert_eq!(value(&start, TOKENS), 0.0);
    assert!(
        value(&start, RSS) > 1e6,
        "resident memory {} bytes",
        value(&start, RSS)
    );
    assert!(
        !start
            .keys()
            .any(|key| key.starts_with("mistralrs:kv_cache_blocks")
                || key.starts_with("mistralrs:gpu_memory")),
        "KV blocks and GPU memory are reported without paged attention or CUDA: {start:#?}"
    );

    // Completions and chats at once, one of them finished by the token its
    // prompt step samples (`max_tokens: 1`).
    let server = &server;
    let completions = [("1 2 3", 6), ("4 5 6 7", 6), ("8 9", 6), ("3 1 4", 1)];
    let answers: Vec<serde_json::Value> = thread::scope(|scope| {
        let completions = completions.map(|(prompt, max_tokens)| {
            scope.spawn(move || {
                server.post(
                    "/v1/completions",
                    &serde_json::json!({
                        "model": "default", "prompt": prompt, "temperature": 0.0,
                        "max_tokens": max_tokens,
                    }),
                )
            })
        });
        let chats = [7, 12].map(|a| {
            scope.spawn(move || {
                server.post(
                    "/v1/chat/completions",
                    &serde_json::json!({
                        "model": "default", "temperature": 0.0, "max_tokens": 200,
                        "messages": [{"role": "user", "content": format!("What is {a} + 5?")}],
                    }),
                )
            })
        });
        completions
            .into_iter()
            .chain(chats)
            .map(|handle| handle.join().expect("request thread panicked"))
            .collect::<Result<Vec<_>>>()
    })?
    .into_iter()
    .map(|(status, body)| {
        assert_eq!(status, 200, "{body}");
        body
    })
    .collect();
    let served = wait_until_idle(server)?;

    let completion_tokens: f64 = answers
        .iter()
        .map(|answer| answer["usage"]["completion_tokens"].as_f64().unwrap_or(0.0))
        .sum();
    let by_reason = |reason: &str| {
        answers
            .iter()
            .filter(|answer| answer["choices"][0]["finish_reason"] == reason)
            .count() as f64
    };
    assert!(by_reason("length") >= 1.0, "{answers:#?}");
    assert_eq!(
        by_reason("length") + by_reason("stop"),
        answers.len() as f64,
        "{answers:#?}"
    );
    assert_eq!(value(&served, TOKENS), completion_tokens);
    assert_eq!(finished(&served, "length"), by_reason("length"));
    assert_eq!(finished(&served, "stop"), by_reason("stop"));
    assert_eq!(finished(&served, "error"), 0.0);
    assert_eq!(finished(&served, "cancelled"), 0.0);
    assert_histogram(&served, TTFT, answers.len() as f64);
    assert_histogram(&served, ITL, completion_tokens - answers.len() as f64);

    // A client that hangs up mid-stream: its sequence is cancelled and its
    // slot freed.
    // (The bundled model continues this prompt for hundreds of tokens.)
    server.abandon_stream(
        "/v1/completions",
        &serde_json::json!({
            "model": "default", "temperature": 0.0, "max_tokens": 2000, "stream": true,
            "prompt": "GNU LESSER GENERAL PUBLIC LICENSE",
        }),
    )?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let after = loop {
        let metrics = wait_until_idle(server)?;
        if finished(&metrics, "cancelled") == 1.0 || Instant::now() > deadline {
            break metrics;
        }
        thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(finished(&after, "cancelled"), 1.0, "{after:#?}");
    assert_eq!(value(&after, SLOTS_IN_USE), 0.0);
    assert!(value(&after, SLOTS_TOTAL) >= 1.0);
    Ok(())
}
