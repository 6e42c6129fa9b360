//! Tests of every kernel against independent `f64` computations written here.

mod attention;
mod attn_res;
mod common;
mod conv;
mod errors;
mod gate;
mod gate_mul;
mod mlp;
mod moe;
mod norm;
mod paged_attention;
mod recurrence;
mod rope;
mod route;
