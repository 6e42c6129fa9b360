use berrylm_kernels::{sigmoid_gate_mul, Result};
use candle_core::{DType, Device, Tensor};

use crate::common::{assert_close, assert_rejects, f32_values, f64_values, tensor, Rng};

const DIMS: [usize; 4] = [2, 3, 4, 16];

/// `x` `[2, 3, 4, 16]` contiguous, and a gate of that shape whose rows lie
/// 32 elements apart (the gate half of an interleaved `[2, 3, 4, 32]`
/// projection), both in `dtype`.
fn inputs(seed: u64, dtype: DType) -> Result<(Tensor, Tensor)> {
    let mut rng = Rng::new(seed);
    let len: usize = DIMS.iter().product();
    let x = tensor(rng.uniform_vec(len, -4.0, 4.0), &DIMS)?.to_dtype(dtype)?;
    let interleaved = tensor(
        rng.uniform_vec(2 * len, -8.0, 8.0),
        &[DIMS[0], DIMS[1], DIMS[2], 2 * DIMS[3]],
    )?;
    let gate = interleaved.to_dtype(dtype)?.narrow(3, DIMS[3], DIMS[3])?;
    Ok((x, gate))
}

/// The plugin's former `out * sigmoid(gate)`, op by op with candle tensors:
/// the sigmoid `1 / (exp(-g) + 1)` in f32 (candle's own sigmoid computes
/// exactly these operations), rounded to the dtype once, then the product
/// in the dtype.
#[test]
fn sigmoid_gate_mul_is_the_candle_op_composition() -> Result<()> {
    for (seed, dtype) in [(1, DType::F32), (2, DType::BF16), (3, DType::F16)] {
        let (x, gate) = inputs(seed, dtype)?;
        assert!(!gate.is_contiguous());
        for gate in [gate.clone(), gate.contiguous()?] {
            let sigmoid = (gate.to_dtype(DType::F32)?.neg()?.exp()? + 1.0)?
                .recip()?
                .to_dtype(dtype)?;
            let expected = (&x * sigmoid)?;
            let y = sigmoid_gate_mul(&x, &gate)?;
            assert!(y.is_contiguous());
            assert_eq!(y.dims(), &DIMS);
            assert_eq!(y.dtype(), dtype);
            assert_eq!(f32_values(&y)?, f32_values(&expected)?, "{dtype:?}");
        }
    }
    // A transposed `x` is read through its layout.
    let (x, gate) = inputs(4, DType::BF16)?;
    let x_t = x.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
    assert!(!x_t.is_contiguous());
    assert_eq!(
        f32_values(&sigmoid_gate_mul(&x_t, &gate)?)?,
        f32_values(&sigmoid_gate_mul(&x, &gate)?)?
    );
    Ok(())
}

#[test]
fn sigmoid_gate_mul_f32_matches_f64_reference() -> Result<()> {
    let (x, gate) = inputs(5, DType::F32)?;
    let expected: Vec<f64> = f64_values(&x)?
        .into_iter()
        .zip(f64_values(&gate)?)
        .map(|(x, g)| x / (1.0 + (-g).exp()))
        .collect();
    // exp, the sum, the division and the product: a few roundings of f32.
    assert_close(
        &f32_values(&sigmoid_gate_mul(&x, &gate)?)?,
        &expected,
        0.0,
        1e-6,
    );
    Ok(())
}

#[test]
fn sigmoid_gate_mul_rejects_bad_arguments() -> Result<()> {
    let zeros = |dims: &[usize], dtype: DType| Tensor::zeros(dims, dtype, &Device::Cpu);
    let x = zeros(&DIMS, DType::BF16)?;
    let cases = [
        ("x", sigmoid_gate_mul(&x.flatten_to(1)?, &x.flatten_to(1)?)),
        ("x", sigmoid_gate_mul(&zeros(&DIMS, DType::U32)?, &x)),
        (
            "gate",
            sigmoid_gate_mul(&x, &zeros(&[2, 3, 4, 8], DType::BF16)?),
        ),
        ("gate", sigmoid_gate_mul(&x, &x.to_dtype(DType::F32)?)),
        ("gate", sigmoid_gate_mul(&x, &x.flatten_to(1)?)),
    ];
    for (expected_arg, result) in cases {
        assert_rejects(result, "sigmoid_gate_mul", expected_arg);
    }
    Ok(())
}
