//! Runs the host CLI (`mistralrs serve`) as a child process on loopback and
//! talks HTTP/1.1 to it with a minimal std-only client.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::{host_binary, without_ansi_escapes};

/// A running `mistralrs serve`; killed when dropped.
pub struct Server {
    child: Child,
    pub port: u16,
    log: std::path::PathBuf,
}

/// Host arguments every test server gets in addition to its own, from
/// `BERRYLM_SERVER_ARGS` (whitespace-separated): how the test executables run
/// on a GPU machine with paged attention on or off.
fn server_args_from_environment() -> Vec<String> {
    std::env::var("BERRYLM_SERVER_ARGS")
        .map(|args| args.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Server {
    /// Starts the server on `model_dir` and waits (up to 3 minutes) until it answers.
    pub fn start(model_dir: &Path, extra_args: &[&str]) -> Result<Server> {
        Server::start_with_environment(model_dir, extra_args, &[])
    }

    /// [`Server::start`] for a test that judges the server's resident memory:
    /// glibc's allocator raises its mmap threshold to the largest block freed
    /// so far (up to 32 MiB), after which large blocks come from the heap and
    /// may stay resident when freed, so the same traffic leaves resident
    /// memory 8 % above or below where another run leaves it. With a fixed
    /// threshold, blocks over 128 KiB stay mapped and freeing one returns it:
    /// resident memory follows what the server holds.
    pub fn start_measuring_memory(model_dir: &Path, extra_args: &[&str]) -> Result<Server> {
        Server::start_with_environment(
            model_dir,
            extra_args,
            &[
                ("MALLOC_MMAP_THRESHOLD_", "131072"),
                ("MALLOC_TRIM_THRESHOLD_", "131072"),
            ],
        )
    }

    /// [`Server::start`] with further environment variables for the server process.
    pub fn start_with_environment(
        model_dir: &Path,
        extra_args: &[&str],
        environment: &[(&str, &str)],
    ) -> Result<Server> {
        let port = free_port()?;
        let log = std::env::temp_dir().join(format!("berrylm-server-{port}.log"));
        let log_file = std::fs::File::create(&log)?;
        let child = Command::new(host_binary()?)
            .args([
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "-m",
            ])
            .arg(model_dir)
            .args(extra_args)
            .args(server_args_from_environment())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .stdin(Stdio::null())
            .env("RUST_LOG", "info,berrylm=debug")
            .envs(environment.iter().copied())
            .spawn()
            .context("starting mistralrs serve")?;
        let mut server = Server { child, port, log };
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            if let Ok((200, _)) = server.get("/v1/models") {
                return Ok(server);
            }
            if let Some(status) = server.child.try_wait()? {
                bail!("mistralrs serve exited with {status}:\n{}", server.log());
            }
            if Instant::now() > deadline {
                let log = server.log();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                bail!(
                    "mistralrs serve did not answer within 3 minutes; the end of its log ({}):\n{}",
                    server.log.display(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Connects and writes one HTTP/1.1 request (`Connection: close`); the
    /// response is for the caller to read, or not.
    pub fn open_request(&self, method: &str, path: &str, body: &str) -> Result<TcpStream> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        Ok(stream)
    }

    fn request(&self, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String)> {
        let stream = self.open_request(method, path, body.unwrap_or_default())?;
        stream.set_read_timeout(Some(Duration::from_secs(300)))?;
        let mut reader = BufReader::new(stream);
        let mut status_line = String::new();
        reader.read_line(&mut status_line)?;
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .context("no HTTP status")?
            .parse()?;
        let mut chunked = false;
        let mut length: Option<usize> = None;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line)?;
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let lower = line.to_ascii_lowercase();
            if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
                chunked = true;
            }
            if let Some(value) = lower.strip_prefix("content-length:") {
                length = value.trim().parse().ok();
            }
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                let mut size_line = String::new();
                reader.read_line(&mut size_line)?;
                let size = usize::from_str_radix(size_line.trim(), 16).unwrap_or(0);
                if size == 0 {
                    break;
                }
                let mut chunk = vec![0; size + 2];
                reader.read_exact(&mut chunk)?;
                body.extend_from_slice(&chunk[..size]);
            }
        } else if let Some(length) = length {
            body.resize(length, 0);
            reader.read_exact(&mut body)?;
        } else {
            reader.read_to_end(&mut body)?;
        }
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }

    /// The samples of the server's `/metrics` (Prometheus text), each value by
    /// its name and labels as the server writes them
    /// (`mistralrs:request_finished_total{finished_reason="stop"}`).
    pub fn metrics(&self) -> Result<BTreeMap<String, f64>> {
        let (status, text) = self.request("GET", "/metrics", None)?;
        anyhow::ensure!(status == 200, "GET /metrics: HTTP {status}: {text}");
        text.lines()
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .map(|line| {
                let (name, value) = line
                    .rsplit_once(' ')
                    .with_context(|| format!("a /metrics line without a value: {line:?}"))?;
                let value = value
                    .parse()
                    .with_context(|| format!("a /metrics value that is not a number: {line:?}"))?;
                Ok((name.to_string(), value))
            })
            .collect()
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident memory of the server process (`VmRSS` in `/proc/<pid>/status`), in KiB.
    pub fn resident_memory_kib(&self) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))?;
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
            .context("no VmRSS in /proc/<pid>/status")
    }

    /// Sends the server the signal `name` (`TERM`, `INT`, ...) with `kill`.
    pub fn signal(&self, name: &str) -> Result<()> {
        let status = std::process::Command::new("kill")
            .args(["-s", name, &self.pid().to_string()])
            .status()?;
        anyhow::ensure!(status.success(), "kill -s {name} {}: {status}", self.pid());
        Ok(())
    }

    /// Whether the server still accepts connections.
    pub fn accepts_connections(&self) -> bool {
        TcpStream::connect(("127.0.0.1", self.port)).is_ok()
    }

    /// Whether the server process is still running.
    pub fn is_running(&mut self) -> Result<bool> {
        Ok(self.child.try_wait()?.is_none())
    }

    /// The server's exit status, once it has exited within `timeout`.
    pub fn wait_for_exit(&mut self, timeout: Duration) -> Result<Option<std::process::ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() > deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The response to a greedy `/v1/completions` of `prompt` (at most
    /// `max_tokens`), which must be HTTP 200.
    pub fn completion(&self, prompt: &str, max_tokens: usize) -> Result<serde_json::Value> {
        let request = serde_json::json!({
            "model": "default",
            "prompt": prompt,
            "temperature": 0.0,
            "max_tokens": max_tokens,
        });
        let (status, response) = self.post("/v1/completions", &request)?;
        anyhow::ensure!(status == 200, "HTTP {status}: {response}");
        Ok(response)
    }

    /// The text of a greedy `/v1/completions` of `prompt` (at most `max_tokens`).
    pub fn complete(&self, prompt: &str, max_tokens: usize) -> Result<String> {
        let response = self.completion(prompt, max_tokens)?;
        Ok(response["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string())
    }

    /// [`Server::complete`] of every prompt, all sent at once (a thread
    /// each), in the prompts' order.
    pub fn complete_all_at_once(
        &self,
        prompts: &[String],
        max_tokens: usize,
    ) -> Result<Vec<String>> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = prompts
                .iter()
                .map(|prompt| scope.spawn(move || self.complete(prompt, max_tokens)))
                .collect();
            handles
                .into_iter()
                .map(|handle| handle.join().expect("request thread panicked"))
                .collect()
        })
    }

    /// What the server logged so far (`info`, and `debug` for berrylm).
    /// Terminal colour codes the host's logger writes are removed.
    pub fn log(&self) -> String {
        without_ansi_escapes(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    /// The forwards of prompts (more than one token) that started after
    /// position 0, from the log's `berrylm forward` lines: the prefix cache
    /// supplied the state of the positions before.
    pub fn prompt_forwards_after_a_cache_hit(&self) -> Vec<String> {
        self.log()
            .lines()
            .filter_map(|line| line.split("berrylm forward: ").nth(1))
            .filter(|rest| {
                let tokens: usize = rest
                    .split(" x ")
                    .nth(1)
                    .and_then(|t| t.split_whitespace().next()?.parse().ok())
                    .unwrap_or(0);
                let first_position = rest
                    .split("positions [")
                    .nth(1)
                    .and_then(|p| p.split([',', ']']).next()?.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                tokens > 1 && first_position > 0
            })
            .map(str::to_string)
            .collect()
    }

    /// Waits up to `timeout` for the log to contain `text`.
    pub fn wait_for_log(&self, text: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while !self.log().contains(text) {
            if Instant::now() > deadline {
                anyhow::bail!("no {text:?} in the server's log after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// The largest batch the model ran so far, from its debug log.
    pub fn largest_batch(&self) -> usize {
        self.log()
            .lines()
            .filter_map(|line| line.split("berrylm forward: ").nth(1))
            .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
            .max()
            .unwrap_or(0)
    }

    /// Opens a streaming POST, reads its first bytes and drops the connection
    /// (a client that disconnects mid-stream).
    pub fn abandon_stream(&self, path: &str, body: &serde_json::Value) -> Result<()> {
        let mut stream = self.open_request("POST", path, &body.to_string())?;
        let mut first = [0u8; 64];
        stream.read_exact(&mut first)?;
        Ok(())
    }

    /// The loaded model's entry in `GET /v1/models` (the list names the
    /// default alias first, then each model with its status).
    pub fn loaded_model(&self) -> Result<serde_json::Value> {
        let (_, models) = self.get("/v1/models")?;
        models["data"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|model| model["status"] == "loaded")
            .cloned()
            .with_context(|| format!("no loaded model in {models}"))
    }

    pub fn get(&self, path: &str) -> Result<(u16, serde_json::Value)> {
        let (status, body) = self.request("GET", path, None)?;
        Ok((
            status,
            serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body)),
        ))
    }

    /// POSTs `body` as it is (which need not be valid JSON) and returns the
    /// status and the response body's text.
    pub fn post_raw(&self, path: &str, body: &str) -> Result<(u16, String)> {
        self.request("POST", path, Some(body))
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> Result<(u16, serde_json::Value)> {
        let (status, text) = self.request("POST", path, Some(&body.to_string()))?;
        Ok((
            status,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        ))
    }

    /// POSTs `body` as it is to `path` and asserts an HTTP 4xx whose body is
    /// OpenAI's error object for a request's fault, its message mentioning
    /// `names`; `what` names the request in a failure.
    pub fn assert_rejected(&self, path: &str, body: &str, names: &str, what: &str) -> Result<()> {
        let (status, response) = self.post_raw(path, body)?;
        assert!(
            (400..500).contains(&status),
            "{what}: expected an HTTP 4xx, got {status}: {response}"
        );
        assert_client_error_object(&response, names, what);
        Ok(())
    }

    /// POSTs `body` to `path` and asserts an HTTP 422 (the request's fault,
    /// as the server refuses a parameter it cannot honour) whose body is
    /// OpenAI's error object, its message mentioning `names`.
    pub fn assert_unprocessable(
        &self,
        path: &str,
        body: &serde_json::Value,
        names: &str,
    ) -> Result<()> {
        let (status, response) = self.post_raw(path, &body.to_string())?;
        assert_eq!(status, 422, "{body}: {response}");
        assert_client_error_object(&response, names, &body.to_string());
        Ok(())
    }

    /// POSTs a streaming request and returns the `data:` payloads of the SSE stream.
    pub fn post_stream(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<(u16, Vec<serde_json::Value>)> {
        let (status, text) = self.request("POST", path, Some(&body.to_string()))?;
        let events = text
            .lines()
            .filter_map(|line| line.strip_prefix("data:"))
            .map(str::trim)
            .filter(|data| *data != "[DONE]")
            .filter_map(|data| serde_json::from_str(data).ok())
            .collect();
        Ok((status, events))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Asserts that `body` is OpenAI's error object for a request's fault
/// (`{"error": {"message", "type": "invalid_request_error", ...}}`) whose
/// message mentions `names`; `what` names the request in a failure.
pub fn assert_client_error_object(body: &str, names: &str, what: &str) {
    let parsed: serde_json::Value = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("{what}: the error body is not JSON ({e}): {body}"));
    let error = &parsed["error"];
    assert_eq!(
        error["type"], "invalid_request_error",
        "{what}: not an OpenAI error object for a request's fault: {body}"
    );
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(names),
        "{what}: the error's message does not mention {names:?}: {body}"
    );
}
