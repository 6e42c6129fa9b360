//! Reading tensors from the checkpoint with errors that name the tensor.

use candle_core::{DType, Device, Shape, Tensor};
use mistralrs_quant::ShardedVarBuilder;

use crate::error::{BerryLmError, Result};

/// A view of the checkpoint below a name prefix.
#[derive(Clone)]
pub struct Weights {
    vb: ShardedVarBuilder,
}

impl Weights {
    pub fn new(vb: ShardedVarBuilder) -> Weights {
        Weights { vb }
    }

    pub fn pp(&self, name: impl ToString) -> Weights {
        Weights {
            vb: self.vb.pp(name),
        }
    }

    pub fn full_name(&self, name: &str) -> String {
        let prefix = self.vb.prefix();
        if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}.{name}")
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.vb.contains_tensor(name)
    }

    pub fn dtype(&self) -> DType {
        self.vb.dtype()
    }

    pub fn device(&self) -> &Device {
        self.vb.device()
    }

    /// The tensor `name` with exactly `shape`, in the model's dtype.
    pub fn get(&self, shape: impl Into<Shape>, name: &str) -> Result<Tensor> {
        let shape = shape.into();
        if !self.contains(name) {
            return Err(BerryLmError::Weight {
                name: self.full_name(name),
                message: format!(
                    "missing from the checkpoint (expected shape {:?})",
                    shape.dims()
                ),
            });
        }
        self.vb
            .get(shape.clone(), name)
            .map_err(|error| BerryLmError::Weight {
                name: self.full_name(name),
                message: match error {
                    candle_core::Error::UnexpectedShape { got, .. } => {
                        format!("has shape {:?}, expected {:?}", got.dims(), shape.dims())
                    }
                    other => other.to_string(),
                },
            })
    }

    /// The tensor `name` if the checkpoint has it.
    pub fn get_optional(&self, shape: impl Into<Shape>, name: &str) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.get(shape, name).map(Some)
        } else {
            Ok(None)
        }
    }
}
