use berrylm_kernels::{add_moe_output, swiglu, Result};
use candle_core::{DType, Tensor, D};

use crate::common::{
    assert_close, assert_identical, assert_rejects, f64_values, silu, tensor, Rng,
};

const ROWS: usize = 5;
const INTERMEDIATE: usize = 12;
const HIDDEN: usize = 20;

fn random(rng: &mut Rng, dims: &[usize], low: f32, high: f32) -> Result<Tensor> {
    tensor(rng.uniform_vec(dims.iter().product(), low, high), dims)
}

#[test]
fn swiglu_f32_matches_f64_reference() -> Result<()> {
    let gate_up = random(&mut Rng::new(1), &[ROWS, 2 * INTERMEDIATE], -4.0, 4.0)?;
    let y = swiglu(&gate_up)?;
    assert_eq!(y.dims(), &[ROWS, INTERMEDIATE]);
    let values = f64_values(&gate_up)?;
    let expected: Vec<f64> = values
        .chunks_exact(2 * INTERMEDIATE)
        .flat_map(|row| (0..INTERMEDIATE).map(move |i| silu(row[i]) * row[INTERMEDIATE + i]))
        .collect();
    assert_close(&crate::common::f32_values(&y)?, &expected, 1e-6, 1e-5);
    Ok(())
}

/// PyTorch's `act_fn(gate) * up` in a half dtype, op by op with candle
/// tensors: SiLU in f32 rounded to the dtype, then the product in the dtype.
#[test]
fn swiglu_half_precision_rounds_like_the_reference_chain() -> Result<()> {
    let gate_up = random(&mut Rng::new(2), &[2, ROWS, 2 * INTERMEDIATE], -4.0, 4.0)?;
    for dtype in [DType::BF16, DType::F16] {
        let gate_up = gate_up.to_dtype(dtype)?;
        let gate = gate_up.narrow(D::Minus1, 0, INTERMEDIATE)?;
        let up = gate_up.narrow(D::Minus1, INTERMEDIATE, INTERMEDIATE)?;
        let activated = gate.to_dtype(DType::F32)?.silu()?.to_dtype(dtype)?;
        let expected = (activated * up)?;
        assert_identical(&swiglu(&gate_up)?, &expected)?;
    }
    Ok(())
}

fn moe_inputs(seed: u64) -> Result<[Tensor; 4]> {
    let mut rng = Rng::new(seed);
    Ok([
        random(&mut rng, &[ROWS, HIDDEN], -8.0, 8.0)?,
        random(&mut rng, &[ROWS, HIDDEN], -2.0, 2.0)?,
        random(&mut rng, &[ROWS, HIDDEN], -2.0, 2.0)?,
        random(&mut rng, &[ROWS, 1], -6.0, 6.0)?,
    ])
}

#[test]
fn add_moe_output_f32_matches_f64_reference() -> Result<()> {
    let [residual, routed, shared, logit] = moe_inputs(3)?;
    let y = add_moe_output(&residual, &routed, &shared, &logit)?;
    let (residual, routed, shared, logit) = (
        f64_values(&residual)?,
        f64_values(&routed)?,
        f64_values(&shared)?,
        f64_values(&logit)?,
    );
    let expected: Vec<f64> = (0..ROWS * HIDDEN)
        .map(|i| {
            let gate = 1.0 / (1.0 + (-logit[i / HIDDEN]).exp());
            residual[i] + routed[i] + gate * shared[i]
        })
        .collect();
    assert_close(&crate::common::f32_values(&y)?, &expected, 1e-5, 1e-5);
    Ok(())
}

/// The reference's chain in a half dtype, op by op with candle tensors:
/// `sigmoid` in f32 rounded to the dtype, then the product, the sum with the
/// routed output and the residual add, each in the dtype.
#[test]
fn add_moe_output_half_precision_rounds_like_the_reference_chain() -> Result<()> {
    let inputs = moe_inputs(4)?;
    for dtype in [DType::BF16, DType::F16] {
        let [residual, routed, shared, logit] = inputs
            .clone()
            .map(|t| t.to_dtype(dtype).expect("dtype conversion"));
        let gate = (logit.to_dtype(DType::F32)?.neg()?.exp()? + 1.0)?
            .recip()?
            .to_dtype(dtype)?;
        let moe = (&routed + shared.broadcast_mul(&gate)?)?;
        let expected = (&residual + moe)?;
        assert_identical(
            &add_moe_output(&residual, &routed, &shared, &logit)?,
            &expected,
        )?;
    }
    Ok(())
}

#[test]
fn bad_shapes_and_dtypes_are_rejected_with_the_argument_named() -> Result<()> {
    let odd = random(&mut Rng::new(5), &[ROWS, 7], -1.0, 1.0)?;
    assert_rejects(swiglu(&odd), "swiglu", "gate_up");
    let [residual, routed, shared, logit] = moe_inputs(6)?;
    let cases = [
        (
            "gate_logit",
            add_moe_output(&residual, &routed, &shared, &logit.reshape(ROWS)?),
        ),
        (
            "shared",
            add_moe_output(&residual, &routed, &shared.to_dtype(DType::BF16)?, &logit),
        ),
        (
            "routed",
            add_moe_output(&residual, &routed.narrow(0, 0, 2)?, &shared, &logit),
        ),
    ];
    for (expected_arg, result) in cases {
        assert_rejects(result, "add_moe_output", expected_arg);
    }
    Ok(())
}
