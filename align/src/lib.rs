//! The modes, statistics and report of `berrylm-align` (the binary is
//! `main.rs`). The tests share [`modes::greedy_completion`], the engine's
//! greedy completion of a prompt.

pub mod args;
pub mod corpus;
pub mod dump;
pub mod modes;
pub mod report;
pub mod stats;
