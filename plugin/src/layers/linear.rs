//! A dense projection `y = x W^T (+ b)` on weights stored `[out, in]`.

use candle_core::{Module, Result, Tensor};

use crate::layers::ops::matmul_add;
use crate::weights::Weights;

#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Linear {
        Linear { weight, bias }
    }

    /// `[out_dim, in_dim]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    pub fn out_dim(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Whether `x` is a decode step's few rows on CUDA, which this
    /// projection computes in BerryLM's decode kernel
    /// (`berrylm_kernels::decode_matmul`).
    pub fn takes_decode_matmul(&self, x: &Tensor) -> bool {
        mistralrs_quant::should_use_gemv(x, &self.weight)
    }

    /// Loads `{name}.weight` `[out_dim, in_dim]` and, if `with_bias`, `{name}.bias`.
    pub fn load(
        weights: &Weights,
        name: &str,
        in_dim: usize,
        out_dim: usize,
        with_bias: bool,
    ) -> crate::error::Result<Linear> {
        let module = weights.pp(name);
        let weight = module.projection_weight(out_dim, in_dim)?;
        let bias = if with_bias {
            Some(module.get(out_dim, "bias")?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    /// One projection computing the outputs of `parts` side by side (their
    /// weights' rows stacked in order): the same values, one launch.
    pub fn stacked(parts: &[Linear]) -> Result<Linear> {
        let weights: Vec<&Tensor> = parts.iter().map(|part| &part.weight).collect();
        let biases: Option<Vec<&Tensor>> = parts.iter().map(|part| part.bias.as_ref()).collect();
        let bias = match biases {
            Some(biases) => Some(Tensor::cat(&biases, 0)?),
            None if parts.iter().any(|part| part.bias.is_some()) => {
                candle_core::bail!("stacked projections must all have a bias or none")
            }
            None => None,
        };
        Ok(Linear {
            weight: Tensor::cat(&weights, 0)?,
            bias,
        })
    }

    /// The projection of its output rows `offset..offset + width` (views of
    /// its weight and bias).
    pub fn rows(&self, offset: usize, width: usize) -> Result<Linear> {
        Ok(Linear {
            weight: self.weight.narrow(0, offset, width)?,
            bias: self
                .bias
                .as_ref()
                .map(|bias| bias.narrow(0, offset, width))
                .transpose()?,
        })
    }

    /// The same projection with zero rows appended, so that its output width
    /// is a multiple of `multiple`: outputs `out_dim..` are zeros to be
    /// ignored.
    pub fn with_rows_padded_to(self, multiple: usize) -> Result<Linear> {
        let rows = self.out_dim();
        let padding = rows.next_multiple_of(multiple) - rows;
        if padding == 0 {
            return Ok(self);
        }
        let pad = |tensor: &Tensor| -> Result<Tensor> {
            let mut dims = tensor.dims().to_vec();
            dims[0] = padding;
            let zeros = Tensor::zeros(dims, tensor.dtype(), tensor.device())?;
            Tensor::cat(&[tensor, &zeros], 0)
        };
        Ok(Linear {
            weight: pad(&self.weight)?,
            bias: self.bias.as_ref().map(pad).transpose()?,
        })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // A view of several rows (a column slice of a stacked projection's
        // output) is copied first by BerryLM's kernel: the products below
        // would copy it with candle's, which uploads the view's layout from
        // host memory, a copy a decode graph cannot capture.
        let x = berrylm_kernels::contiguous(x)?;
        // Up to 8 rows on CUDA (decode) take BerryLM's decode kernel (one
        // warp per output column, each weight row streamed once for all
        // rows): one launch, cheaper for the host to dispatch than a cuBLAS
        // product (docs/performance.md).
        #[cfg(feature = "cuda")]
        if self.takes_decode_matmul(&x) {
            let (out_dim, in_dim) = self.weight.dims2()?;
            let rows = x.reshape(((), in_dim))?;
            let y = berrylm_kernels::decode_matmul(&rows, &self.weight)?;
            let mut dims = x.dims().to_vec();
            if let Some(last) = dims.last_mut() {
                *last = out_dim;
            }
            let y = y.reshape(dims)?;
            return match &self.bias {
                Some(bias) => y.broadcast_add(bias),
                None => Ok(y),
            };
        }
        matmul_add(&x, &self.weight.t()?, self.bias.as_ref())
    }
}
