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

    /// Loads `{name}.weight` `[out_dim, in_dim]` and, if `with_bias`, `{name}.bias`.
    pub fn load(
        weights: &Weights,
        name: &str,
        in_dim: usize,
        out_dim: usize,
        with_bias: bool,
    ) -> crate::error::Result<Linear> {
        let module = weights.pp(name);
        let weight = module.get((out_dim, in_dim), "weight")?;
        let bias = if with_bias {
            Some(module.get(out_dim, "bias")?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        matmul_add(x, &self.weight.t()?, self.bias.as_ref())
    }
}
