use berrylm_kernels::{kda_beta, kda_gate, Result};
use candle_core::DType;

use crate::common::{assert_close, f32_values, tensor, Rng};

const TOKENS: usize = 5;
const HEADS: usize = 3;
const HEAD_DIM: usize = 4;
const WIDTH: usize = HEADS * HEAD_DIM;

struct GateInputs {
    raw: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
}

/// Random inputs like the model's: `A_log = ln U(1, 16)`, plus a few raw
/// values beyond the softplus threshold of 20, one of them large enough for
/// `exp` to overflow in `f32` without the threshold.
fn inputs(seed: u64) -> GateInputs {
    let mut rng = Rng::new(seed);
    let mut raw = rng.uniform_vec(TOKENS * WIDTH, -6.0, 6.0);
    raw[0] = 30.0;
    raw[WIDTH + 1] = 21.5;
    raw[2 * WIDTH + 2] = -25.0;
    raw[3 * WIDTH + 3] = 120.0;
    let a_log = (0..HEADS).map(|_| rng.uniform(1.0, 16.0).ln()).collect();
    let dt_bias = rng.uniform_vec(WIDTH, -4.0, 0.5);
    GateInputs {
        raw,
        a_log,
        dt_bias,
    }
}

fn reference(inputs: &GateInputs, lower_bound: Option<f64>) -> Vec<f64> {
    let mut gate = Vec::new();
    for n in 0..TOKENS {
        for h in 0..HEADS {
            for c in 0..HEAD_DIM {
                let channel = h * HEAD_DIM + c;
                let pre =
                    f64::from(inputs.raw[n * WIDTH + channel]) + f64::from(inputs.dt_bias[channel]);
                let softplus = if pre > 20.0 {
                    pre
                } else {
                    (1.0 + pre.exp()).ln()
                };
                let value = -f64::from(inputs.a_log[h]).exp() * softplus;
                gate.push(lower_bound.map_or(value, |bound| value.max(bound)));
            }
        }
    }
    gate
}

fn run(inputs: &GateInputs, raw_dtype: DType, lower_bound: Option<f32>) -> Result<Vec<f32>> {
    let raw = tensor(inputs.raw.clone(), &[TOKENS, WIDTH])?.to_dtype(raw_dtype)?;
    let a_log = tensor(inputs.a_log.clone(), &[HEADS])?;
    let dt_bias = tensor(inputs.dt_bias.clone(), &[WIDTH])?;
    let gate = kda_gate(&raw, &a_log, &dt_bias, HEADS, lower_bound)?;
    assert_eq!(gate.dims(), &[TOKENS, HEADS, HEAD_DIM]);
    assert_eq!(gate.dtype(), DType::F32);
    f32_values(&gate)
}

#[test]
fn matches_f64_reference() -> Result<()> {
    let inputs = inputs(1);
    let gate = run(&inputs, DType::F32, None)?;
    assert_close(&gate, &reference(&inputs, None), 1e-6, 1e-5);
    Ok(())
}

#[test]
fn lower_bound_clamps_only_values_below_it() -> Result<()> {
    let inputs = inputs(2);
    let lower_bound = -5.0;
    let unclamped = run(&inputs, DType::F32, None)?;
    let clamped = run(&inputs, DType::F32, Some(lower_bound))?;
    let below = unclamped.iter().filter(|&&g| g < lower_bound).count();
    assert!(
        below > 0 && below < unclamped.len(),
        "the bound must be active on some values only"
    );
    for (&free, &bounded) in unclamped.iter().zip(&clamped) {
        assert_eq!(
            bounded,
            if free < lower_bound {
                lower_bound
            } else {
                free
            }
        );
    }
    assert_close(&clamped, &reference(&inputs, Some(-5.0)), 1e-6, 1e-5);
    Ok(())
}

#[test]
fn half_precision_raw_is_upcast_exactly() -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        let mut inputs = inputs(3);
        let from_half = run(&inputs, dtype, None)?;
        inputs.raw = f32_values(&tensor(inputs.raw.clone(), &[TOKENS * WIDTH])?.to_dtype(dtype)?)?;
        let from_rounded_f32 = run(&inputs, DType::F32, None)?;
        assert_eq!(from_half, from_rounded_f32, "{dtype:?}");
    }
    Ok(())
}

/// `sigmoid(b)` in f32 from every float dtype, against f64 (the extremes
/// saturate to 0 and 1 without NaN).
#[test]
fn beta_is_the_f32_sigmoid() -> Result<()> {
    let mut values = Rng::new(7).uniform_vec(30, -12.0, 12.0);
    values.extend([0.0, -100.0, 100.0]);
    let b = tensor(values.clone(), &[11, 3])?;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let b = b.to_dtype(dtype)?;
        let beta = kda_beta(&b)?;
        assert_eq!(beta.dims(), &[11, 3]);
        assert_eq!(beta.dtype(), DType::F32);
        let expected: Vec<f64> = f32_values(&b)?
            .iter()
            .map(|&x| 1.0 / (1.0 + (-f64::from(x)).exp()))
            .collect();
        assert_close(&f32_values(&beta)?, &expected, 1e-7, 1e-6);
    }
    Ok(())
}
