//! Tests of every kernel against independent `f64` computations written here.

mod attn_res;
mod common;
mod conv;
mod errors;
mod gate;
mod norm;
mod recurrence;
mod route;
