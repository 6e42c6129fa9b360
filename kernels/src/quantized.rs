//! Projections whose weights are quantized in GGUF blocks (the host's
//! in-situ quantization), for decode-sized batches.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Tensor};

use crate::{ensure, expect_same_device, expect_same_dtype, float_dims, invalid_argument, Result};

const OP: &str = "quantized_matmul";

/// Whether [`quantized_matmul`] and [`crate::moe_experts_quantized`] take
/// weights quantized to `dtype`: ggml's `q8_0` and `q4_K`.
pub fn takes_gguf_dtype(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::Q8_0 | GgmlDType::Q4K)
}

/// `y = x W^T` with `W` quantized in GGUF blocks:
///
/// ```text
/// y[n, j] = round(sum_c x[n, c] * w[j, c])    (f32 products and sums)
/// ```
///
/// where `w` is the value each block defines (ggml's dequantization, in f32)
/// and `round` rounds to the dtype of `x`.
///
/// * `x`: `[N, in]`, any float dtype.
/// * `weight`: `[out, in]` of a type [`takes_gguf_dtype`] takes, on the
///   device of `x`.
///
/// Returns `[N, out]` in the dtype of `x`. On CUDA one launch streams each
/// weight row once per group of up to 8 rows of `x`, decoding its blocks as
/// it goes (made for decode steps: `x` is read from the cache once per
/// group); the CPU reference dequantizes `W` and multiplies in f32.
pub fn quantized_matmul(x: &Tensor, weight: &QTensor) -> Result<Tensor> {
    let [_, in_dim] = float_dims::<2>(OP, "x", x)?;
    let [_, weight_in] = gguf_dims::<2>(OP, "weight", weight)?;
    ensure(weight_in == in_dim, OP, "weight", || {
        format!("{weight_in} columns for inputs of width {in_dim}")
    })?;
    let device = x.device();
    expect_same_device(OP, "weight", &weight.device(), device)?;
    on_device!(
        OP,
        device,
        {
            let weight = weight.dequantize(device)?;
            Ok(x.to_dtype(DType::F32)?
                .matmul(&weight.t()?)?
                .to_dtype(x.dtype())?)
        },
        crate::cuda::quantized_matmul(OP, x, weight, None),
    )
}

const WITH_DENSE_OP: &str = "quantized_matmul_with_dense";

/// [`quantized_matmul`] of `weight` followed by the product with `dense`, as
/// one output: the quantized and the full-precision projections of one input
/// (a model keeps some projections unquantized beside quantized ones):
///
/// ```text
/// y = [quantized_matmul(x, W), round(x D^T)]    (f32 products and sums)
/// ```
///
/// * `x`: `[N, in]`, any float dtype.
/// * `weight`: `[out, in]` of a type [`takes_gguf_dtype`] takes, on the
///   device of `x`.
/// * `dense`: `[dense_out, in]` in the dtype of `x`, on its device.
///
/// Returns `[N, out + dense_out]` in the dtype of `x`. On CUDA one launch
/// computes both (each weight row streamed once per group of up to 8 rows of
/// `x`), where two would; the CPU reference runs the two products.
pub fn quantized_matmul_with_dense(x: &Tensor, weight: &QTensor, dense: &Tensor) -> Result<Tensor> {
    let [_, in_dim] = float_dims::<2>(WITH_DENSE_OP, "x", x)?;
    let [_, weight_in] = gguf_dims::<2>(WITH_DENSE_OP, "weight", weight)?;
    ensure(weight_in == in_dim, WITH_DENSE_OP, "weight", || {
        format!("{weight_in} columns for inputs of width {in_dim}")
    })?;
    let [_, dense_in] = float_dims::<2>(WITH_DENSE_OP, "dense", dense)?;
    ensure(dense_in == in_dim, WITH_DENSE_OP, "dense", || {
        format!("{dense_in} columns for inputs of width {in_dim}")
    })?;
    expect_same_dtype(WITH_DENSE_OP, "dense", dense, x.dtype(), "the dtype of `x`")?;
    let device = x.device();
    expect_same_device(WITH_DENSE_OP, "weight", &weight.device(), device)?;
    expect_same_device(WITH_DENSE_OP, "dense", dense.device(), device)?;
    on_device!(
        WITH_DENSE_OP,
        device,
        {
            let quantized = quantized_matmul(x, weight)?;
            let full = x
                .to_dtype(DType::F32)?
                .matmul(&dense.to_dtype(DType::F32)?.t()?)?
                .to_dtype(x.dtype())?;
            Ok(Tensor::cat(&[quantized, full], 1)?)
        },
        crate::cuda::quantized_matmul(WITH_DENSE_OP, x, weight, Some(dense)),
    )
}

const DENSE_OP: &str = "decode_matmul";

/// `y = x W^T` for the few rows of a decode step, with full-precision `W`:
///
/// ```text
/// y[n, j] = round(sum_c x[n, c] * w[j, c])    (f32 products and sums)
/// ```
///
/// where `round` rounds to the dtype of `x`, as a reference `Linear` in that
/// dtype rounds its output once.
///
/// * `x`: `[N, in]`, any float dtype.
/// * `weight`: `[out, in]` in the dtype of `x`, on its device.
///
/// Returns `[N, out]` in the dtype of `x`. On CUDA [`quantized_matmul`]'s
/// kernel without quantized rows: one warp per output column streams its
/// weight row once per group of up to 8 rows of `x`; the CPU reference
/// multiplies in f32.
pub fn decode_matmul(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let [_, in_dim] = float_dims::<2>(DENSE_OP, "x", x)?;
    let [_, weight_in] = float_dims::<2>(DENSE_OP, "weight", weight)?;
    ensure(weight_in == in_dim, DENSE_OP, "weight", || {
        format!("{weight_in} columns for inputs of width {in_dim}")
    })?;
    expect_same_dtype(DENSE_OP, "weight", weight, x.dtype(), "the dtype of `x`")?;
    let device = x.device();
    expect_same_device(DENSE_OP, "weight", weight.device(), device)?;
    on_device!(
        DENSE_OP,
        device,
        Ok(x.to_dtype(DType::F32)?
            .matmul(&weight.to_dtype(DType::F32)?.t()?)?
            .to_dtype(x.dtype())?),
        crate::cuda::dense_matmul(DENSE_OP, x, weight),
    )
}

/// The dims of `tensor` (argument `arg` of `op`), which must have rank
/// `RANK` and a type [`takes_gguf_dtype`] takes.
pub(crate) fn gguf_dims<const RANK: usize>(
    op: &'static str,
    arg: &'static str,
    tensor: &QTensor,
) -> Result<[usize; RANK]> {
    ensure(takes_gguf_dtype(tensor.dtype()), op, arg, || {
        format!(
            "quantized to {:?}; the kernels take q8_0 and q4_K",
            tensor.dtype()
        )
    })?;
    <[usize; RANK]>::try_from(tensor.shape().dims()).map_err(|_| {
        invalid_argument(
            op,
            arg,
            format!(
                "expected rank {RANK}, got shape {:?}",
                tensor.shape().dims()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Integer weights whose every q8_0 block holds ±127: the block scale is
    /// exactly 1, so the blocks hold the weights exactly and the product is
    /// candle's f32 matmul of the weights themselves.
    #[test]
    fn q8_0_blocks_of_exact_weights_multiply_as_the_weights() -> Result<()> {
        let (out_dim, in_dim) = (3, 64);
        let values: Vec<f32> = (0..out_dim * in_dim)
            .map(|i| match i % 32 {
                0 => 127.0,
                1 => -127.0,
                k => ((k * 37 + i / 32 * 11) % 255) as f32 - 127.0,
            })
            .collect();
        let weight = Tensor::from_vec(values, (out_dim, in_dim), &Device::Cpu)?;
        let blocks = QTensor::quantize(&weight, GgmlDType::Q8_0)?;
        let x = Tensor::arange(0f32, (2 * in_dim) as f32, &Device::Cpu)?
            .affine(1.0 / 64.0, -1.0)?
            .reshape((2, in_dim))?;
        for dtype in [DType::F32, DType::BF16] {
            let x = x.to_dtype(dtype)?;
            let expected = x
                .to_dtype(DType::F32)?
                .matmul(&weight.t()?)?
                .to_dtype(dtype)?;
            let got = quantized_matmul(&x, &blocks)?;
            assert_eq!(got.dtype(), dtype);
            let difference = (got.to_dtype(DType::F32)? - expected.to_dtype(DType::F32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert_eq!(difference, 0.0, "{dtype:?}");
        }
        Ok(())
    }

    /// Exact q8_0 blocks (every block scale 1) and two full-precision rows:
    /// one output, the product with both weights stacked.
    #[test]
    fn dense_rows_follow_the_quantized_ones_in_one_output() -> Result<()> {
        let (out_dim, in_dim) = (3, 64);
        let values: Vec<f32> = (0..out_dim * in_dim)
            .map(|i| match i % 32 {
                0 => 127.0,
                1 => -127.0,
                k => ((k * 29 + i / 32 * 7) % 255) as f32 - 127.0,
            })
            .collect();
        let weight = Tensor::from_vec(values, (out_dim, in_dim), &Device::Cpu)?;
        let blocks = QTensor::quantize(&weight, GgmlDType::Q8_0)?;
        let dense = Tensor::arange(0f32, (2 * in_dim) as f32, &Device::Cpu)?
            .affine(0.5, -20.0)?
            .reshape((2, in_dim))?;
        let x = Tensor::arange(0f32, (2 * in_dim) as f32, &Device::Cpu)?
            .affine(1.0 / 64.0, -1.0)?
            .reshape((2, in_dim))?;
        let expected = x.matmul(&Tensor::cat(&[&weight, &dense], 0)?.t()?)?;
        let got = quantized_matmul_with_dense(&x, &blocks, &dense)?;
        assert_eq!(got.dims(), &[2, out_dim + 2]);
        let difference = (got - expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(difference, 0.0);
        let error = quantized_matmul_with_dense(&x, &blocks, &dense.narrow(1, 0, 32)?)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("`dense`") && error.contains("32 columns"),
            "{error}"
        );
        Ok(())
    }

    #[test]
    fn other_types_and_shapes_are_refused_by_name() -> Result<()> {
        let weight = Tensor::zeros((4, 256), DType::F32, &Device::Cpu)?;
        let q4_0 = QTensor::quantize(&weight, GgmlDType::Q4_0)?;
        let x = Tensor::zeros((1, 256), DType::F32, &Device::Cpu)?;
        let error = quantized_matmul(&x, &q4_0).unwrap_err().to_string();
        assert!(
            error.contains("`weight`") && error.contains("Q4_0"),
            "{error}"
        );
        let q8_0 = QTensor::quantize(&weight, GgmlDType::Q8_0)?;
        let narrow = Tensor::zeros((1, 128), DType::F32, &Device::Cpu)?;
        let error = quantized_matmul(&narrow, &q8_0).unwrap_err().to_string();
        assert!(
            error.contains("256 columns for inputs of width 128"),
            "{error}"
        );
        Ok(())
    }
}
