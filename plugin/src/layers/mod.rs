//! BerryLM's components, one per file.

pub mod attention;
pub mod attn_res;
pub mod kda;
pub mod linear;
pub mod moe;
pub mod norm;
pub mod ops;
pub mod projection;
pub mod rope;
