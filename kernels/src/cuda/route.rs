//! Binding of `route.cu`: the MoE router.
//!
//! The logits are read in place when their rows lie at a stride (the router's
//! columns of the MoE's stacked input projection, at more than one token).

use std::ffi::{c_int, c_void};

use candle_core::{DType, Tensor};

use super::{c_size, dtype_code, Launch};
use crate::route::MoeRouteArgs;
use crate::{invalid_argument, Result};

/// The most experts `moe_route` takes on CUDA (`kMaxExperts` in route.cu: one
/// thread per expert in a block).
const MAX_MOE_EXPERTS: usize = 512;

extern "C" {
    fn berrylm_moe_route(
        logits_dtype: c_int,
        logits: *const c_void,
        logits_stride: i64,
        weights: *mut f32,
        ids: *mut u32,
        rows: i64,
        experts: c_int,
        top_k: c_int,
        renormalize: c_int,
        weight_dtype: c_int,
        stream: *mut c_void,
    ) -> c_int;
}

impl MoeRouteArgs<'_> {
    /// CUDA `moe_route`; arguments already validated by the caller.
    pub(crate) fn cuda(&self) -> Result<(Tensor, Tensor)> {
        const OP: &str = "moe_route";
        let (rows, experts, top_k) = (self.rows, self.experts, self.top_k);
        if experts > MAX_MOE_EXPERTS {
            return Err(invalid_argument(
                OP,
                "router_logits",
                format!("{experts} experts exceed the CUDA kernel's maximum {MAX_MOE_EXPERTS}"),
            ));
        }
        if rows > i32::MAX as usize {
            return Err(invalid_argument(
                OP,
                "router_logits",
                format!("{rows} rows exceed the CUDA kernel's maximum {}", i32::MAX),
            ));
        }
        let mut launch = Launch::new(OP, self.router_logits)?;
        let (logits, logits_stride) = launch.input_rows("router_logits", self.router_logits)?;
        let logits_dtype = launch.dtype(logits);
        let weights = launch.output(&[rows, top_k], DType::F32)?;
        let ids = launch.output(&[rows, top_k], DType::U32)?;
        // SAFETY (with `run_kernel!`'s): `logits` is read as `rows` rows of `experts` elements,
        // `logits_stride` elements apart from its first element, which its layout spans.
        let outputs = run_kernel!(launch => berrylm_moe_route(
            dtype(logits_dtype), input(logits), logits_stride as i64, output(weights), output(ids),
            rows as i64,
            c_size(OP, "router_logits", experts)?,
            c_size(OP, "top_k", top_k)?,
            c_int::from(self.renormalize),
            dtype(self.weight_dtype)
        ))?;
        Ok((outputs.tensor(weights), outputs.tensor(ids)))
    }
}
