//! KDA forget gate and write strength (spec 3.6 step 3).

use candle_core::{DType, Tensor};

use crate::{
    ensure, expect_dim, expect_on_device, float_dims, tensor_from_f32, to_f32_vec, Result,
};

const OP: &str = "kda_gate";
const BETA_OP: &str = "kda_beta";

/// Inputs above this value make softplus return its input (PyTorch's
/// `F.softplus(x, beta=1, threshold=20)`).
const SOFTPLUS_THRESHOLD: f32 = 20.0;

/// Computes the KDA forget gate in `f32`:
/// `g[n, h, c] = -exp(a_log[h]) * softplus(raw[n, h*dk + c] + dt_bias[h*dk + c])`,
/// then, when `lower_bound` is `Some(lb)`, `g = max(g, lb)`.
///
/// * `raw`: `[N, Hv*dk]`, any float dtype (the `f_up(f_down(x))` projection).
/// * `a_log`: `[Hv]`.
/// * `dt_bias`: `[Hv*dk]`.
/// * `num_heads`: `Hv`; it must divide the width of `raw`.
///
/// Returns `[N, Hv, dk]` in `f32`.
pub fn kda_gate(
    raw: &Tensor,
    a_log: &Tensor,
    dt_bias: &Tensor,
    num_heads: usize,
    lower_bound: Option<f32>,
) -> Result<Tensor> {
    let args = KdaGateArgs::validate(raw, a_log, dt_bias, num_heads, lower_bound)?;
    on_device!(OP, raw.device(), args.cpu(), args.cuda())
}

/// The validated arguments of a [`kda_gate`] call and its sizes: `raw`
/// `[tokens, num_heads * head_dim]`.
pub(crate) struct KdaGateArgs<'a> {
    pub raw: &'a Tensor,
    pub a_log: &'a Tensor,
    pub dt_bias: &'a Tensor,
    pub tokens: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub lower_bound: Option<f32>,
}

impl<'a> KdaGateArgs<'a> {
    /// Checks the arguments of a [`kda_gate`] call and derives its sizes.
    fn validate(
        raw: &'a Tensor,
        a_log: &'a Tensor,
        dt_bias: &'a Tensor,
        num_heads: usize,
        lower_bound: Option<f32>,
    ) -> Result<Self> {
        let [tokens, width] = float_dims::<2>(OP, "raw", raw)?;
        let [a_log_len] = float_dims::<1>(OP, "a_log", a_log)?;
        let [dt_bias_len] = float_dims::<1>(OP, "dt_bias", dt_bias)?;
        let divides = num_heads > 0 && width > 0 && width % num_heads == 0;
        ensure(divides, OP, "num_heads", || {
            format!("{num_heads} must be positive and divide the positive width {width} of `raw`")
        })?;
        expect_dim(OP, "a_log", "length", a_log_len, num_heads)?;
        expect_dim(OP, "dt_bias", "length", dt_bias_len, width)?;
        expect_on_device(OP, raw.device(), [("a_log", a_log), ("dt_bias", dt_bias)])?;
        Ok(Self {
            raw,
            a_log,
            dt_bias,
            tokens,
            num_heads,
            head_dim: width / num_heads,
            lower_bound,
        })
    }

    /// The CPU reference.
    fn cpu(&self) -> Result<Tensor> {
        let (tokens, num_heads, head_dim) = (self.tokens, self.num_heads, self.head_dim);
        let raw = to_f32_vec(self.raw)?;
        let a_log = to_f32_vec(self.a_log)?;
        let dt_bias = to_f32_vec(self.dt_bias)?;
        let width = num_heads * head_dim;
        let mut gate = Vec::with_capacity(raw.len());
        for token_row in raw.chunks_exact(width) {
            for (channel, &value) in token_row.iter().enumerate() {
                let decay_rate = -a_log[channel / head_dim].exp();
                let unclamped = decay_rate * softplus(value + dt_bias[channel]);
                gate.push(match self.lower_bound {
                    Some(bound) if unclamped < bound => bound,
                    _ => unclamped,
                });
            }
        }
        tensor_from_f32(gate, &[tokens, num_heads, head_dim], DType::F32)
    }
}

/// `ln(1 + exp(x))`, or `x` itself above [`SOFTPLUS_THRESHOLD`].
fn softplus(x: f32) -> f32 {
    if x > SOFTPLUS_THRESHOLD {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The KDA write strength `beta = sigmoid(b)`, computed in `f32` as
/// `1 / (exp(-b) + 1)` (the reference's `b.float().sigmoid()`; candle's CPU
/// sigmoid evaluates the same expression).
///
/// * `b`: any shape, any float dtype (the `in_proj_b` projection).
///
/// Returns a tensor of the shape of `b` in `f32`, one launch on CUDA.
pub fn kda_beta(b: &Tensor) -> Result<Tensor> {
    crate::expect_float_dtype(BETA_OP, "b", b.dtype())?;
    on_device!(
        BETA_OP,
        b.device(),
        {
            let beta = to_f32_vec(b)?
                .into_iter()
                .map(|x| 1.0 / ((-x).exp() + 1.0))
                .collect();
            tensor_from_f32(beta, b.dims(), DType::F32)
        },
        crate::cuda::kda_beta(b),
    )
}
